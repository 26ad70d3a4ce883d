"""The one-pass capacity curve (kvblock.replay.capacity) against replays of the real manager.

What is proven: at every capacity asked, ``capacity_sweep``'s LRU point (the one-pass curve,
or a Rust replay where the curve says it is not exact) equals ``kvblock.replay.sweep``'s ideal
replay through ``KVCacheManager`` (hits, queries, unservable requests, evictions), on prefixes
of both Mooncake traces and on a built-in workload; and the raw curve equals the Rust replay
wherever ``exact_at`` holds. Bounded time: trace prefixes (``head``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvblock.replay import builtin_workload, load_trace
from kvblock.replay.capacity import capacity_requests, capacity_sweep
from kvblock.replay.errors import ReplayError
from kvblock.replay.sweep import sweep

from conftest import shared_path


def _trace(name: str, n: int):
    return load_trace(str(shared_path("traces", name)), limit=n)


CASES = [
    ("mooncake_fast25_conversation_trace.jsonl", 250, 16, [2, 50, 300, 700, 1500, 3000, 6000, 20000, None]),
    ("mooncake_fast25_synthetic_trace.jsonl", 250, 16, [40, 400, 1200, 2500, 5000, 12000, None]),
    ("mooncake_fast25_conversation_trace.jsonl", 250, 512, [2, 10, 30, 60, 100, 200, None]),
]


@pytest.mark.parametrize("name,n,b,caps", CASES)
def test_curve_equals_manager_replays(name: str, n: int, b: int, caps: list) -> None:
    trace = _trace(name, n)
    got, curves = capacity_sweep([trace], caps, ["lru"], block_size=b)
    want = sweep([trace], caps, block_size=b)
    assert [p.to_dict() for p in got[0].points] == [p.to_dict() for p in want[0].points]
    assert any(curves[0].max_blocks_needed < (c or 1 << 40) for c in caps)


def test_curve_equals_manager_replays_builtin() -> None:
    trace = builtin_workload("chat").head(120)
    caps = [2, 20, 64, 200, 800, 3000, None]
    got, _ = capacity_sweep([trace], caps, ["lru"], block_size=16)
    want = sweep([trace], caps, block_size=16)
    assert [p.to_dict() for p in got[0].points] == [p.to_dict() for p in want[0].points]


def test_curve_equals_rust_replays_where_exact() -> None:
    trace = _trace("mooncake_fast25_conversation_trace.jsonl", 1500)
    reqs = capacity_requests(trace, 16)
    for warm in (0, 750):
        curve = reqs.lru_curve(warm)
        caps = [int(c) for c in np.unique(np.geomspace(2, 400_000, 40).astype(np.int64))]
        sims = reqs.simulate(caps, "lru", warm, 2)
        exact = [(c, s) for c, s in zip(caps, sims) if curve.exact_at(c)]
        assert len(exact) > 10
        for c, s in exact:
            assert curve.point(c) == s, c


@pytest.mark.parametrize("name", ["mooncake_fast25_conversation_trace.jsonl", "mooncake_fast25_synthetic_trace.jsonl"])
def test_optimal_over_runs_equals_block_by_block(name: str) -> None:
    """The optimal replay over runs of blocks equals the block-by-block one, unservable
    capacities and warmup included."""
    reqs = capacity_requests(_trace(name, 1200), 16)
    caps = [2, 40, 300, 1000, 3000, 10000, 40000, 1 << 40]
    for warm in (0, 600):
        assert reqs.simulate(caps, "optimal", warm, 2) == reqs.simulate(caps, "optimal", warm, 1, by_block=True)


def test_trie_ids_equal_digest_ids() -> None:
    """Mooncake block identity from the trie of ids equals the one from vLLM's digests."""
    trace = _trace("mooncake_fast25_conversation_trace.jsonl", 200)
    fast = capacity_requests(trace, 16)
    for r in trace.requests:  # hide the ids: force hashing of the expanded tokens
        from kvblock.replay.expand import HashIdExpander

        r.prompt_tokens = HashIdExpander(512).prompt_tokens(r.hash_ids, r.prompt_len)
        r.hash_ids = None
    trace.trace_block_size = None
    slow = capacity_requests(trace, 16)
    caps = [2, 100, 1000, 5000, 20000, 1 << 40]
    for pol in ("lru", "fifo", "optimal"):
        assert fast.simulate(caps, pol, 0, 1) == slow.simulate(caps, pol, 0, 1)


def test_policies_order_and_warmup() -> None:
    trace = _trace("mooncake_fast25_conversation_trace.jsonl", 600)
    caps = [500, 3000, 12000, 50000, None]
    series, _ = capacity_sweep([trace], caps, ["lru", "fifo", "optimal"], warmup=0.5)
    lru, fifo, opt = series
    for a, f, o in zip(lru.points, fifo.points, opt.points):
        assert o.hits >= a.hits and o.hits >= f.hits
    assert lru.points[-1].hits == opt.points[-1].hits == fifo.points[-1].hits
    assert lru.points[-1].prompt_tokens == sum(r.prompt_len for r in trace.requests[300:])
    with pytest.raises(ReplayError, match="warmup"):
        capacity_sweep([trace], caps, ["lru"], warmup=1.0)
    with pytest.raises(ReplayError, match="retention"):
        capacity_sweep([trace], caps, ["mru"])
