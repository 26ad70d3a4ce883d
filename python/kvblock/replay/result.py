"""What a replay measures: :class:`ReplayResult` and its JSON form.

Counting rules (vLLM 0.33.0, spec §7): ``queries`` / ``hits`` are **tokens** of the
``PrefixCacheStats`` the manager records at each admission (a request's full ``num_tokens``
is queried, its prefix-hit length is hit; the last token is always recomputed).
Re-admissions after a preemption are counted apart (``preempted_*``), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ReplayResult", "Unservable"]

#: Points of the blocks-in-use series kept in the JSON output.
SERIES_POINTS = 240


@dataclass(frozen=True)
class Unservable:
    """A request the cache can never hold.

    Attributes:
        request_id: its id; line: its trace line (0 for generated requests).
        blocks_needed: blocks its longest sequence needs; reason: the explanation.
    """

    request_id: str
    line: int
    blocks_needed: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable ``dict``: ``request_id``, ``line``, ``blocks_needed``, ``reason``."""
        return {"request_id": self.request_id, "line": self.line, "blocks_needed": self.blocks_needed,
                "reason": self.reason}


@dataclass
class ReplayResult:
    """The outcome of one replay.

    Attributes:
        workload, source: the trace's name and path (or ``builtin:<name>``).
        impl: ``"kvblock"`` or ``"reference"``; mode: ``"ideal"`` or ``"scheduled"``.
        config: the settings used (num_blocks, block_size, hash_algo, ...).
        requests: requests in the workload; served: requests that finished.
        unservable: requests that need more blocks than the cache has (never admitted).
        prompt_tokens: prompt tokens of all requests (served or not).
        queries, hits, requests_recorded: vLLM's ``PrefixCacheStats`` (tokens) of first
            admissions; preempted_queries, preempted_hits, preempted_requests: of
            re-admissions after a preemption.
        blocks_queried, blocks_hit: full prompt blocks looked up / found at first admissions.
        evictions: cached blocks whose key was dropped to reuse the block.
        preemptions: requests freed and requeued because blocks ran out.
        steps: scheduler steps (ideal mode: one per served request).
        usable_blocks: ``num_blocks - 1`` (block 0 is the null block).
        usage: blocks in use after each step (int32 array).
        lookup_ns, admit_alloc_ns, step_alloc_ns, free_ns: time in ``get_computed_blocks``,
            admission ``allocate_slots``, running-request ``allocate_slots`` and ``free``.
        lookup_calls, admit_alloc_calls, step_alloc_calls, free_calls: their call counts.
        hash_ns, blocks_hashed, blocks_reused: time in the hash function, digests computed,
            digests taken from the per-hash-id memo.
        wall_s: wall time of the replay; sim_time_s: simulated time (scheduled mode).
        fingerprint: SHA-256 of the block ids returned (workload README §5.1), if asked.
        skipped_lines: trace lines skipped with ``--skip-bad-lines``.
    """

    workload: str
    source: str
    impl: str
    mode: str
    config: dict[str, Any]
    requests: int = 0
    served: int = 0
    unservable: list[Unservable] = field(default_factory=list)
    prompt_tokens: int = 0
    queries: int = 0
    hits: int = 0
    requests_recorded: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    preempted_requests: int = 0
    blocks_queried: int = 0
    blocks_hit: int = 0
    evictions: int = 0
    preemptions: int = 0
    steps: int = 0
    usable_blocks: int = 0
    usage: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    lookup_ns: int = 0
    admit_alloc_ns: int = 0
    step_alloc_ns: int = 0
    free_ns: int = 0
    lookup_calls: int = 0
    admit_alloc_calls: int = 0
    step_alloc_calls: int = 0
    free_calls: int = 0
    hash_ns: int = 0
    blocks_hashed: int = 0
    blocks_reused: int = 0
    wall_s: float = 0.0
    sim_time_s: float = 0.0
    fingerprint: str | None = None
    skipped_lines: int = 0

    # -- derived ------------------------------------------------------------------------------
    @property
    def token_hit_rate(self) -> float:
        """``hits / queries`` (vLLM's prefix cache hit rate; 0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def block_hit_rate(self) -> float:
        """``blocks_hit / blocks_queried`` (full prompt blocks; 0.0 when none)."""
        return self.blocks_hit / self.blocks_queried if self.blocks_queried else 0.0

    @property
    def manager_ns(self) -> int:
        """Time inside the manager's scheduler calls (ns)."""
        return self.lookup_ns + self.admit_alloc_ns + self.step_alloc_ns + self.free_ns

    @property
    def manager_us_per_step(self) -> float:
        """Manager time per scheduler step (µs)."""
        return self.manager_ns / 1e3 / self.steps if self.steps else 0.0

    @property
    def hash_ns_per_block(self) -> float:
        """Hash-function time per digest computed (ns)."""
        return self.hash_ns / self.blocks_hashed if self.blocks_hashed else 0.0

    @property
    def peak_blocks_in_use(self) -> int:
        """The most blocks in use at any step (``int``; 0 for an empty replay)."""
        return int(self.usage.max()) if self.usage.size else 0

    @property
    def mean_blocks_in_use(self) -> float:
        """Blocks in use averaged over the steps (``float``; 0.0 for an empty replay)."""
        return float(self.usage.mean()) if self.usage.size else 0.0

    def usage_series(self, points: int = SERIES_POINTS) -> list[list[int]]:
        """Blocks in use over time, at most ``points`` pairs ``[step, blocks]`` (the maximum
        of each bucket of consecutive steps)."""
        n = self.usage.size
        if n == 0:
            return []
        if n <= points:
            return [[i, int(v)] for i, v in enumerate(self.usage)]
        edges = np.linspace(0, n, points + 1).astype(np.int64)
        maxima = np.maximum.reduceat(self.usage, edges[:-1])
        return [[int(s), int(v)] for s, v in zip(edges[:-1], maxima)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (times in µs or ns as named). ``unservable`` is a count,
        as in the sweep's and the fleet's reports; ``unservable_requests`` lists them."""
        return {
            "workload": self.workload,
            "source": self.source,
            "impl": self.impl,
            "mode": self.mode,
            "config": dict(self.config),
            "requests": self.requests,
            "skipped_lines": self.skipped_lines,
            "served": self.served,
            "unservable": len(self.unservable),
            "unservable_requests": [u.to_dict() for u in self.unservable],
            "prompt_tokens": self.prompt_tokens,
            "prefix_cache": {
                "requests": self.requests_recorded,
                "queries": self.queries,
                "hits": self.hits,
                "token_hit_rate": self.token_hit_rate,
                "preempted_requests": self.preempted_requests,
                "preempted_queries": self.preempted_queries,
                "preempted_hits": self.preempted_hits,
            },
            "blocks_queried": self.blocks_queried,
            "blocks_hit": self.blocks_hit,
            "block_hit_rate": self.block_hit_rate,
            "evictions": self.evictions,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "usable_blocks": self.usable_blocks,
            "blocks_in_use": {
                "peak": self.peak_blocks_in_use,
                "mean": self.mean_blocks_in_use,
                "final": int(self.usage[-1]) if self.usage.size else 0,
                "series": self.usage_series(),
            },
            "manager": {
                "total_us": self.manager_ns / 1e3,
                "us_per_step": self.manager_us_per_step,
                "get_computed_blocks": {"calls": self.lookup_calls, "total_us": self.lookup_ns / 1e3},
                "allocate_slots_admission": {"calls": self.admit_alloc_calls, "total_us": self.admit_alloc_ns / 1e3},
                "allocate_slots_running": {"calls": self.step_alloc_calls, "total_us": self.step_alloc_ns / 1e3},
                "free": {"calls": self.free_calls, "total_us": self.free_ns / 1e3},
            },
            "hashing": {
                "total_us": self.hash_ns / 1e3,
                "blocks_hashed": self.blocks_hashed,
                "blocks_reused": self.blocks_reused,
                "ns_per_block": self.hash_ns_per_block,
            },
            "wall_s": self.wall_s,
            "sim_time_s": self.sim_time_s,
            "fingerprint": self.fingerprint,
        }
