"""Capacity planning: the whole LRU hit-rate curve from one pass, and ``fifo`` / ``optimal``
(Belady) series beside it, all at vLLM's block granularity.

**What is modelled.** Exactly what ``kvblock sweep``'s ideal replays do with the real manager:
the trace in arrival order, each request alone in one vLLM pool of ``num_blocks`` blocks
(block 0 the null block): its prompt's block hashes looked up (longest cached prefix, never
the last token), the hit blocks taken out of the free queue, the missing blocks allocated
from the queue's head (evicting the least recently freed cached block), cached, and freed in
reverse order (its last block is evicted first). A request needing more blocks than the
pool's usable ones is unservable there and counts as a miss.

**One pass** (:meth:`kvblock._core.CapacityRequests.lru_curve`, Rust). The pool at every
capacity is a prefix of one stack of blocks sorted by vLLM's free-queue order (Mattson et
al.'s stack distances), up to one slot for the last request's partial block; the pass records
each looked-up block's stack distance, and hits at any capacity are a prefix sum. Two things
break the stack property, and the curve knows where (:meth:`LruCurve.exact_at`): capacities
that leave a request unservable (up to the largest request's blocks), and the rare capacity
ranges where a hash cached twice (vLLM caches the last block of a prompt that fills it
exactly again) would refresh a different copy in the pool than in the stack. Points requested
there are replayed (:meth:`~kvblock._core.CapacityRequests.simulate`), so every printed point
equals a replay; ``tests/test_capacity.py`` checks the curve against replays of the real
manager at many capacities.

**Block identity.** Token traces and built-in workloads are hashed with vLLM's block hash and
the digests interned. Hash-id traces (Mooncake) whose trace block is a multiple of the block
size skip the hashing: the blocks of trace id ``h`` after a prefix depend only on that prefix
and ``h``, so the trie of id prefixes gives the same equalities as the digests
(:func:`kvblock._core.capacity_trie_ids`; the tests compare both).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from .. import _core
from .errors import ReplayError
from .sweep import SweepPoint, SweepSeries
from .trace import Trace

__all__ = ["POLICIES", "CapacityCurve", "capacity_requests", "capacity_sweep", "warm_from"]

#: The policies a capacity sweep computes here (lru from the one-pass curve).
POLICIES = ("lru", "fifo", "optimal")


def warm_from(num_requests: int, warmup: float) -> int:
    """Index of the first measured request: the first ``floor(warmup * n)`` warm the cache.

    Raises:
        ReplayError: ``warmup`` outside [0, 1).
    """
    if not 0.0 <= warmup < 1.0:
        raise ReplayError(f"--warmup must be in [0, 1), got {warmup}")
    return int(warmup * num_requests)


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def capacity_requests(trace: Trace, block_size: int = 16, hash_algo: str = "sha256") -> _core.CapacityRequests:
    """The trace's requests with interned block ids, for the curve and the replays.

    Raises:
        ReplayError: an empty trace or a block size below 1.
    """
    if block_size < 1:
        raise ReplayError(f"--block-size must be >= 1, got {block_size}")
    reqs = trace.requests
    if not reqs:
        raise ReplayError(f"{trace.source}: no requests")
    lens = np.fromiter((r.prompt_len for r in reqs), dtype=np.int64, count=len(reqs))
    tbs = trace.trace_block_size
    if tbs and tbs % block_size == 0 and all(r.hash_ids is not None for r in reqs):
        ids = [r.hash_ids for r in reqs]
        id_offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in ids], out=id_offsets[1:])
        flat = np.concatenate(ids).astype(np.int64, copy=False) if ids else np.zeros(0, np.int64)
        # a record whose ids cover fewer tokens than its length: the prompt is what they cover
        return _core.CapacityRequests.from_trie_ids(flat, id_offsets, lens, tbs, block_size)
    from .backends import get_impl
    from .blockhash import RequestHasher

    hasher = RequestHasher(get_impl("kvblock"), block_size, hash_algo, tbs)
    hasher.start_run()
    intern: dict[bytes, int] = {}
    out: list[int] = []
    offsets_l = [0]
    for r in reqs:
        for d in hasher.prompt_hashes(r):
            out.append(intern.setdefault(d, len(intern)))
        offsets_l.append(len(out))
    return _core.CapacityRequests(block_size, lens, np.array(offsets_l, dtype=np.int64), np.array(out, dtype=np.uint32))


@dataclass
class CapacityCurve:
    """One trace's LRU curve and the points asked for.

    Attributes:
        name: the trace's name; block_size: tokens per block; prompt_tokens: of the measured
            requests; lru: the one-pass curve (:class:`kvblock._core.LruCurve`);
            max_blocks_needed: below this many blocks plus one some request is unservable, and
            the curve there is not a replay's; inexact: other ``[lo, hi)`` ranges of
            ``num_blocks`` where it is not.
    """

    name: str
    block_size: int
    prompt_tokens: int
    lru: _core.LruCurve = field(repr=False)
    max_blocks_needed: int
    inexact: list[tuple[int, int]]

    @cached_property
    def hits(self) -> np.ndarray:
        """Hit tokens at every ``num_blocks`` from 0 up (the last entry holds for all larger
        ones); made when first asked for (the plot), not by every sweep."""
        return self.lru.cumulative_hits()

    def hit_rate(self, num_blocks: int) -> float:
        """The one-pass hit rate at ``num_blocks``."""
        if not self.prompt_tokens:
            return 0.0
        i = min(num_blocks, len(self.hits) - 1)
        return float(self.hits[i]) / self.prompt_tokens if i >= 0 else 0.0


def _point(t: tuple[int, ...], capacity: int | None) -> SweepPoint:
    num_blocks, prompt_tokens, queries, hits, unservable, unservable_tokens, evictions = t
    return SweepPoint(capacity=capacity, num_blocks=num_blocks, prompt_tokens=prompt_tokens, queries=queries,
                      hits=hits, unservable=unservable, unservable_tokens=unservable_tokens, evictions=evictions)


def capacity_sweep(
    traces: Sequence[Trace],
    capacities: Sequence[int | None],
    policies: Sequence[str] = ("lru",),
    *,
    block_size: int = 16,
    hash_algo: str = "sha256",
    warmup: float = 0.0,
    threads: int | None = None,
) -> tuple[list[SweepSeries], list[CapacityCurve]]:
    """Every trace at every capacity (``num_blocks``; None: unlimited) for each policy.

    ``lru`` comes from the one-pass curve, replaying only the points the curve cannot give
    exactly; ``fifo`` and ``optimal`` are replayed per capacity (in parallel). A series of
    another policy than ``lru`` is named ``"<trace> (<policy>)"``.

    Returns:
        The series (one per trace and policy, policies outermost as ``sweep`` orders them) and
        each trace's LRU curve (for the plot).

    Raises:
        ReplayError: an unknown policy, a capacity below 2, ``warmup`` outside [0, 1).
    """
    for p in policies:
        if p not in POLICIES:
            raise ReplayError(f"unknown --retention {p!r} for a capacity curve; choose from {', '.join(POLICIES)}")
    for c in capacities:
        if c is not None and c < 2:
            raise ReplayError(f"capacity {c} is too small: at least 2 blocks (block 0 is vLLM's null block)")
    nthreads = threads or _threads()
    by_policy: dict[str, list[SweepSeries]] = {p: [] for p in policies}
    curves: list[CapacityCurve] = []
    for trace in traces:
        w = warm_from(len(trace.requests), warmup)
        reqs = capacity_requests(trace, block_size, hash_algo)
        unlimited = sum(-(-r.prompt_len // block_size) for r in trace.requests) + 1
        resolved = [unlimited if c is None else c for c in capacities]
        # Below the largest request's blocks the curve is not a replay's: those lru points are
        # replayed, and fifo / optimal everywhere, on worker threads while this one runs the
        # curve (all release the GIL; the curve's pass is sequential).
        early = sorted({n for n in resolved if n <= reqs.max_blocks_needed}) if "lru" in policies else []
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = {p: pool.submit(reqs.simulate, resolved, p, w, nthreads) for p in policies if p != "lru"}
            lru_early = pool.submit(reqs.simulate, early, "lru", w, nthreads) if early else None
            curve = reqs.lru_curve(w)
            done = {p: f.result() for p, f in pending.items()}
            replayed = dict(zip(early, lru_early.result())) if lru_early else {}
        curves.append(CapacityCurve(trace.name, block_size, int(curve.point(2)[1]), curve,
                                    int(curve.max_blocks_needed), [tuple(r) for r in curve.inexact_ranges()]))
        for p in policies:
            name = trace.name if p == "lru" else f"{trace.name} ({p})"
            series = SweepSeries(name, trace.source, block_size, policy=p)
            if p == "lru":
                todo = sorted({n for n in resolved if not curve.exact_at(n)} - replayed.keys())
                replayed.update(zip(todo, reqs.simulate(todo, "lru", w, nthreads)) if todo else ())
                for cap, n in zip(capacities, resolved):
                    t = replayed[n] if n in replayed else curve.point(n)
                    series.points.append(_point(t, cap))
            else:
                series.points += [_point(t, cap) for cap, t in zip(capacities, done[p])]
            by_policy[p].append(series)
    return [s for p in policies for s in by_policy[p]], curves
