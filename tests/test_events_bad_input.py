"""``kvblock.events``' public functions refuse bad input with an exception naming the argument,
before anything is encoded: ``encode_batch(None)`` and ``encode_batch([1])`` returned msgpack
bytes (a batch no subscriber can decode), a ``ts`` or ``data_parallel_rank`` of the wrong type
went onto the wire, and ``decode_batch`` given garbage raised msgspec's bare words (``Expected
`array`, got `int```) or, for a str or None, a TypeError naming nothing (a new user's find).
Events of vLLM's own classes (the same msgspec structs, by name) are still encoded."""

from __future__ import annotations

import math

import msgspec
import pytest
from conftest import require_module

from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch


def _stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
                       block_size=16, lora_id=None, medium="GPU", lora_name=None)


GOOD = [_stored([1, 2]), BlockRemoved(block_hashes=[2], medium="GPU"), AllBlocksCleared()]


@pytest.mark.parametrize("events", [None, 1, "events", b"\x90", {"a": 1}, _stored([1])],
                         ids=["None", "int", "str", "bytes", "dict", "one-event-not-a-list"])
def test_events_not_a_list(events):
    with pytest.raises(TypeError, match=r"^events: expected a list of KV cache events \(BlockStored, BlockRemoved or "
                       r"AllBlocksCleared, kvblock.events' or vLLM's\), got " + type(events).__name__):
        encode_batch(events, ts=0.0)


@pytest.mark.parametrize("bad", [1, None, "BlockStored", {"type": "BlockStored"}, 1.5, KVEventBatch(ts=0.0, events=[])],
                         ids=["int", "None", "str", "dict", "float", "batch"])
def test_an_element_that_is_not_an_event_is_named_by_index(bad):
    with pytest.raises(TypeError, match=rf"^events\[1\]: expected a KV cache event .*got {type(bad).__name__}$"):
        encode_batch([GOOD[0], bad], ts=0.0)


@pytest.mark.parametrize("ts, exc, message", [
    ("1", TypeError, "ts: expected a number (seconds) or None, got str"),
    (True, TypeError, "ts: expected a number (seconds) or None, got bool"),
    ([0.0], TypeError, "ts: expected a number (seconds) or None, got list"),
    (math.nan, ValueError, "ts: expected a finite number, got nan"),
    (math.inf, ValueError, "ts: expected a finite number, got inf"),
])
def test_ts_is_a_finite_number(ts, exc, message):
    with pytest.raises(exc) as e:
        encode_batch(GOOD, ts=ts)
    assert str(e.value) == message


@pytest.mark.parametrize("rank, exc, message", [
    ("0", TypeError, "data_parallel_rank: expected an int or None, got str"),
    (1.0, TypeError, "data_parallel_rank: expected an int or None, got float"),
    (False, TypeError, "data_parallel_rank: expected an int or None, got bool"),
    (-1, ValueError, "data_parallel_rank: expected an int >= 0 or None, got -1"),
])
def test_data_parallel_rank_is_an_int_or_none(rank, exc, message):
    with pytest.raises(exc) as e:
        encode_batch(GOOD, ts=0.0, data_parallel_rank=rank)
    assert str(e.value) == message


def test_good_batches_round_trip():
    for events in (GOOD, tuple(GOOD), []):
        b = decode_batch(encode_batch(events, ts=2, data_parallel_rank=3))
        assert b.ts == 2.0 and b.data_parallel_rank == 3 and b.events == list(events)
    assert decode_batch(bytearray(encode_batch(GOOD, ts=1.5))).events == GOOD
    assert decode_batch(memoryview(encode_batch(GOOD))).data_parallel_rank is None


def test_events_of_classes_named_as_vllms_are_encoded():
    """vLLM's event classes are other msgspec structs of the same names and wire format
    (``PrefixIndex.apply_events`` takes them): a stand-in encodes to the bytes of kvblock's
    event; a struct of another name is refused."""

    class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True):
        pass

    class BlockRemoved(KVCacheEvent):  # vLLM's name, not kvblock's class
        block_hashes: list[int]
        medium: str | None

    class BlockMoved(KVCacheEvent):
        block_hashes: list[int]

    assert encode_batch([BlockRemoved(block_hashes=[2], medium="GPU")], ts=0.0) == encode_batch([GOOD[1]], ts=0.0)
    with pytest.raises(TypeError, match=r"^events\[0\]: .*got BlockMoved$"):
        encode_batch([BlockMoved(block_hashes=[2])], ts=0.0)


def test_events_of_vllms_own_classes_are_encoded():
    kv_events = require_module("vllm.distributed.kv_events")
    theirs = [kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)),
                                    block_size=16, lora_id=None, medium="GPU", lora_name=None),
              kv_events.BlockRemoved(block_hashes=[2], medium="GPU"), kv_events.AllBlocksCleared()]
    assert decode_batch(encode_batch(theirs, ts=0.0, data_parallel_rank=1)).events == GOOD


@pytest.mark.parametrize("data", [None, "\x90", 1, [0.0, []]], ids=["None", "str", "int", "list"])
def test_decode_batch_needs_bytes(data):
    with pytest.raises(TypeError, match=rf"^data: expected the bytes of a KV event batch, got {type(data).__name__}$"):
        decode_batch(data)


@pytest.mark.parametrize("data, exc, detail", [
    (b"", msgspec.DecodeError, "Input data was truncated"),
    (b"\x01", msgspec.ValidationError, "Expected `array`, got `int`"),
    (b"\xc1", msgspec.DecodeError, "invalid opcode"),
    (msgspec.msgpack.encode([0.0, [{"type": "Nope"}]]), msgspec.ValidationError, "Invalid value 'Nope'"),
    (msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved"}]]), msgspec.ValidationError, "missing required field"),
    (encode_batch(GOOD, ts=0.0) + b"\x00", msgspec.DecodeError, "trailing characters"),
])
def test_decode_batch_garbage_is_named(data, exc, detail):
    """msgspec's own class (a ValueError; ``ValidationError`` a ``DecodeError``), its detail
    kept, the argument and what it should have been said first."""
    with pytest.raises(exc) as e:
        decode_batch(data)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith("data: not a KV event batch in vLLM's msgpack format (") and detail in str(e.value)
