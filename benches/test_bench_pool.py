"""Block pool: kvblock's id API vs the reference's vLLM API, same operations, one run
(workload README §6.2 shapes). Time per block."""

from __future__ import annotations

import hashlib
import time

import pytest

from kvblock.block_pool import BlockPool
from kvblock.reference.block_pool import BlockPool as RefBlockPool
from kvblock.request import Request

NUM_BLOCKS = 100_000


class _Req:
    """What cache_full_blocks reads from a request when events are off."""

    def __init__(self, hashes):
        self.block_hashes = hashes


def _hashes(tag: str, n: int = 256) -> list[bytes]:
    return [hashlib.sha256(f"1234567/{tag}/{i}".encode()).digest() for i in range(n)]


@pytest.mark.parametrize("n", [1, 16, 128, 1024])
def test_alloc_free_kvblock(record, n):
    pool = BlockPool(NUM_BLOCKS, True, 16)
    reps = max(1, 4096 // n)
    if n == 1:
        def run():
            for _ in range(reps):
                pool.free_id(pool.allocate_id())
    else:
        def run():
            for _ in range(reps):
                pool.free_ids(pool.allocate_ids(n), reverse=True)
    record(f"allocate+free n={n} (ns/block)", "kvblock", run, per=reps * n)


@pytest.mark.parametrize("n", [1, 16, 128, 1024])
def test_alloc_free_reference(record, n):
    pool = RefBlockPool(NUM_BLOCKS, True, 16)
    reps = max(1, 4096 // n)

    def run():
        for _ in range(reps):
            pool.free_blocks(reversed(pool.get_new_blocks(n)))
    record(f"allocate+free n={n} (ns/block)", "reference", run, per=reps * n, rounds=10)


def test_alloc_free_n1_array_kvblock(record):
    """allocate_ids(1) / free_ids(array): the array form at n = 1, for comparison."""
    pool = BlockPool(NUM_BLOCKS, True, 16)

    def run():
        for _ in range(4096):
            pool.free_ids(pool.allocate_ids(1))
    record("allocate_ids(1)+free_ids, array form (ns/block)", "kvblock", run, per=4096)


def test_cache_kvblock(record):
    pool = BlockPool(NUM_BLOCKS, True, 16)
    hashes = _hashes("hit")
    ids = pool.allocate_ids(256)

    def cache():
        pool.evict_ids(ids)
        pool.cache_ids(ids, hashes, 0, 256)
    record("evict + cache_full_blocks, 256-block chain (ns/block)", "kvblock", cache, per=256)


def test_cache_reference(record):
    pool = RefBlockPool(NUM_BLOCKS, True, 16)
    hashes = _hashes("hit")
    req = _Req(hashes)
    blocks = pool.get_new_blocks(256)
    ids = [b.block_id for b in blocks]

    def cache():
        pool.evict_blocks(ids)
        pool.cache_full_blocks(req, blocks, 0, 256, 16, 0)
    record("evict + cache_full_blocks, 256-block chain (ns/block)", "reference", cache, per=256, rounds=20)


def test_lookup_hit_kvblock(record):
    pool = BlockPool(NUM_BLOCKS, True, 16)
    hashes = _hashes("hit")
    pool.cache_ids(pool.allocate_ids(256), hashes, 0, 256)
    assert len(pool.lookup_prefix(hashes)) == 256
    record("lookup, hit (ns/block)", "kvblock", lambda: pool.lookup_prefix(hashes), per=256)


def test_lookup_hit_reference(record):
    pool = RefBlockPool(NUM_BLOCKS, True, 16)
    hashes = _hashes("hit")
    pool.cache_full_blocks(_Req(hashes), pool.get_new_blocks(256), 0, 256, 16, 0)
    record("lookup, hit (ns/block)", "reference", lambda: [pool.get_cached_block(h, [0]) for h in hashes], per=256, rounds=20)


def test_lookup_miss_kvblock(record):
    pool = BlockPool(NUM_BLOCKS, True, 16)
    misses = _hashes("miss")
    assert (pool.lookup_ids(misses) == -1).all()
    record("lookup, miss (ns/block)", "kvblock", lambda: pool.lookup_ids(misses), per=256)


def test_lookup_miss_reference(record):
    pool = RefBlockPool(NUM_BLOCKS, True, 16)
    misses = _hashes("miss")
    record("lookup, miss (ns/block)", "reference", lambda: [pool.get_cached_block(h, [0]) for h in misses], per=256, rounds=20)


def test_build_1m_kvblock(record):
    record("build a 10^6-block pool (ns/block)", "kvblock", lambda: BlockPool(1_000_000, True, 16), per=1_000_000, rounds=5)


def test_build_1m_reference(record):
    record("build a 10^6-block pool (ns/block)", "reference", lambda: RefBlockPool(1_000_000, True, 16), per=1_000_000, rounds=2)


@pytest.mark.parametrize("num_blocks", [10_000, 100_000, 1_000_000])
def test_flat_cost_kvblock(record, num_blocks):
    """Per-block cost of allocate+cache+free cycles does not grow with the pool size."""
    pool = BlockPool(num_blocks, True, 16)
    hashes = _hashes(f"flat{num_blocks}", 128)

    def run():
        for _ in range(8):
            ids = pool.allocate_ids(128)
            pool.cache_ids(ids, hashes, 0, 128)
            pool.free_ids(ids, reverse=True)
    record(f"alloc+cache+free cycle, pool of {num_blocks} (ns/block)", "kvblock", run, per=8 * 128)


def test_bytes_per_block():
    """Pool metadata per block (arena + free-queue links; the hash map excluded): <= 32 bytes."""
    assert BlockPool.bytes_per_block() <= 32
    print(f"\nbytes per block of pool metadata: {BlockPool.bytes_per_block()}")


# Keys that are not uniform digests: 16,384 hashes written as big-endian integers share their
# first 24 bytes (the id API takes any 16- or 32-byte hash). The map must not degrade.
_INT_KEYS = [i.to_bytes(32, "big") for i in range(16384)]


def test_cache_int_keys_kvblock(record):
    pool = BlockPool(len(_INT_KEYS) + 1, True, 16)
    ids = pool.allocate_ids(len(_INT_KEYS))

    def cache():
        pool.evict_ids(ids)
        pool.cache_ids(ids, _INT_KEYS, 0, len(_INT_KEYS))
    record("evict + cache 16384 big-endian integer keys (ns/block)", "kvblock", cache, per=len(_INT_KEYS), rounds=20)


def test_cache_int_keys_reference(record):
    pool = RefBlockPool(len(_INT_KEYS) + 1, True, 16)
    blocks = pool.get_new_blocks(len(_INT_KEYS))
    ids = [b.block_id for b in blocks]
    req = _Req(_INT_KEYS)

    def cache():
        pool.evict_blocks(ids)
        pool.cache_full_blocks(req, blocks, 0, len(_INT_KEYS), 16, 0)
    record("evict + cache 16384 big-endian integer keys (ns/block)", "reference", cache, per=len(_INT_KEYS), rounds=5)
