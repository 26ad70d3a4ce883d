"""vLLM's KV-cache residency metrics (``--kv-cache-metrics``, ``KVCacheMetricsCollector``) on
kvblock's Rust pool.

vLLM's block pool calls its collector's hooks block by block: ``on_block_allocated`` for every
block ``get_new_blocks`` hands out (sampled with probability ``sample_rate``: a fresh
``BlockMetricsState`` with its birth time), ``on_block_accessed`` for every block ``touch``
takes (a sampled block's last access and its bounded history of 4 accesses),
``on_block_evicted`` wherever ``_maybe_evict_cached_block`` runs (every block ``get_new_blocks``
hands out with caching on, ``evict_blocks``, Mamba's dropped checkpoints): a sampled block's
state is dropped and a ``KVCacheEvictionEvent`` (lifetime, idle time, reuse gaps, in seconds)
recorded. ``reset_prefix_cache`` calls ``reset()``. The scheduler reads the collector once per
stats interval: ``drain_events()``, whose events go into ``SchedulerStats`` for the Prometheus
histograms (``vllm:kv_block_lifetime_seconds``, ``..._idle_before_evict_seconds``,
``..._reuse_gap_seconds``).

kvblock keeps that state in its Rust pool (``rust/src/pool/residency.rs``), fed by the pool's
own transitions: no Python call per block. The user's collector object stays the one the
scheduler reads: :func:`bind` turns it into a :class:`KVCacheMetricsCollector` (this module's
subclass of vLLM's; same object, ``__class__`` swapped) whose ``block_metrics`` is a live view
of the Rust state, whose ``_eviction_events`` list receives the Rust events as vLLM's own
``KVCacheEvictionEvent`` objects when it is read, and whose ``sample_rate`` reaches the pool
when set. vLLM's own ``drain_events()`` and ``reset()`` then run unchanged.

Where it differs (docs/vllm.md, "Residency metrics"):

* Sampling draws from a Rust generator (SplitMix64) seeded from Python's ``random`` when the
  collector is bound, not from ``random.random()`` per block: the same distribution (a block
  is sampled iff a uniform draw in [0, 1) is below ``sample_rate``; every block at 1.0), a
  different sequence, and Python's ``random`` state is not advanced per block.
* The clock (``CLOCK_MONOTONIC``, that of ``time.monotonic_ns``) is read once per pool call,
  not once per block: blocks handed out or touched by one call share a timestamp.
"""

from __future__ import annotations

import random
import weakref
from collections import deque
from collections.abc import Iterator, MutableMapping
from numbers import Real
from typing import Any

from vllm.v1.core.kv_cache_metrics import BlockMetricsState
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector as VllmKVCacheMetricsCollector
from vllm.v1.metrics.stats import KVCacheEvictionEvent

__all__ = ["KVCacheMetricsCollector", "bind", "unsupported_reason"]

#: The collector methods whose semantics kvblock's pool implements; a subclass overriding one of
#: them runs Python per block, so it stays on vLLM's manager.
HOOKS = ("should_sample_block", "on_block_allocated", "on_block_accessed", "on_block_evicted", "reset", "drain_events")
#: The attributes the face turns into views.
_VIEWED = ("block_metrics", "_eviction_events", "sample_rate")


def _pool_of(collector: Any) -> Any:
    ref = collector.__dict__.get("_kvblock_pool")
    return None if ref is None else ref()


def unsupported_reason(collector: Any, num_blocks: int | None = None) -> str | None:
    """Why kvblock's pool cannot record for ``collector`` (vLLM's manager then does), or None.

    kvblock records for vLLM's ``KVCacheMetricsCollector`` and for subclasses that override
    none of its hooks (:data:`HOOKS`), with a real-number ``sample_rate``; one collector feeds
    one kvblock pool at a time (vLLM would share its ``block_metrics`` dict between pools);
    with ``num_blocks`` (the pool's size), states already in its ``block_metrics`` must name
    blocks of such a pool."""
    cls = type(collector)
    if not isinstance(collector, VllmKVCacheMetricsCollector):
        return f"metrics_collector is a {cls.__qualname__}, not vLLM's KVCacheMetricsCollector"
    base = KVCacheMetricsCollector if issubclass(cls, KVCacheMetricsCollector) else VllmKVCacheMetricsCollector
    for name in HOOKS:
        if getattr(cls, name) is not getattr(base, name):
            return f"metrics_collector's class {cls.__qualname__} overrides {name} (a Python hook per block)"
    for name in _VIEWED:
        if not issubclass(cls, KVCacheMetricsCollector) and any(
            name in vars(k) for k in cls.__mro__ if k not in (VllmKVCacheMetricsCollector, object)
        ):
            return f"metrics_collector's class {cls.__qualname__} defines {name} at class level"
    rate = collector.sample_rate
    if isinstance(rate, bool) or not isinstance(rate, Real):
        return f"metrics_collector.sample_rate is {rate!r}, not a number (vLLM raises at its first allocation)"
    if _pool_of(collector) is not None:
        return "metrics_collector already records the blocks of another kvblock pool"
    held = collector.__dict__.get("block_metrics")
    if num_blocks is not None and isinstance(held, dict):
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks for b in held):
            return f"metrics_collector.block_metrics holds states of blocks outside a pool of {num_blocks}"
    return None


_FACES: dict[type, type] = {}


def _face_class(cls: type) -> type:
    """:class:`KVCacheMetricsCollector` for vLLM's class, or a subclass of it and ``cls`` (for
    a user subclass that overrides none of the hooks), made once per class."""
    if issubclass(cls, KVCacheMetricsCollector):
        return cls
    if cls is VllmKVCacheMetricsCollector:
        return KVCacheMetricsCollector
    face = _FACES.get(cls)
    if face is None:
        face = _FACES[cls] = type(cls.__name__, (KVCacheMetricsCollector, cls), {"__module__": cls.__module__})
    return face


def bind(collector: Any, pool: Any) -> None:
    """Make kvblock's ``pool`` record residency metrics for ``collector`` (vLLM's
    ``KVCacheMetricsCollector``; :func:`unsupported_reason` must be None): the pool's Rust
    metrics start with the collector's ``sample_rate`` and the states already in its
    ``block_metrics`` (ids of this pool); the collector becomes this module's
    :class:`KVCacheMetricsCollector` (the same object), its events kept.

    Raises:
        TypeError: ``unsupported_reason(collector)`` is not None (nothing changes).
        ValueError: a ``block_metrics`` key that is not a block id of ``pool`` (nothing
            changes).
    """
    reason = unsupported_reason(collector)
    if reason is not None:
        raise TypeError(reason)
    d = collector.__dict__
    if isinstance(collector, KVCacheMetricsCollector):
        # bound before, to a pool that is gone: its events and rate stay, its states went
        states: dict[Any, Any] = {}
        events, rate = d["_kvblock_events"], d["_kvblock_sample_rate"]
    else:
        states = dict(d.get("block_metrics") or {})
        events, rate = d.get("_eviction_events", []), d.get("sample_rate", 0.01)
    n = pool.num_gpu_blocks
    for block_id in states:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < n:
            raise ValueError(f"metrics_collector.block_metrics: {block_id!r} is not a block id of this pool")
    pool._residency_enable(float(rate), random.getrandbits(64))
    for block_id, state in states.items():
        _set_state(pool, block_id, state)
    for name in _VIEWED:
        d.pop(name, None)
    collector.__class__ = _face_class(type(collector))
    d["_kvblock_sample_rate"] = rate
    d["_kvblock_events"] = events
    d["_kvblock_pool"] = weakref.ref(pool)


def _move_events(collector: Any, pool: Any) -> None:
    """Move the pool's pending eviction events into the collector's list, as vLLM's
    ``KVCacheEvictionEvent`` objects."""
    if pool._residency_num_pending():
        # built in Rust as KVCacheEvictionEvent's __init__ builds them (its three fields)
        pool._residency_take_events(KVCacheEvictionEvent, collector.__dict__["_kvblock_events"])


def pool_finalized(pool: Any) -> None:
    """``pool`` is being destroyed: the events it recorded for its collector, not read yet, go
    to the collector's list (they are the collector's). Its sampled states go with it."""
    collector = pool.__dict__.get("metrics_collector")
    if not isinstance(collector, KVCacheMetricsCollector):
        return
    ref = collector.__dict__.get("_kvblock_pool")
    owner = None if ref is None else ref()
    if owner is None or owner is pool:
        _move_events(collector, pool)


def _set_state(pool: Any, block_id: int, state: Any) -> None:
    pool._residency_set(block_id, int(state.birth_time_ns), int(state.last_access_ns), [int(t) for t in state.access_history])


def _state(birth: int, last: int, history: list[int]) -> BlockMetricsState:
    """vLLM's ``BlockMetricsState`` with these fields (a snapshot of the Rust state)."""
    s = BlockMetricsState.__new__(BlockMetricsState)
    s.birth_time_ns = birth
    s.last_access_ns = last
    s.access_history = deque(history, maxlen=4)
    return s


class _BlockMetrics(MutableMapping):  # type: ignore[type-arg]
    """``collector.block_metrics``: ``{block_id: BlockMetricsState}`` over the pool's Rust
    state, in vLLM's dict order. Reading gives a snapshot ``BlockMetricsState``; assigning one
    sets the block's state (its last 4 accesses kept); deleting forgets it without an event;
    ``clear()`` forgets every block (pending events stay, as in vLLM)."""

    __slots__ = ("_ref",)

    def __init__(self, pool: Any) -> None:
        self._ref = weakref.ref(pool) if pool is not None else lambda: None

    def _pool(self) -> Any:
        return self._ref()

    def _key(self, block_id: object) -> int | None:
        pool = self._pool()
        if pool is None or isinstance(block_id, bool) or not isinstance(block_id, int):
            return None
        return block_id if 0 <= block_id < pool.num_gpu_blocks else None

    def __getitem__(self, block_id: object) -> BlockMetricsState:
        k = self._key(block_id)
        raw = None if k is None else self._pool()._residency_get(k)
        if raw is None:
            raise KeyError(block_id)
        return _state(*raw)

    def __setitem__(self, block_id: int, state: BlockMetricsState) -> None:
        k = self._key(block_id)
        if k is None:
            raise KeyError(f"{block_id!r} is not a block id of this pool")
        _set_state(self._pool(), k, state)

    def __delitem__(self, block_id: object) -> None:
        k = self._key(block_id)
        if k is None or not self._pool()._residency_remove(k):
            raise KeyError(block_id)

    def __iter__(self) -> Iterator[int]:
        pool = self._pool()
        return iter([] if pool is None else pool._residency_ids())

    def __len__(self) -> int:
        pool = self._pool()
        return 0 if pool is None else pool._residency_len()

    def __contains__(self, block_id: object) -> bool:
        k = self._key(block_id)
        return k is not None and self._pool()._residency_get(k) is not None

    def clear(self) -> None:
        pool = self._pool()
        if pool is not None:
            pool._residency_clear()

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class KVCacheMetricsCollector(VllmKVCacheMetricsCollector):
    """vLLM's ``KVCacheMetricsCollector`` once kvblock's pool records for it (:func:`bind`):
    the same attributes and methods, its state in the Rust pool.

    * ``block_metrics``: a live ``{block_id: BlockMetricsState}`` view (vLLM's dict order).
    * ``_eviction_events``: the list ``drain_events()`` hands over, vLLM's
      ``KVCacheEvictionEvent`` objects (``lifetime_seconds``, ``idle_seconds``: float seconds;
      ``reuse_gaps_seconds``: a tuple of up to 3 float seconds), moved from Rust when read.
    * ``sample_rate``: read by the pool at every allocation; setting it takes effect at once.
    * ``on_block_allocated`` / ``on_block_accessed`` / ``on_block_evicted`` (``block``: an
      object with a ``block_id`` of this pool): the same transitions the pool makes itself,
      for code that calls the hooks directly.

    ``reset()`` and ``drain_events()`` are vLLM's own methods, unchanged.
    """

    @property  # type: ignore[override]
    def block_metrics(self) -> _BlockMetrics:  # type: ignore[override]
        """vLLM's ``block_metrics`` (block id -> ``BlockMetricsState``) as a live view of
        the residency the Rust pool records; assigning a dict replaces it (``KeyError`` for
        an id not of this pool, nothing changed)."""
        return _BlockMetrics(_pool_of(self))

    @block_metrics.setter
    def block_metrics(self, value: dict[int, BlockMetricsState]) -> None:
        view = _BlockMetrics(_pool_of(self))
        items = list(dict(value).items())
        for block_id, _state_ in items:
            if view._key(block_id) is None:
                raise KeyError(f"{block_id!r} is not a block id of this pool")
        view.clear()
        for block_id, state in items:
            view[block_id] = state

    @property
    def _eviction_events(self) -> list[KVCacheEvictionEvent]:
        pool = _pool_of(self)
        if pool is not None:
            _move_events(self, pool)
        return self.__dict__["_kvblock_events"]  # type: ignore[no-any-return]

    @_eviction_events.setter
    def _eviction_events(self, value: list[KVCacheEvictionEvent]) -> None:
        # the events not moved yet belonged to the list being replaced
        pool = _pool_of(self)
        if pool is not None:
            pool._residency_take_events(KVCacheEvictionEvent, [])
        self.__dict__["_kvblock_events"] = value

    @property  # type: ignore[override]
    def sample_rate(self) -> Any:  # type: ignore[override]
        """vLLM's sampling rate of blocks, in [0, 1]; setting it on a collector attached to a
        kvblock pool takes a real number (``TypeError`` otherwise) and applies it there."""
        return self.__dict__["_kvblock_sample_rate"]

    @sample_rate.setter
    def sample_rate(self, value: Any) -> None:
        pool = _pool_of(self)
        if pool is not None:
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"sample_rate: kvblock's pool samples at a real number, got {value!r}")
            pool._residency_set_rate(float(value))
        self.__dict__["_kvblock_sample_rate"] = value

    def _hook(self, kind: str, block: Any) -> None:
        pool = _pool_of(self)
        if pool is not None:
            pool._residency_hook(kind, block.block_id)

    def on_block_allocated(self, block: Any) -> None:
        """vLLM's ``on_block_allocated(block)``: sample ``block`` (an object with the ``block_id`` of a
        block of this pool) with probability ``sample_rate``: a fresh state born now. ValueError for a block id outside the pool."""
        self._hook("allocated", block)

    def on_block_accessed(self, block: Any) -> None:
        """vLLM's ``on_block_accessed(block)``: record an access of a sampled block now (its last
        access; the history keeps the last 4). ValueError for a block id outside the pool."""
        self._hook("accessed", block)

    def on_block_evicted(self, block: Any) -> None:
        """vLLM's ``on_block_evicted(block)``: drop a sampled block's state and record its
        ``KVCacheEvictionEvent``. ValueError for a block id outside the pool."""
        self._hook("evicted", block)
