"""The pool's id API refuses bad input with kvblock's documented types, changing nothing
(new-user finding L10): ``cache_ids`` on a block that already holds a key is a ``ValueError``
(it was an ``AssertionError``), and on the pool of a manager a ``group_id`` past the manager's
KV-cache groups is a ``ValueError`` naming it (``lookup_prefix`` answered ``[]``)."""

from __future__ import annotations

import pytest

import kvblock
from kvblock import BlockPool, KVCacheManager


def _snapshot(pool: BlockPool) -> tuple:
    return (
        pool.get_num_free_blocks(),
        pool.free_queue_ids(),
        pool.cached_items(),
        [pool.ref_cnt(i) for i in range(pool.num_gpu_blocks)],
        pool.num_cached_keys(),
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
