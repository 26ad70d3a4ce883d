"""KV cache events in vLLM 0.33.0's msgpack wire format (spec §8).

The structs mirror ``vllm.distributed.kv_events``: every event is a msgpack *map* tagged with
``"type"`` (the class name); fields without a default are always present, defaulted ones are
omitted when equal to the default. A :class:`KVEventBatch` is an array
``[ts, events, data_parallel_rank]``. Hashes are the 64-bit ints of
:func:`kvblock.hashing.block_hash_to_event_int` by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the raw digest bytes.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any, Union

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

ExternalBlockHash = Union[bytes, int]


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base class of KV cache events (a msgpack map with a ``"type"`` key)."""


class BlockStored(KVCacheEvent):
    """Full blocks were cached: their hashes, the parent hash, their token ids."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """A cached block lost its key (eviction)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """``reset_prefix_cache`` cleared every key."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    """One scheduler step's KV events: ``[ts, [event, ...], data_parallel_rank]``."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


#: the event classes a batch carries, by name: this module's and vLLM's own
#: (``vllm.distributed.kv_events``, the same msgspec wire format)
_EVENT_NAMES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
#: event classes already checked (this module's, then vLLM's as they come)
_event_classes: set[type] = {BlockStored, BlockRemoved, AllBlocksCleared}
_EVENT_EXPECTED = "BlockStored, BlockRemoved or AllBlocksCleared, kvblock.events' or vLLM's"


def _is_event(ev: object) -> bool:
    cls = type(ev)
    if cls in _event_classes:
        return True
    if isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)) or (
            isinstance(ev, msgspec.Struct) and cls.__name__ in _EVENT_NAMES):
        _event_classes.add(cls)
        return True
    return False


def encode_batch(events: list[KVCacheEvent], ts: float | None = None, data_parallel_rank: int | None = None) -> bytes:
    """msgpack bytes of a :class:`KVEventBatch` (``ts`` defaults to ``time.time()``).

    Args:
        events: a list (or tuple) of :class:`BlockStored` / :class:`BlockRemoved` /
            :class:`AllBlocksCleared`, this module's or vLLM's (``vllm.distributed.kv_events``).
        ts: the batch's timestamp, a finite number (seconds since the epoch in vLLM's).
        data_parallel_rank: the engine's data-parallel rank, an int >= 0, or None.

    Raises:
        TypeError: ``events`` is not a list of such events, ``ts`` not a number or
            ``data_parallel_rank`` not an int (each named); nothing is encoded.
        ValueError: ``ts`` not finite, ``data_parallel_rank`` negative.
    """
    if not isinstance(events, (list, tuple)):
        raise TypeError(f"events: expected a list of KV cache events ({_EVENT_EXPECTED}), got "
                        f"{type(events).__name__}")
    for i, ev in enumerate(events):
        if not _is_event(ev):
            raise TypeError(f"events[{i}]: expected a KV cache event ({_EVENT_EXPECTED}), got {type(ev).__name__}")
    if ts is None:
        ts = time.time()
    elif isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise TypeError(f"ts: expected a number (seconds) or None, got {type(ts).__name__}")
    elif not math.isfinite(ts):
        raise ValueError(f"ts: expected a finite number, got {ts!r}")
    if data_parallel_rank is not None:
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int):
            raise TypeError(f"data_parallel_rank: expected an int or None, got {type(data_parallel_rank).__name__}")
        if data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank: expected an int >= 0 or None, got {data_parallel_rank}")
    return _encoder.encode(KVEventBatch(ts=float(ts), events=events if isinstance(events, list) else list(events),
                                        data_parallel_rank=data_parallel_rank))


def decode_batch(data: bytes) -> KVEventBatch:
    """Parse the bytes of a :class:`KVEventBatch`.

    Raises:
        TypeError: ``data`` is not bytes-like (bytes, bytearray, memoryview).
        msgspec.DecodeError: ``data`` is not a batch in vLLM's msgpack format (malformed, an
            unknown event type, a missing field or a field of the wrong type:
            ``msgspec.ValidationError``, a subclass); a ValueError, naming ``data``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected the bytes of a KV event batch, got {type(data).__name__}")
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError included; the same class, with context
        raise type(e)(f"data: not a KV event batch in vLLM's msgpack format ({e})") from None


def block_stored_for_request(
    request: Any,
    block_hashes: list[bytes],
    parent_block_hash: bytes | None,
    token_start: int,
    token_end: int,
    block_size: int,
    group_idx: int,
    key_ranges: Sequence[tuple[int, int]],
    tokens: tuple[Sequence[int], int] | None = None,
    *,
    medium: str | None = "GPU",
    use_int: bool | None = None,
    lookahead: int = 0,
    cls: Any = None,
) -> BlockStored:
    """The ``BlockStored`` vLLM 0.33.0 publishes when blocks of ``request`` are cached.

    Args:
        request: the request (or the snapshot of its fields kvblock's pool took when the
            blocks were cached); None for blocks cached through the pool's id API, whose
            events have empty ``token_ids`` and no extra keys.
        block_hashes: the stored blocks' hashes (null and masked-out blocks have none).
        parent_block_hash: the hash before the first block of the range, or None.
        token_start, token_end: the event's ``token_ids`` are ``all_token_ids[token_start:
            token_end]`` (null blocks of the range included, as vLLM's are).
        block_size: the event's ``block_size``.
        group_idx: the KV-cache group.
        key_ranges: the ``[start, end)`` token range of each stored block: its untagged extra
            keys, and with lookahead hashing its ``lookahead`` following tokens, come from
            there.
        tokens: ``(token_ids, first_index)``: the request's tokens from ``first_index`` on,
            as they were when the blocks were cached (kvblock's pool copies them then, as vLLM
            builds the event then); otherwise ``request.all_token_ids`` is read now.
        medium: the event's ``medium``.
        use_int: hashes as 64-bit ints (default: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
        lookahead: the pool's ``num_hash_lookahead_tokens``.
        cls: the event class (default :class:`BlockStored`; vLLM's own for
            :mod:`kvblock.vllm`).
    """
    from .hashing import maybe_convert_block_hash
    from .extra_keys import generate_block_hash_extra_keys, to_event_extra_keys

    if cls is None:
        cls = BlockStored
    if use_int is None:  # read once per event, not once per block
        use_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    hashes = [maybe_convert_block_hash(h, use_int) for h in block_hashes]
    parent = None if parent_block_hash is None else maybe_convert_block_hash(parent_block_hash, use_int)
    if request is None:
        return cls(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=[],
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=[None] * len(block_hashes) or None,
            group_idx=group_idx,
        )
    if tokens is not None:
        toks, first = tokens

        def span(a: int, b: int) -> list[int]:
            return list(toks[a - first : b - first])
    else:
        all_ids = request.all_token_ids

        def span(a: int, b: int) -> list[int]:
            return list(all_ids[a:b])

    if not (
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    ):
        # nothing to key on: every block's extra keys are None (what the keys below give)
        extra: list[Any] = [None] * len(key_ranges)
    else:
        extra = [
            to_event_extra_keys(generate_block_hash_extra_keys(request, s, e + lookahead, 0)[0]) for s, e in key_ranges
        ]
    lora = request.lora_request
    # vLLM 0.32's BlockStored has no lookahead_token_ids field (a hash lookahead is 0.33+)
    ahead: dict[str, Any] = (
        {"lookahead_token_ids": [span(e, e + lookahead) for _, e in key_ranges]} if lookahead else {}
    )
    return cls(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=span(token_start, token_end),
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.name if lora else None,
        extra_keys=extra or None,
        group_idx=group_idx,
        session_id=getattr(request, "session_id", None),
        **ahead,
    )


def block_removed(
    block_hash: bytes, group_idx: int, medium: str | None = "GPU", use_int: bool | None = None, cls: Any = None
) -> BlockRemoved:
    """The ``BlockRemoved`` vLLM publishes when a cached block loses its key (``cls``: the
    event class, default :class:`BlockRemoved`)."""
    from .hashing import maybe_convert_block_hash

    return (cls or BlockRemoved)(block_hashes=[maybe_convert_block_hash(block_hash, use_int)], medium=medium, group_idx=group_idx)
