"""Hit rate against cache capacity: ideal replays of one or more traces at several capacities
(the data of the Mooncake paper's Figure 9, with vLLM's exact prefix-caching rules).

Every point is an ``ideal`` replay (requests finish instantly, so only the cache matters).
Requests that need more blocks than a capacity holds are unservable there and count as
misses: ``hit_rate = hits / prompt_tokens`` over *all* requests, so misses can be compared
across capacities. ``token_hit_rate`` is vLLM's ``hits / queries`` over served requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .config import SimConfig
from .errors import ReplayError
from .memory import parse_capacities
from .simulator import Replayer
from .trace import Trace

__all__ = ["SweepPoint", "SweepSeries", "parse_capacities", "sweep"]


@dataclass(frozen=True)
class SweepPoint:
    """One capacity of one trace.

    Attributes:
        capacity: the requested ``num_blocks`` (None: unlimited); num_blocks: the resolved one.
        prompt_tokens: prompt tokens of all requests; queries, hits: vLLM's counters over the
            served requests; unservable, unservable_tokens: requests too large for the cache.
        evictions: cached blocks evicted.
    """

    capacity: int | None
    num_blocks: int
    prompt_tokens: int
    queries: int
    hits: int
    unservable: int
    unservable_tokens: int
    evictions: int

    @property
    def misses(self) -> int:
        """Prompt tokens not served from the cache (unservable requests count in full)."""
        return self.prompt_tokens - self.hits

    @property
    def hit_rate(self) -> float:
        """``hits / prompt_tokens`` (unservable requests count as misses)."""
        return self.hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def token_hit_rate(self) -> float:
        """vLLM's ``hits / queries`` over the served requests."""
        return self.hits / self.queries if self.queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity, "num_blocks": self.num_blocks,
            "prompt_tokens": self.prompt_tokens, "queries": self.queries, "hits": self.hits,
            "misses": self.misses, "hit_rate": self.hit_rate, "token_hit_rate": self.token_hit_rate,
            "unservable": self.unservable, "unservable_tokens": self.unservable_tokens,
            "evictions": self.evictions,
        }


@dataclass
class SweepSeries:
    """The points of one trace, in capacity order."""

    name: str
    source: str
    block_size: int
    points: list[SweepPoint] = field(default_factory=list)
    #: The eviction policy of the series (``"lru"``, ``"optimal"``, ``"fifo"``, ``"priority"``...).
    policy: str = "lru"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable ``dict``: ``name``, ``policy``, ``source``, ``block_size`` and the
        ``points`` (:meth:`SweepPoint.to_dict`, in capacity order)."""
        return {"name": self.name, "policy": self.policy, "source": self.source, "block_size": self.block_size,
                "points": [p.to_dict() for p in self.points]}


def sweep(
    traces: Sequence[Trace],
    capacities: Sequence[int | None],
    *,
    block_size: int = 16,
    hash_algo: str = "sha256",
    impl: str = "kvblock",
    progress: Callable[[int], None] | None = None,
    retention: str = "lru",
    pin_tokens: int | None = None,
    ttl_s: float = 300.0,
) -> list[SweepSeries]:
    """Ideal replays of every trace at every capacity.

    ``retention``, ``pin_tokens``, ``ttl_s``: the eviction policy
    (:mod:`kvblock.replay.retention`); a series of another policy than ``lru`` is named
    ``"<trace> (<policy>)"``.

    Each trace's block hashes are computed once and reused across its capacities.

    Args:
        progress: called with the number of requests replayed so far, over all runs.

    Raises:
        ReplayError: invalid settings or capacities below 2 blocks.
    """
    for c in capacities:
        if c is not None and c < 2:
            raise ReplayError(f"capacity {c} is too small: at least 2 blocks (block 0 is vLLM's null block)")
    replayer = Replayer(impl, block_size, hash_algo)
    out: list[SweepSeries] = []
    base = 0
    for trace in traces:
        name = trace.name if retention == "lru" else f"{trace.name} ({retention})"
        series = SweepSeries(name, trace.source, block_size, policy=retention)
        for cap in capacities:
            cfg = SimConfig(num_blocks=cap, block_size=block_size, hash_algo=hash_algo, impl=impl, ideal=True,
                            retention=retention, pin_tokens=pin_tokens, ttl_s=ttl_s).validate()
            offset = base
            r = replayer.run(trace, cfg, None if progress is None else (lambda d, o=offset: progress(o + d)))
            base += len(trace.requests)
            unservable_ids = {u.request_id for u in r.unservable}
            series.points.append(SweepPoint(
                capacity=cap, num_blocks=r.usable_blocks + 1, prompt_tokens=r.prompt_tokens,
                queries=r.queries, hits=r.hits, unservable=len(r.unservable),
                unservable_tokens=sum(t.prompt_len for t in trace.requests if t.request_id in unservable_ids),
                evictions=r.evictions,
            ))
        out.append(series)
    return out

