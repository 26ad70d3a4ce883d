"""Prefix-cache statistics, shaped like vLLM 0.33.0's ``vllm.v1.metrics.stats.PrefixCacheStats``.

Both KV cache manager implementations (the Rust-backed one and the pure-Python reference)
accumulate into this class (spec §7). ``queries`` and ``hits`` count **tokens**, not blocks:
a request contributes its full ``num_tokens`` (including the last token, which is always
recomputed) to ``queries`` and its cache-hit length to ``hits``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last :meth:`KVCacheManager.make_prefix_cache_stats`.

    Attributes:
        reset: True if the prefix cache was reset (``reset_prefix_cache`` succeeded) while
            these stats were collected.
        requests: number of requests recorded that had never been preempted.
        queries: tokens looked up by those requests (their ``num_tokens``).
        hits: tokens of those requests found in the prefix cache.
        preempted_requests, preempted_queries, preempted_hits: the same counters for
            requests recorded after a preemption (``num_preemptions > 0``); vLLM keeps them
            apart so that a resumed request re-reading its own blocks does not inflate the
            hit rate (CASES.md C16).
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Record one lookup of ``num_tokens`` tokens of which ``num_hits`` hit the cache.

        Preempted requests update only the ``preempted_*`` counters; other requests update
        ``requests``, ``queries`` and ``hits`` (vLLM 0.33.0 ``PrefixCacheStats.record``).

        Raises:
            ValueError: a negative count, or more hits than tokens.
        """
        if num_tokens < 0 or num_hits < 0:
            raise ValueError(
                f"num_tokens and num_hits must be >= 0, got {num_tokens} and {num_hits}"
            )
        if num_hits > num_tokens:
            raise ValueError(f"num_hits ({num_hits}) exceeds num_tokens ({num_tokens})")
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` of the non-preempted requests (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0
