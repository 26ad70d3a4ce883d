"""The pool's id API refuses bad input with kvblock's documented types, changing nothing
(new-user finding L10): ``cache_ids`` on a block that already holds a key is a ``ValueError``
(it was an ``AssertionError``), and on the pool of a manager a ``group_id`` past the manager's
KV-cache groups is a ``ValueError`` naming it (``lookup_prefix`` answered ``[]``).

A later new user's findings: a block listed twice in one ``cache_ids`` (or kvblock's own
``cache_full_blocks``) was keyed twice, its first key dropped while the events claimed it
stored; ``move_block_hash_ids`` gave the null block a
key (the manager then handed block 0 out as a hit); group-id lists and ``group_id`` said
``OverflowError`` naming nothing for ``-1``; ``block_size=-16`` said "must be >= 0" where 0
said "must be > 0"; ``set_time(nan)`` was taken with retention off. Each is now refused,
naming the argument, with nothing changed and no event."""

from __future__ import annotations

import numpy as np
import pytest

import kvblock
from conftest import require_module
from kvblock import BlockPool, KVCacheManager, Request
from kvblock.hashing import make_block_hash_with_group_id


def _snapshot(pool: BlockPool) -> tuple:
    return (
        pool.get_num_free_blocks(),
        pool.free_queue_ids(),
        pool.cached_items(),
        [pool.ref_cnt(i) for i in range(pool.num_gpu_blocks)],
        pool.num_cached_keys(),
        [pool.block_hash(i) for i in range(pool.num_gpu_blocks)],
    )


def test_cache_ids_on_a_cached_block_is_a_value_error():
    pool = BlockPool(16, True, 16, enable_kv_cache_events=True)
    hashes = kvblock.hash_blocks(list(range(64)), 16)
    ids = pool.allocate_ids(4)
    pool.cache_ids(ids, hashes, 0, 4)
    pool.take_events()
    before = _snapshot(pool)
    other = kvblock.hash_blocks(list(range(100, 164)), 16)
    with pytest.raises(ValueError, match=r"^block_ids: block \d+ already holds a key") as info:
        pool.cache_ids(ids, other, 0, 4)
    assert not isinstance(info.value, AssertionError)
    assert _snapshot(pool) == before and pool.take_events() == []
    pool.check_invariants()


@pytest.mark.parametrize("call", ["lookup_prefix", "lookup_ids", "cache_ids"])
def test_a_group_past_the_managers_groups_is_refused(call):
    m = KVCacheManager(16, 16)
    pool = m.block_pool
    hashes = kvblock.hash_blocks(list(range(64)), 16)
    ids = pool.allocate_ids(4)
    before = _snapshot(pool)
    args = {
        "lookup_prefix": lambda g: pool.lookup_prefix(hashes, group_id=g),
        "lookup_ids": lambda g: pool.lookup_ids(hashes, group_id=g),
        "cache_ids": lambda g: pool.cache_ids(ids, hashes, 0, 4, group_id=g),
    }[call]
    with pytest.raises(ValueError, match=r"^group_id: 1 is out of range: the pool's manager has 1 KV-cache group"):
        args(1)
    assert _snapshot(pool) == before
    args(0)  # group 0 is the manager's


def test_a_standalone_pool_takes_any_group_id():
    """A pool no manager uses knows no groups: each group id is a namespace of keys."""
    pool = BlockPool(16, True, 16)
    hashes = kvblock.hash_blocks(list(range(32)), 16)
    ids = pool.allocate_ids(2)
    pool.cache_ids(ids, hashes, 0, 2, group_id=5)
    assert pool.lookup_prefix(hashes, group_id=5).tolist() == ids.tolist()
    assert pool.lookup_prefix(hashes, group_id=0).tolist() == []


Y, Z = b"y" * 32, b"z" * 32


@pytest.mark.parametrize("form", ["list", "int32", "int64", "uint32"])
@pytest.mark.parametrize(
    "table, first, end, at",
    [("aa", 0, 2, (0, 1)), ("aba", 0, 3, (0, 2)), ("baba", 1, 4, (1, 3))],
    ids=["adjacent", "apart", "past-cached"],
)
def test_cache_ids_refuses_a_block_listed_twice(form, table, first, end, at):
    pool = BlockPool(10, True, 16, enable_kv_cache_events=True)
    a, b = (int(x) for x in pool.allocate_ids(2))
    ids = [{"a": a, "b": b}[c] for c in table]
    ids = ids if form == "list" else np.array(ids, dtype=form)
    hashes = [bytes([i + 1]) * 32 for i in range(len(table))]
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"^block_ids: block {a} is listed twice \(at {at[0]} and {at[1]}\)"):
        pool.cache_ids(ids, hashes, first, end)
    assert _snapshot(pool) == before and pool.take_events() == []
    pool.check_invariants()
    assert pool.lookup_prefix(hashes[first:end]).tolist() == []


def test_a_repeat_outside_the_cached_range_is_no_repeat():
    pool = BlockPool(10, True, 16, enable_kv_cache_events=True)
    a, b = (int(x) for x in pool.allocate_ids(2))
    pool.cache_ids([a], [Y], 0, 1)
    pool.cache_ids([a, b, a], [Y, Z, b"w" * 32], 1, 2)  # only b is cached
    assert pool.lookup_ids([Y, Z]).tolist() == [a, b]
    pool.check_invariants()


class _Req:
    """What ``cache_full_blocks`` reads of a request (the events read the rest as None)."""

    def __init__(self, hashes):
        self.block_hashes = hashes
        self.all_token_ids = list(range(16 * len(hashes)))
        self.mm_features = []
        self.request_id = "a"

    def __getattr__(self, name):
        return None


def test_own_cache_full_blocks_refuses_a_block_listed_twice():
    pool = BlockPool(10, True, 16, enable_kv_cache_events=True)
    blk, other = pool.get_new_blocks(2)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"^blocks: block {blk.block_id} is listed twice \(at 0 and 2\)"):
        pool.cache_full_blocks(_Req([Y, Z, b"w" * 32]), [blk, other, blk], 0, 3, 16, 0)
    assert _snapshot(pool) == before and pool.take_events() == []
    assert blk.block_hash is None
    pool.check_invariants()
    # a masked-out or null listing is no repeat
    pool.cache_full_blocks(_Req([Y, Z, b"w" * 32]), [blk, pool.null_block, blk], 0, 3, 16, 0, [True, True, False])
    assert blk.block_hash == make_block_hash_with_group_id(Y, 0)
    pool.check_invariants()


def test_vllm_pool_keeps_vllms_promotion_of_a_repeated_block():
    """vLLM 0.33's ``cache_full_blocks`` takes a block listed twice: the later listing promotes
    the key the earlier one gave (one ``BlockRemoved``, one ``BlockStored`` of both). kvblock's
    vLLM pool does the same, on the same events."""
    require_module("vllm")
    from vllm.v1.core.block_pool import BlockPool as VllmPool

    from kvblock.vllm.block_pool import BlockPool as KvPool

    seen = []
    for cls in (VllmPool, KvPool):
        pool = cls(10, True, 16, enable_kv_cache_events=True)
        blk = pool.get_new_blocks(1)[0]
        pool.cache_full_blocks(_Req([Y, Z]), [blk, blk], 0, 2, 16, 0)
        events = pool.take_events()
        seen.append((blk.block_hash, [(type(e).__name__, e.block_hashes) for e in events]))
    assert seen[0] == seen[1]
    assert [name for name, _ in seen[0][1]] == ["BlockRemoved", "BlockStored"]


def _cached_manager():
    m = KVCacheManager(num_blocks=20, block_size=16, max_model_len=512, enable_kv_cache_events=True)
    r = Request("a", list(range(1000, 1040)), block_hasher=m.request_block_hasher)
    b, n, _ = m.get_computed_blocks(r)
    m.allocate_slots(r, 40 - n, n, b)
    m.free(r)
    m.take_events()
    return m, r


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda p, src, key: p.move_block_hash_ids(src, 0), "dst"),
        (lambda p, src, key: p.move_block_hashes(p.blocks[src], p.null_block), "dst"),
    ],
    ids=["move_block_hash_ids", "move_block_hashes"],
)
def test_a_key_is_never_moved_onto_the_null_block(call, arg):
    m, r = _cached_manager()
    pool = m.block_pool
    ids = pool.lookup_prefix(r.block_hashes).tolist()
    assert ids and 0 not in ids
    key = make_block_hash_with_group_id(r.block_hashes[0], 0)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"^{arg}: block 0 is the null block, which cannot hold a cache key"):
        call(pool, ids[0], key)
    assert _snapshot(pool) == before and pool.take_events() == []
    pool.check_invariants()
    # the manager still hits the cached blocks, never block 0
    r2 = Request("b", list(range(1000, 1040)), block_hasher=m.request_block_hasher)
    blocks, n, _ = m.get_computed_blocks(r2)
    assert n == 32 and blocks.get_block_ids() == (ids,)


def test_the_raw_map_faces_key_the_null_block_as_vllm_s_map():
    """``cached_block_hash_to_block.insert`` and ``block.set_block_hash``, the raw faces vLLM's
    code and tests reach inside with, take the null block as vLLM's own pool does (its
    ``test_maybe_evict_cached_block`` keys every block by hand, block 0 included)."""
    require_module("vllm")
    import vllm.v1.core.block_pool as vbp

    from kvblock.vllm.block_pool import BlockPool as KvPool
    from kvblock.vllm.originals import original

    key = make_block_hash_with_group_id(Y, 0)
    found = []
    for cls in (original(vbp, "BlockPool"), KvPool):
        pool = cls(10, True, 16)
        pool.null_block.set_block_hash(key)
        pool.cached_block_hash_to_block.insert(key, pool.null_block)
        found.append(pool.cached_block_hash_to_block.get_one_block(key).block_id)
    assert found == [0, 0]


@pytest.mark.parametrize(
    "value, exc, message",
    [
        ([-1], ValueError, r"kv_cache_group_ids\[0\]: -1 is out of range \(must be in \[0, 2\*\*32\)\)"),
        ([0, 2**32], ValueError, r"kv_cache_group_ids\[1\]: 4294967296 is out of range"),
        ([True], TypeError, r"kv_cache_group_ids\[0\]: expected int, got bool"),
        ([0.0], TypeError, r"kv_cache_group_ids\[0\]: expected int, got float"),
        ("ab", TypeError, r"kv_cache_group_ids: expected a sequence of ints, got str"),
        (3, TypeError, r"kv_cache_group_ids: expected a sequence of ints, got int"),
    ],
    ids=["negative", "too-big", "bool", "float", "str", "int"],
)
def test_group_id_lists_name_the_item(value, exc, message):
    pool = BlockPool(10, True, 16)
    a = int(pool.allocate_ids(1)[0])
    pool.cache_ids([a], [Y], 0, 1)
    before = _snapshot(pool)
    with pytest.raises(exc, match="^" + message):
        pool.get_cached_block_ids(Y, value)
    if not isinstance(value, (str, int)):
        with pytest.raises(exc, match="^" + message):
            pool.get_cached_block(Y, value)
    assert _snapshot(pool) == before
    assert pool.get_cached_block_ids(Y, [0, np.int64(0)]) == [a, a]


def test_skip_zeroing_group_ids_names_the_item():
    m = KVCacheManager(num_blocks=20, block_size=16, max_model_len=512)
    r = Request("a", list(range(40)), block_hasher=m.request_block_hasher)
    free = m.block_pool.get_num_free_blocks()
    for bad, exc, msg in [([-1], ValueError, r"skip_zeroing_group_ids\[0\]: -1 is out of range"),
                          ([True], TypeError, r"skip_zeroing_group_ids\[0\]: expected int, got bool"),
                          (5, TypeError, r"skip_zeroing_group_ids: expected a sequence of ints")]:
        with pytest.raises(exc, match="^" + msg):
            m.allocate_slots(r, 40, skip_zeroing_group_ids=bad)
        assert m.block_pool.get_num_free_blocks() == free and m.get_block_ids("a") == ([],)
    m.block_pool.check_invariants()
    assert m.allocate_slots(r, 40, skip_zeroing_group_ids=[0]) is not None


@pytest.mark.parametrize(
    "value, exc, message",
    [(-1, ValueError, r"group_id: -1 is out of range \(must be in \[0, 2\*\*32\)\)"),
     (2**32, ValueError, r"group_id: 4294967296 is out of range"),
     (True, TypeError, "group_id: expected int, got bool"),
     (1.0, TypeError, "group_id: expected int, got float")],
)
def test_make_block_hash_with_group_id_names_group_id(value, exc, message):
    with pytest.raises(exc, match="^" + message):
        make_block_hash_with_group_id(b"x", value)
    assert make_block_hash_with_group_id(b"x", np.int32(3)) == b"x\x00\x00\x00\x03"


@pytest.mark.parametrize("block_size", [0, -16])
def test_cache_ids_block_size_must_be_positive(block_size):
    pool = BlockPool(10, True, 16, enable_kv_cache_events=True)
    a = int(pool.allocate_ids(1)[0])
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"^block_size: must be > 0, got {block_size}\b"):
        pool.cache_ids([a], [Y], 0, 1, block_size=block_size)
    assert _snapshot(pool) == before and pool.take_events() == []


@pytest.mark.parametrize("retention", [False, True], ids=["retention-off", "retention-on"])
@pytest.mark.parametrize("now", [float("nan"), float("inf"), float("-inf")], ids=repr)
def test_set_time_refuses_a_time_that_is_not_finite(retention, now):
    pool = BlockPool(10, True, 16)
    if retention:
        pool.enable_retention()
        pool.set_time(100.0)
    ids = [int(x) for x in pool.allocate_ids(3)]
    pool.assign_retention_ids(ids, [90, 10, 50], 5.0)
    pool.cache_ids(ids, [Y, Z, b"w" * 32], 0, 3)
    pool.free_ids(ids)
    before = (_snapshot(pool), [pool._retention_of(i) for i in range(10)])
    with pytest.raises(ValueError, match=r"^now_s: (NaN|inf|-inf) is not a finite time$"):
        pool.set_time(now)
    assert (_snapshot(pool), [pool._retention_of(i) for i in range(10)]) == before
    pool.check_invariants()
    pool.set_time(200.0)  # the clock still works


@pytest.mark.parametrize("call", ["block_generation", "_retention_of"])
def test_block_id_readers_name_block_id(call):
    pool = BlockPool(10, True, 16)
    with pytest.raises(ValueError, match=r"^block_id: -1 is out of range"):
        getattr(pool, call)(-1)
    with pytest.raises(TypeError, match=r"^block_id: expected int, got bool"):
        getattr(pool, call)(True)
