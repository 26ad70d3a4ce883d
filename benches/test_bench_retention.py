"""Priority retention: eviction cost per block against plain LRU, one run.

Every round evicts 1024 cached blocks from a full pool (``allocate_ids``), caches them under
fresh keys, gives them priorities and frees them in a shuffled order (the steady state of a
busy prefix cache; shuffled so that plain LRU, too, evicts scattered block ids and the
comparison measures the queues, not memory locality).
Three pools per size: plain LRU (retention off: vLLM's queue), retention on with every block
at one level, and retention on with priorities spread over all 101 levels. Sizes 10^4, 10^5
and 10^6 blocks. The summary prints ns per block and the ratios to plain LRU (the target: at
most 1.2x, flat across levels and sizes).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvblock.block_pool import BlockPool

K = 1024
REPS = 8
ROUNDS = (20 + 2) * REPS
SIZES = [10_000, 100_000, 1_000_000]
MODES = ["lru", "1 level", "101 levels"]
_PER_BLOCK: dict[tuple[int, str], float] = {}


def _hash_lists(n_lists: int, tag: str) -> list[list[bytes]]:
    return [[hashlib.blake2b(f"{tag}/{j}/{i}".encode(), digest_size=32).digest() for i in range(K)]
            for j in range(n_lists)]


def _pool(num_blocks: int, mode: str, rng: np.random.Generator):
    pool = BlockPool(num_blocks, True, 16)
    if mode != "lru":
        pool.enable_retention()
    pool.set_time(0.0)
    usable = num_blocks - 1
    # a shuffled free queue, so that every pool evicts scattered block ids (memory locality
    # alike for all three)
    every = pool.allocate_ids(usable)
    pool.free_ids(every[rng.permutation(usable)])
    fill = usable // K
    lists = _hash_lists(fill + ROUNDS, f"{num_blocks}")  # every round caches keys never used before
    for j in range(fill):
        ids = pool.allocate_ids(K)
        pool.cache_ids(ids, lists[j], 0, K)
        pool.assign_retention_ids(ids, _prios(mode, rng))
        pool.free_ids(ids[rng.permutation(K)])
    return pool, lists[fill:]


def _prios(mode: str, rng: np.random.Generator) -> np.ndarray:
    if mode == "101 levels":
        return rng.integers(0, 101, K).astype(np.int64)
    return np.full(K, 35, dtype=np.int64)


@pytest.mark.parametrize("num_blocks", SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_evict_cache_free(record, report_line, num_blocks, mode):
    rng = np.random.default_rng(0)
    pool, lists = _pool(num_blocks, mode, rng)
    prios = [_prios(mode, rng) for _ in range(16)]
    perms = [rng.permutation(K) for _ in range(16)]
    state = {"r": 0}
    reps = REPS

    def run():
        for _ in range(reps):
            r = state["r"]
            state["r"] = r + 1
            ids = pool.allocate_ids(K)
            pool.cache_ids(ids, lists[r], 0, K)
            pool.assign_retention_ids(ids, prios[r % 16])
            pool.free_ids(ids[perms[r % 16]])

    group = f"evict+cache+free, {num_blocks:,} blocks (ns/block)"
    record(group, "kvblock" if mode == "lru" else f"kvblock {mode}", run, per=reps * K, rounds=20)
    pool.check_invariants()
    from conftest import _RESULTS

    _PER_BLOCK[(num_blocks, mode)] = _RESULTS[group]["kvblock" if mode == "lru" else f"kvblock {mode}"][0]
    if len(_PER_BLOCK) == len(SIZES) * len(MODES):
        report_line("retention: evict+cache+free per block (min), ratio to plain LRU at the same size")
        for n in SIZES:
            base = _PER_BLOCK[(n, "lru")]
            cells = "  ".join(f"{m}: {_PER_BLOCK[(n, m)] * 1e9:6.1f} ns ({_PER_BLOCK[(n, m)] / base:4.2f}x)" for m in MODES)
            report_line(f"  {n:>9,} blocks  {cells}")
