"""The Rust fleet prefix index against the pure-Python reference (lockstep, hypothesis), and
its behaviour on bad input: atomic errors, unknown instances, sizes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_streams import INSTANCES, MEDIA, chain_of, fleet_stream, queries
from kvblock import hashing
from kvblock.cluster import DictIndex, PrefixIndex, parent_tag
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch


def stored(hashes, parent=None, medium="GPU", **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=kw.pop("block_size", 16),
                       lora_id=None, medium=medium, lora_name=None, **kw)


def same(ix, ref, qs):
    for q in qs:
        ch = chain_of(q)
        for medium in (None,) + MEDIA[:2]:
            assert ix.match(ch, medium) == ref.match(ch, medium), (q, medium)
            dense = ix.match_dense(ch, medium)
            want = ref.match(ch, medium)
            for name in ix.instances():
                assert dense[ix.instance_id(name)] == want.get(name, 0)


@settings(max_examples=300, deadline=None)
@given(fleet_stream(), queries)
def test_lockstep_with_reference(stream, qs):
    ix, ref = PrefixIndex(), DictIndex()
    for i, (inst, payload) in enumerate(stream):
        assert ix.apply(inst, payload) == ref.apply(inst, payload)
        if i % 5 == 4:
            same(ix, ref, qs)
    same(ix, ref, qs)
    assert ix.num_pairs() == ref.num_pairs()
    assert ix.num_nodes() == ref.num_nodes()
    for name in ix.instances():
        assert ix.instance_pairs(name) == sum(
            1 for t in ref.blocks.values() for node in t.values() for s in node.values() if name in s)
    # removing an instance leaves the same state in both
    ix.remove_instance(INSTANCES[0]) if INSTANCES[0] in ix.instances() else None
    ref.remove_instance(INSTANCES[0]) if INSTANCES[0] in ref.instances() else None
    same(ix, ref, qs)
    assert ix.num_pairs() == ref.num_pairs()


def test_chain_walk_and_media():
    ix = PrefixIndex(block_size=16)
    a = [11, 12, 13, 14]
    ix.apply_events("gpu0", [stored(a)])
    ix.apply_events("gpu1", [stored(a[:2]), stored(a[2:3], a[1], medium="CPU")])
    assert ix.match(a) == {"gpu0": 4, "gpu1": 3}
    assert ix.match(a, "GPU") == {"gpu0": 4, "gpu1": 2}
    assert ix.match(a, "CPU") == {}  # CPU holds block 2 only, not a prefix
    assert ix.match(a[1:]) == {}  # a chain starts at the root
    assert ix.match([11, 99, 13]) == {"gpu0": 1, "gpu1": 1}  # 13's parent is 12, not 99
    # events of another block size or group are skipped and counted
    assert ix.apply_events("gpu2", [stored([11], block_size=32), stored([11], group_idx=1)])[3] == 2
    assert "gpu2" not in ix.match(a)
    # digests are looked up by their event int
    d = (11).to_bytes(32, "big")
    assert ix.match([d]) == {"gpu0": 1, "gpu1": 1}
    assert hashing.block_hash_to_event_int(d) == 11


def test_parent_tags_are_vllm_event_ints():
    assert parent_tag(None) == 0
    assert parent_tag(5) == parent_tag((5).to_bytes(32, "big")) != 0


def test_events_after_all_blocks_cleared():
    ix = PrefixIndex()
    a, b = [1, 2, 3], [7, 8]
    ix.apply_events("e", [stored(a), AllBlocksCleared(), stored(b)])
    assert ix.match(a) == {} and ix.match(b) == {"e": 2}
    ix.apply_events("e", [stored(a), BlockRemoved(block_hashes=[2], medium="GPU")])
    assert ix.match(a) == {"e": 1}
    assert ix.num_pairs() == 4


def test_restore_under_another_parent():
    ix, ref = PrefixIndex(), DictIndex()
    for x in (ix, ref):
        x.store("e", [1, 2])
        x.store("e", [3], 2)
        x.store("e", [3], 1)  # block 3 now under parent 1
    for q in ([1, 2, 3], [1, 3]):
        assert ix.match(q) == ref.match(q)
    assert ix.match([1, 3]) == {"e": 2} and ix.match([1, 2, 3]) == {"e": 2}


MALFORMED = [
    b"",
    b"\xc1",
    b"\x90",  # empty array
    b"\x92\xcb" + b"\0" * 8 + b"\x91\x81\xa4type\xa5Nope!",  # unknown event type
    msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # missing fields
    msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}]]),
    msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": "GPU"}]]),
    msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]]),
    encode_batch([stored([1, 2])], ts=0.0) + b"\x00",  # trailing byte
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_malformed_payload_changes_nothing(payload):
    for ix in (PrefixIndex(), DictIndex()):
        ix.apply("e", encode_batch([stored([1, 2, 3])], ts=0.0))
        before = (ix.match([1, 2, 3]), ix.num_pairs(), ix.instances())
        with pytest.raises(ValueError, match="malformed"):
            ix.apply("e", payload)
        with pytest.raises(ValueError, match="malformed"):
            ix.apply("new", payload)
        assert (ix.match([1, 2, 3]), ix.num_pairs(), ix.instances()) == before


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash(data):
    ix = PrefixIndex()
    ix.apply("e", encode_batch([stored([1, 2])], ts=0.0))
    try:
        ix.apply("e", data)
    except ValueError:
        assert ix.match([1, 2]) == {"e": 2}


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncated_and_mutated_payloads(data):
    payload = encode_batch([stored([1, 2, 3], None), BlockRemoved(block_hashes=[3], medium="GPU")], ts=1.0)
    cut = data.draw(st.integers(0, len(payload) - 1))
    pos = data.draw(st.integers(0, len(payload) - 1))
    byte = data.draw(st.integers(0, 255))
    mutated = payload[:pos] + bytes([byte]) + payload[pos + 1:]
    for bad in (payload[:cut], mutated):
        ix, ref = PrefixIndex(), DictIndex()
        r1 = r2 = None
        try:
            r1 = ix.apply("e", bad)
        except ValueError:
            pass
        try:
            r2 = ref.apply("e", bad)
        except ValueError:
            pass
        if r1 is not None and r2 is not None:
            assert ix.match([1, 2, 3]) == ref.match([1, 2, 3])
        if r1 is None:
            assert ix.num_pairs() == 0


def test_unknown_instances_and_bad_hashes():
    ix = PrefixIndex()
    with pytest.raises(KeyError):
        ix.remove_instance("nope")
    with pytest.raises(KeyError):
        ix.clear_instance("nope")
    assert ix.match([1, 2]) == {}
    assert ix.match_instances([1], ["nope"]) == {"nope": 0}
    with pytest.raises(ValueError):
        ix.match([-1])
    with pytest.raises(ValueError):
        ix.match([2**64])
    with pytest.raises(TypeError):
        ix.match([1.5])
    with pytest.raises(TypeError):
        ix.match(b"\x01\x02")
    with pytest.raises(ValueError):
        PrefixIndex(block_size=0)


def test_expire_remove_and_memory():
    ix = PrefixIndex()
    ix.apply("a", encode_batch([stored(list(range(1, 1001)))], ts=0.0), now_ms=1_000)
    ix.apply("b", encode_batch([stored(list(range(1, 501)))], ts=0.0), now_ms=9_000)
    assert ix.num_pairs() == 1500 and ix.num_nodes() == 1000
    assert 0 < ix.bytes_per_pair() < 64
    assert ix.expire(10_000, 5_000) == ["a"]
    assert ix.instances() == ["b"] and ix.num_pairs() == 500
    assert ix.match(list(range(1, 1001))) == {"b": 500}
    # a new instance reuses the freed id; nothing of "a" comes back
    ix.add_instance("c")
    assert ix.match(list(range(1, 10))) == {"b": 9}
    assert ix.remove_instance("b") == 500 and ix.num_nodes() == 0


def test_wide_fleet():
    ix, ref = PrefixIndex(), DictIndex()
    for i in range(200):
        n = 1 + i % 7
        for x in (ix, ref):
            x.store(f"e{i}", list(range(1, n + 1)))
    assert ix.match(list(range(1, 8))) == ref.match(list(range(1, 8)))
    assert len(ix.match([1])) == 200


LONE = "e\udc80"  # a lone surrogate: a str UTF-8 cannot encode


@pytest.mark.parametrize("call", [
    lambda ix: ix.add_instance(LONE),
    lambda ix: ix.store(LONE, [1]),
    lambda ix: ix.remove(LONE, [1]),
    lambda ix: ix.apply(LONE, encode_batch([], ts=0.0)),
    lambda ix: ix.clear_instance(LONE),
    lambda ix: ix.instance_id(LONE),
])
def test_instance_name_that_is_not_utf8_is_a_value_error_naming_it(call):
    ix = PrefixIndex()
    ix.store("e0", [1, 2])
    with pytest.raises(ValueError, match=r"^name: .*lone surrogate") as e:
        call(ix)
    assert not isinstance(e.value, UnicodeError)
    assert ix.instances() == ["e0"] and ix.match([1, 2]) == {"e0": 2}


@pytest.mark.parametrize("call", [
    lambda ix: ix.add_instance(""),
    lambda ix: ix.store("", [1, 2]),
    lambda ix: ix.apply("", encode_batch([BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=[1, 2],
                                                      block_size=2, lora_id=None, medium="GPU", lora_name=None)], ts=0.0)),
    lambda ix: ix.touch("", 5),
])
def test_empty_instance_name_is_refused_changing_nothing(call):
    """An instance needs a name (the index service allows 1-128 characters): registering
    an empty one, directly or by its first event, is a ValueError naming ``name``."""
    ix = PrefixIndex()
    ix.store("e0", [1, 2])
    before = (ix.instances(), ix.num_pairs(), ix.memory_bytes())
    with pytest.raises(ValueError, match=r"^name: .*empty"):
        call(ix)
    assert (ix.instances(), ix.num_pairs(), ix.memory_bytes()) == before
    assert ix.match([1, 2]) == {"e0": 2} and ix.match([3]) == {}


def test_memory_bytes_counts_the_instance_table():
    ix = PrefixIndex()
    empty = ix.memory_bytes()
    for i in range(500):
        ix.add_instance(f"instance-{i:04d}")
    grown = ix.memory_bytes() - empty
    assert grown >= 500 * (2 * len("instance-0000") + 8)  # each name twice, and more
    for i in range(500):
        ix.remove_instance(f"instance-{i:04d}")
    assert ix.memory_bytes() >= empty  # capacity kept, never negative


def test_match_names_follow_reused_ids():
    """``match`` caches instance names by id: a removed instance's id, reused, answers with
    the new name."""
    ix = PrefixIndex()
    ix.store("a", [1, 2], None, "GPU")
    ix.store("b", [1], None, "GPU")
    assert ix.match([1, 2]) == {"a": 2, "b": 1}
    ix.remove_instance("a")
    ix.store("c", [1, 2, 3], None, "GPU")
    assert ix.instance_id("c") == 0
    assert ix.match([1, 2, 3]) == {"b": 1, "c": 3}
    ix.touch("b", 10)
    ix.touch("c", 1_000)
    assert ix.expire(1_000, 100) == ["b"]
    ix.store("d", [1], None, "GPU")
    assert ix.match([1, 2, 3]) == {"c": 3, "d": 1}
