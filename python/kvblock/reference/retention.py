"""Retention beyond LRU, the plain way (the reference for ``rust/src/pool/retention.rs`` and
``rust/src/manager/retention.rs``): priority levels as Python lists, decay buckets as a dict
of lists, pins as a dict. Same semantics as the Rust core, none of its data structures:

* priorities 0-100 (default 35); a free cached block waits at level ``1 + priority``, blocks
  without a hash at level 0 (head first, as vLLM prepends them); eviction pops the head of
  the lowest non-empty level;
* a priority with a duration decays to the default at the first clock reading in or after
  the bucket ``ceil((release time + duration) / granularity)``; decayed blocks join the
  default level's tail, bucket by bucket, each bucket in release order;
* the first request since a block was handed out sets its priority, later ones only raise
  it (equal priority: the later expiry);
* pins hold one reference per pinned block, named by the prefix's last full block hash,
  capped in distinct blocks, expiring earliest first.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

DEFAULT_PRIORITY = 35
MAX_PRIORITY = 100
NUM_LEVELS = MAX_PRIORITY + 2
NO_EXPIRY = None


class StaleHitError(ValueError):
    """Hit blocks were evicted and reused between ``get_computed_blocks`` and
    ``allocate_slots`` (the reference's twin of ``kvblock.StaleHitError``)."""


def check_priority(p: Any, arg: str) -> int:
    if isinstance(p, bool) or not isinstance(p, int):
        raise TypeError(f"{arg}: must be an int")
    if not 0 <= p <= MAX_PRIORITY:
        raise ValueError(f"{arg}: priority {p} is outside 0..={MAX_PRIORITY}")
    return p


def check_duration(d: Any, arg: str) -> float | None:
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, (int, float)):
        raise TypeError(f"{arg}: must be a number of seconds or None")
    d = float(d)
    if not (math.isfinite(d) and d >= 0):
        raise ValueError(f"{arg}: {d} s must be a finite number of seconds >= 0")
    return d


def request_retention(request: Any, num_prompt_tokens: int) -> tuple[list[tuple[int, int, int, float | None]], int | None] | None:
    """``(ranges, priority)`` of a request's ``retention`` / ``retention_priority``, checked
    against its prompt; None when it has neither."""
    ranges = getattr(request, "retention", None)
    prio = getattr(request, "retention_priority", None)
    if prio is not None:
        prio = check_priority(prio, "request.retention_priority")
    if ranges is None and prio is None:
        return None
    out: list[tuple[int, int, int, float | None]] = []
    if ranges is not None:
        if isinstance(ranges, (str, bytes)):
            raise TypeError("request.retention: expected a list of (start, end, priority, duration_s)")
        for i, item in enumerate(ranges):
            arg = f"request.retention[{i}]"
            t = list(item)
            if len(t) != 4:
                raise ValueError(f"{arg}: expected (start, end, priority, duration_s), got {len(t)} items")
            start, end = t[0], t[1]
            for name, v in (("start", start), ("end", end)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"{arg}.{name}: must be an int")
            if start < 0 or end < 0:
                raise ValueError(f"{arg}: token range [{start}, {end}) must not be negative")
            out.append((start, end, check_priority(t[2], f"{arg}.priority"), check_duration(t[3], f"{arg}.duration_s")))
    for i, (start, end, _, _) in enumerate(out):
        if start >= end or end > num_prompt_tokens:
            raise ValueError(
                f"request.retention: retention[{i}]: token range [{start}, {end}) must be non-empty and inside "
                f"the prompt's {num_prompt_tokens} tokens"
            )
    return out, prio


def block_priority(
    ret: tuple[list[tuple[int, int, int, float | None]], int | None], lo: int, hi: int
) -> tuple[int, float | None] | None:
    """The priority of the block covering tokens ``[lo, hi)``: the highest overlapping range
    (longest duration among equals, None being the longest), else the request's own."""
    ranges, prio = ret
    best: tuple[int, float | None] | None = None
    for start, end, p, d in ranges:
        if start < hi and lo < end:
            if best is None or p > best[0]:
                best = (p, d)
            elif p == best[0]:
                best = (p, None if best[1] is None or d is None else max(best[1], d))
    if best is None and prio is not None:
        best = (prio, None)
    return best


class LeveledFreeQueue:
    """The free queue as one Python list per level (head first). Blocks it holds have their
    ``prev_free_block`` / ``next_free_block`` set to a marker so the pool's linked checks see
    them as queued; order lives in the lists only."""

    def __init__(self, blocks: list[Any], marker: Any) -> None:
        self.levels: list[list[Any]] = [[] for _ in range(NUM_LEVELS)]
        self.level_of: dict[int, int] = {}
        self._marker = marker
        for b in blocks:
            self._link(b, 0)
            self.levels[0].append(b)

    @property
    def num_free_blocks(self) -> int:
        return len(self.level_of)

    def _link(self, b: Any, level: int) -> None:
        self.level_of[b.block_id] = level
        b.prev_free_block = b.next_free_block = self._marker

    def _unlink(self, b: Any) -> int:
        level = self.level_of.pop(b.block_id)
        self.levels[level].remove(b)
        b.prev_free_block = b.next_free_block = None
        return level

    def popleft(self) -> Any:
        for lst in self.levels:
            if lst:
                b = lst[0]
                self._unlink(b)
                return b
        raise ValueError("No free blocks available")

    def popleft_n(self, n: int) -> list[Any]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, b: Any) -> None:
        if b.block_id not in self.level_of:
            raise RuntimeError(f"remove() called on a block that is not in the free queue: {b}")
        self._unlink(b)

    def append_at(self, b: Any, level: int) -> None:
        self._link(b, level)
        self.levels[level].append(b)

    def append_n(self, blocks: Sequence[Any]) -> None:
        for b in blocks:
            self.append_at(b, 0)

    def prepend_n(self, blocks: Sequence[Any]) -> None:
        for b in blocks:
            self._link(b, 0)
        self.levels[0][0:0] = list(blocks)

    def get_all_free_blocks(self) -> list[Any]:
        return [b for lst in self.levels for b in lst]


class BlockRetention:
    """Per-block priorities, expiries (bucket numbers) and the decay buckets."""

    def __init__(self, default: int, granularity_s: float) -> None:
        check_priority(default, "default_priority")
        if not (math.isfinite(granularity_s) and granularity_s > 0):
            raise ValueError(f"decay_granularity_s: {granularity_s} must be a finite number > 0")
        self.default = default
        self.granularity_s = float(granularity_s)
        self.prio: dict[int, int] = {}
        self.expiry: dict[int, int] = {}
        self.buckets: dict[int, list[int]] = {}
        self.bucket_of: dict[int, int] = {}
        self.now_s = 0.0
        self.now_bucket = 0

    def expiry_bucket(self, duration_s: float | None) -> int | None:
        if duration_s is None:
            return None
        return max(0, math.ceil((self.now_s + duration_s) / self.granularity_s))

    def _unset(self, b: int) -> bool:
        e = self.expiry.get(b)
        return b not in self.prio or (e is not None and e <= self.now_bucket)

    def effective(self, b: int) -> int:
        return self.default if self._unset(b) else self.prio[b]

    def assign(self, b: int, p: int, duration_s: float | None) -> None:
        exp = self.expiry_bucket(duration_s)
        if self._unset(b) or p > self.prio[b]:
            self.prio[b] = p
            self._set_expiry(b, exp)
        elif p == self.prio[b] and self.expiry.get(b) is not None:
            self._set_expiry(b, None if exp is None else max(self.expiry[b], exp))

    def _set_expiry(self, b: int, e: int | None) -> None:
        if e is None:
            self.expiry.pop(b, None)
        else:
            self.expiry[b] = e

    def reset(self, b: int) -> None:
        self.unlink_bucket(b)
        self.prio.pop(b, None)
        self.expiry.pop(b, None)

    def release_level(self, b: int) -> int:
        p = self.effective(b)
        if self._unset(b):
            self.prio.pop(b, None)
            self.expiry.pop(b, None)
        elif p != self.default and b in self.expiry:
            k = self.expiry[b]
            self.buckets.setdefault(k, []).append(b)
            self.bucket_of[b] = k
        return 1 + p

    def unlink_bucket(self, b: int) -> None:
        k = self.bucket_of.pop(b, None)
        if k is not None:
            lst = self.buckets[k]
            lst.remove(b)
            if not lst:
                del self.buckets[k]

    def advance(self, now_s: float) -> list[int]:
        if not math.isfinite(now_s):
            raise ValueError(f"clock: {now_s} is not a finite time")
        self.now_s = now_s
        self.now_bucket = max(0, math.floor(now_s / self.granularity_s))
        out: list[int] = []
        for k in sorted(self.buckets):
            if k > self.now_bucket:
                break
            for b in self.buckets.pop(k):
                del self.bucket_of[b]
                self.prio.pop(b, None)
                self.expiry.pop(b, None)
                out.append(b)
        return out
