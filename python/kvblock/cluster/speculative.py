""":class:`SpeculativeIndex`: an exact prefix index plus speculative entries with a TTL.

When a router sends a request to an engine, that engine will soon hold the request's prefix
blocks, but the index learns so only when the engine's ``BlockStored`` arrives (after the
prefill, a step or more later). A burst of requests sharing a new prefix arrives in that gap:
an exact index sees no holder, and the router spreads the burst, computing the prefix on
every engine. A speculative entry records "engine ``e`` is about to hold blocks ``j..k`` of
this chain" at routing time; the next request of the burst sees it and follows.

Exactness is kept by keeping the two apart:

* :meth:`SpeculativeIndex.match` is the wrapped index's answer, untouched: what the engines'
  events say they hold (under-reports possible, over-reports never);
* :meth:`SpeculativeIndex.match_both` also gives the speculative answer (confirmed blocks
  then speculative ones along the chain), which the router may use to *score* but never
  reports as cached (``Decision.cached_blocks`` stays the exact count);
* an entry lives until the engine's own events decide it: a ``BlockStored`` of its hash
  **confirms** it (the exact index now holds it), a ``BlockRemoved`` or ``AllBlocksCleared``
  of the engine or the engine's clear (a restart, a lost batch) **drops** it, and an entry
  neither confirmed nor dropped within ``ttl_ms`` **expires** (the request went elsewhere,
  was preempted, or the prediction was wrong). Counters of each are kept
  (:class:`SpeculationStats`).

The wrapper is an event sink (``apply`` / ``clear_instance`` / ``add_instance``), so it sits
between the subscriber (or fleet transport) and the index; everything else is forwarded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from .index import event_ints

__all__ = ["SpeculationStats", "SpeculativeIndex"]

_ROOT = -1  # the parent of a chain's first block


@dataclass
class SpeculationStats:
    """Counters of speculative entries (blocks): ``added`` at routing, then each ends
    ``confirmed`` (stored by the engine in time), ``dropped`` (removed or cleared by the
    engine first), ``expired`` (TTL passed) or is still ``live``; ``refused`` were not added
    (``max_entries`` reached)."""

    added: int = 0
    confirmed: int = 0
    dropped: int = 0
    expired: int = 0
    refused: int = 0
    live: int = 0

    def to_dict(self) -> dict[str, int]:
        """The counters as a JSON-serialisable ``dict[str, int]``."""
        return asdict(self)


class SpeculativeIndex:
    """An index (``PrefixIndex``, ``DictIndex``, ``RedisPrefixIndex``) with speculative
    entries (see the module docstring).

    Args:
        index: the exact index wrapped.
        ttl_ms: lifetime of a speculative entry not yet confirmed (milliseconds, > 0).
        clock_ms: ``() -> float``, the time in milliseconds (a simulated clock in replays).
        max_entries: most live speculative entries (blocks); more are refused and counted.

    Raises:
        ValueError: ``ttl_ms <= 0`` or ``max_entries < 1``.
    """

    #: :class:`~kvblock.cluster.Router` scores with :meth:`match_both` and calls
    #: :meth:`speculate` after each decision.
    speculative = True

    def __init__(self, index: Any, ttl_ms: float, clock_ms: Callable[[], float], *,
                 max_entries: int = 1 << 20) -> None:
        if not ttl_ms > 0:
            raise ValueError(f"ttl_ms must be > 0, got {ttl_ms}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.index = index
        self.ttl_ms = float(ttl_ms)
        self.clock_ms = clock_ms
        self.max_entries = max_entries
        self.stats = SpeculationStats()
        # instance -> block event int -> (parent event int or _ROOT, expiry ms)
        self._spec: dict[str, dict[int, tuple[int, float]]] = {}
        self._next_sweep = 0.0
        ops = getattr(getattr(index, "mirror", index), "wire_ops", None)
        if ops is None:  # an index that does not decode batches itself (DictIndex)
            from .index import PrefixIndex

            ops = PrefixIndex(getattr(index, "block_size", None)).wire_ops
        self._ops: Callable[[bytes], Any] = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)

    @property
    def wants_instances(self) -> bool:
        """Whether the wrapped index wants the instance list passed to its lookups (as the
        Redis index does).
        """
        return bool(getattr(self.index, "wants_instances", False))

    # -- events (the engines' word decides every entry) ---------------------------------------
    def apply(self, instance: str, payload: bytes, now_ms: int = 0) -> Any:
        """Apply a batch to the index, then confirm or drop the instance's entries it
        names. ValueError for a malformed payload (nothing changes)."""
        ops = self._ops(payload) if instance in self._spec else ()
        st = self.index.apply(instance, payload, now_ms)
        entries = self._spec.get(instance)
        if entries:
            for op, _medium, data in ops:
                if op == "C":
                    self._drop_all(instance)
                    entries = self._spec.get(instance)
                    if not entries:
                        break
                    continue
                step = 12 if op == "S" else 8
                for p in range(0, len(data), step):
                    h = int.from_bytes(data[p:p + 8], "big")
                    if entries.pop(h, None) is not None:
                        self.stats.live -= 1
                        if op == "S":
                            self.stats.confirmed += 1
                        else:
                            self.stats.dropped += 1
        return st

    def clear_instance(self, instance: str) -> int:
        """Drop the instance's speculative entries and clear it in the index; returns the pairs
        the index removed (``KeyError`` for an unknown instance, as the index raises).
        """
        self._drop_all(instance)
        return int(self.index.clear_instance(instance))

    def remove_instance(self, instance: str) -> int:
        """Drop the instance's speculative entries and remove it from the index; returns the
        pairs the index removed (``KeyError`` for an unknown instance).
        """
        self._drop_all(instance)
        return int(self.index.remove_instance(instance))

    def add_instance(self, instance: str) -> Any:
        """Register ``instance`` in the wrapped index (its answer is returned)."""
        return self.index.add_instance(instance)

    def _drop_all(self, instance: str) -> None:
        entries = self._spec.pop(instance, None)
        if entries:
            self.stats.dropped += len(entries)
            self.stats.live -= len(entries)

    # -- speculation ----------------------------------------------------------------------------
    def speculate(self, instance: str, block_hashes: Sequence[Any], start: int = 0) -> int:
        """Record that ``instance`` will hold blocks ``start ..`` of the chain
        ``block_hashes`` (``start``: the blocks it already holds, from :meth:`match`).
        Returns the entries added (an entry already there gets a fresh TTL, not counted).

        Raises:
            ValueError / TypeError: malformed block hashes."""
        ints = event_ints(block_hashes).tolist()
        if start >= len(ints):
            return 0
        expiry = self.clock_ms() + self.ttl_ms
        entries = self._spec.setdefault(instance, {})
        added = 0
        for j in range(max(start, 0), len(ints)):
            h = ints[j]
            if h not in entries:
                if self.stats.live >= self.max_entries:
                    self.stats.refused += len(ints) - j
                    break
                added += 1
                self.stats.live += 1
            entries[h] = (ints[j - 1] if j else _ROOT, expiry)
        self.stats.added += added
        return added

    def match(self, block_hashes: Any, medium: str | None = None, **kw: Any) -> dict[str, int]:
        """The wrapped index's exact answer (speculative entries never count here)."""
        return dict(self.index.match(block_hashes, medium, **kw))

    def match_both(self, block_hashes: Any, medium: str | None = None,
                   **kw: Any) -> tuple[dict[str, int], dict[str, int]]:
        """``(exact, speculative)``: the exact answer, and per instance the chain's prefix
        held or speculated (exact blocks, then live speculative entries under the right
        parent). Speculative entries count on any ``medium``."""
        exact = self.match(block_hashes, medium, **kw)
        now = self.clock_ms()
        if now >= self._next_sweep:
            self.expire(now)
        if not self._spec:
            return exact, dict(exact)
        ints = event_ints(block_hashes).tolist()
        spec = dict(exact)
        for inst, entries in self._spec.items():
            k = exact.get(inst, 0)
            while k < len(ints):
                e = entries.get(ints[k])
                if e is None or e[1] <= now or e[0] != (ints[k - 1] if k else _ROOT):
                    break
                k += 1
            if k:
                spec[inst] = k
        return exact, spec

    def expire(self, now_ms: float | None = None) -> int:
        """Drop entries past their TTL; returns how many."""
        now = self.clock_ms() if now_ms is None else now_ms
        n = 0
        for inst in list(self._spec):
            entries = self._spec[inst]
            dead = [h for h, (_, exp) in entries.items() if exp <= now]
            for h in dead:
                del entries[h]
            n += len(dead)
            if not entries:
                del self._spec[inst]
        self.stats.expired += n
        self.stats.live -= n
        self._next_sweep = now + self.ttl_ms / 4
        return n

    def speculative_blocks(self, instance: str) -> int:
        """Live speculative entries of ``instance``."""
        return len(self._spec.get(instance, ()))
