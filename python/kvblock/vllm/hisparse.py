"""vLLM's HiSparse faces of kvblock's manager: the ``HiSparseCoordinator`` that vLLM's
``get_hisparse_coordinator(manager)``, its HiSparse connector and its tests read, the host
pool behind the source group, and the resident / hot groups' residency calls.

Everything is a view of the Rust state (``rust/src/manager/hisparse_tier.rs``: the host
pool and the residency the manager holds), read and changed through the manager binding's
``_hisparse_*`` calls; nothing is copied or kept in sync here. The coordinator view is an
instance of vLLM's own ``HiSparseCoordinator`` (a subclass that never runs vLLM's
constructor), bound as ``coordinator`` on the HiSparse group views when kvblock's manager is
built, so ``get_hisparse_coordinator(manager)`` returns it. See ``docs/hisparse.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from vllm.v1.hisparse import coordinator as _vhc
from vllm.v1.hisparse import types as _vht

from .originals import keep_original, original
from .releases import current as _current_release

__all__ = [
    "HiSparseCoordinatorView",
    "HostBlock",
    "HostBlockPool",
    "bind",
    "bind_host_metrics",
    "group_mixins",
    "host_metrics_collector",
    "pop_blocks_for_free",
    "reset_prefix_cache",
]

RELEASE = _current_release()


class HostBlock:
    """A block of the HiSparse host pool, as vLLM's ``KVCacheBlock`` shows it:
    ``block_id`` (an index into the host pool, not the device pool), ``ref_cnt``,
    ``block_hash`` (``BlockHashWithGroupId`` bytes or None), ``block_hash_num_tokens``,
    ``is_null``, ``pool`` (the :class:`HostBlockPool`). Read from the Rust host pool on every
    access; the pool keeps one view per block, so ``is`` and ``==`` agree."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: "HostBlockPool", block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def pool(self) -> "HostBlockPool":
        return self._pool

    @property
    def ref_cnt(self) -> int:
        return int(self._pool._m._hisparse_host_block(self.block_id)[0])

    @property
    def block_hash(self) -> bytes | None:
        h = self._pool._m._hisparse_host_block(self.block_id)[1]
        return None if h is None else bytes(h)

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._pool._m._hisparse_host_block(self.block_id)[2]  # type: ignore[no-any-return]

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostBlock) and other._pool is self._pool and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self._pool), self.block_id))

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, _block_hash={self.block_hash!r}, medium=CPU)"


class _HostBlocks(Sequence[HostBlock]):
    """``blocks[i]`` is host block ``i``."""

    def __init__(self, pool: "HostBlockPool") -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    def __getitem__(self, i):  # type: ignore[override]
        n = len(self)
        if isinstance(i, slice):
            return [self._pool._view(j) for j in range(n)[i]]
        i = operator.index(i)
        if i < 0:
            i += n
        return self._pool._view(i)


class HostBlockPool:
    """vLLM's HiSparse host pool (``SharedEventQueueBlockPool``, ``medium`` CPU,
    ``kv_cache_config.hisparse_host_num_blocks`` blocks) over the host pool kvblock's manager
    holds in Rust. Its blocks are :class:`HostBlock` views; ``num_gpu_blocks`` is the host
    pool's size (vLLM's name); ``kv_event_queue`` is the device pool's (vLLM shares one
    queue). Bad ids and over-freeing raise ``ValueError`` (the Rust pool's), changing
    nothing.

    ``metrics_collector``: None, or, when the manager was built with one (``--kv-cache-metrics``),
    the host pool's own ``KVCacheMetricsCollector`` at the device collector's ``sample_rate``
    (vLLM's ``bind_host_pool``), a :class:`kvblock.vllm.metrics.KVCacheMetricsCollector` over
    the Rust host pool's residency metrics (:func:`bind_host_metrics`): the host pool's
    allocations, hits and evictions are recorded there, as the device pool's are."""

    medium = "CPU"

    def __init__(self, manager: Any) -> None:
        self._m = manager
        num_blocks, _free, caching, hash_block_size = manager._hisparse_host_info()
        self.num_gpu_blocks = int(num_blocks)
        self.enable_caching = bool(caching)
        self.hash_block_size = int(hash_block_size)
        self._views: dict[int, HostBlock] = {}
        self.metrics_collector: Any = None

    def __del__(self) -> None:
        # residency metrics: the events recorded and not read yet stay the collector's
        if self.__dict__.get("metrics_collector") is not None:
            from .metrics import pool_finalized

            pool_finalized(self)

    # the residency calls kvblock.vllm.metrics makes on a pool (BlockPoolCore's _residency_*),
    # on the Rust host pool
    def _residency_enable(self, sample_rate: float, seed: int) -> None:
        self._m._hisparse_host_residency_enable(sample_rate, seed)

    def _residency_on(self) -> bool:
        return bool(self._m._hisparse_host_residency_on())

    def _residency_set_rate(self, sample_rate: float) -> None:
        self._m._hisparse_host_residency_set_rate(sample_rate)

    def _residency_ids(self) -> list[int]:
        return self._m._hisparse_host_residency_ids()  # type: ignore[no-any-return]

    def _residency_len(self) -> int:
        return int(self._m._hisparse_host_residency_len())

    def _residency_get(self, block_id: int) -> tuple[int, int, list[int]] | None:
        return self._m._hisparse_host_residency_get(block_id)  # type: ignore[no-any-return]

    def _residency_set(self, block_id: int, birth_time_ns: int, last_access_ns: int, history: list[int]) -> None:
        self._m._hisparse_host_residency_set(block_id, birth_time_ns, last_access_ns, history)

    def _residency_remove(self, block_id: int) -> bool:
        return bool(self._m._hisparse_host_residency_remove(block_id))

    def _residency_clear(self) -> None:
        self._m._hisparse_host_residency_clear()

    def _residency_hook(self, kind: str, block_id: int) -> None:
        self._m._hisparse_host_residency_hook(kind, block_id)

    def _residency_take_events(self, cls: type, out: list[Any]) -> int:
        return int(self._m._hisparse_host_residency_take_events(cls, out))

    def _residency_num_pending(self) -> int:
        return int(self._m._hisparse_host_residency_num_pending())

    def _view(self, block_id: int) -> HostBlock:
        v = self._views.get(block_id)
        if v is None:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise IndexError(f"host block id {block_id} out of range")
            v = self._views[block_id] = HostBlock(self, block_id)
        return v

    def _ids(self, blocks: Iterable[Any]) -> list[int]:
        out = []
        for b in blocks:
            if isinstance(b, HostBlock) and b._pool is self:
                out.append(b.block_id)
            else:
                raise TypeError(f"{b!r} is not a block of this HiSparse host pool")
        return out

    @property
    def blocks(self) -> Sequence[HostBlock]:
        return _HostBlocks(self)

    @property
    def null_block(self) -> HostBlock:
        return self._view(0)

    @property
    def enable_kv_cache_events(self) -> bool:
        return bool(self._m.block_pool.enable_kv_cache_events)

    @property
    def kv_event_queue(self) -> list[Any]:
        """The device pool's event queue (vLLM's host pool appends to it)."""
        return self._m.block_pool.kv_event_queue  # type: ignore[no-any-return]

    def get_num_free_blocks(self) -> int:
        """Free host blocks (cached ones included), as vLLM's ``get_num_free_blocks``."""
        return int(self._m._hisparse_host_info()[1])

    def get_usage(self) -> float:
        """The used fraction of the host pool (the null block not counted)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total > 0 else 0.0

    def get_new_blocks(self, num_blocks: int) -> list[HostBlock]:
        """``num_blocks`` host blocks (evicting cached ones), one reference each. Raises
        ValueError, taking nothing, when fewer are free."""
        return [self._view(b) for b in self._m._hisparse_host_get_new_blocks(operator.index(num_blocks))]

    def touch(self, blocks: Any) -> None:
        """Take a reference on each host block (a flat sequence or one per group; the null
        block skipped)."""
        ids: list[int] = []
        for b in blocks:
            ids.extend(self._ids(b) if isinstance(b, (list, tuple)) else self._ids((b,)))
        self._m._hisparse_host_touch(ids)

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """Drop one reference per host block in order (the null block skipped). Blocks of
        the device pool are freed into it, as vLLM's ``free_blocks`` routes by ``block.pool``.
        ``evict_first`` (0.34) is passed on to the device pool only."""
        own: list[int] = []
        device: list[Any] = []
        for b in ordered_blocks:
            if isinstance(b, HostBlock) and b._pool is self:
                own.append(b.block_id)
            elif getattr(b, "pool", None) is self._m.block_pool:
                device.append(b)
            else:
                raise TypeError(f"{b!r} is not a block of this HiSparse host pool")
        self._m._hisparse_host_free(own)
        if device:
            if evict_first:
                self._m.block_pool.free_blocks(device, evict_first=True)
            else:
                self._m.block_pool.free_blocks(device)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of these host blocks (vLLM's ``evict_blocks``). An id past the
        pool is an ``AssertionError``, as vLLM's; nothing is evicted then."""
        n = self.num_gpu_blocks
        ids = []
        for block_id in block_ids:
            i = operator.index(block_id)
            assert 0 <= i < n, f"Invalid block_id {i} >= {n}."
            ids.append(i)
        self._m._hisparse_host_evict(ids)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache`` on the host pool: if no host block is in use, every
        cache key is cleared (an ``AllBlocksCleared`` into the device pool's queue with KV
        events on) and the host collector reset; False, changing nothing, otherwise."""
        ok = bool(self._m._hisparse_host_reset_prefix_cache())
        if ok and self.metrics_collector is not None:
            # as vLLM's pool (the Rust metrics were reset with the keys)
            self.metrics_collector.reset()
        return ok

    def __repr__(self) -> str:
        return f"<kvblock HiSparse host pool of {self.num_gpu_blocks} blocks>"


class _ResidencyChanges(Mapping[str, dict[int, Any]]):
    """A resident group's ``residency_changes``: ``{request_id: {page: block}}``, the Rust
    overlay itself (vLLM's entries exactly: an adopted page as its device block, a dropped one
    as the null block, also where that equals the table), read on every access (a
    snapshot per read: the resident calls change it, not this mapping)."""

    def __init__(self, view: Any, k: int) -> None:
        self._v = view
        self._k = k

    def _dict(self) -> dict[str, dict[int, Any]]:
        m = self._v._m
        view = m.block_pool._view
        return {rid: {p: view(b) for p, b in pages} for rid, pages in m._hisparse_residency_changes(self._k)}

    def __getitem__(self, request_id: str) -> dict[int, Any]:
        return self._dict()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


class _ResidentCalls:
    """The resident group's residency calls (mixed into its group view)."""

    _hisparse_k: int

    @property
    def residency_changes(self) -> Mapping[str, dict[int, Any]]:
        return _ResidencyChanges(self, self._hisparse_k)

    def get_resident_page(self, request_id: str, block_idx: int) -> Any:
        """The device block page ``block_idx`` is read from, None when only the host holds
        it (vLLM's ``get_resident_page``)."""
        b = self._m._hisparse_resident_page(self._hisparse_k, request_id, operator.index(block_idx))  # type: ignore[attr-defined]
        return None if b is None else self._m.block_pool._view(b)  # type: ignore[attr-defined]

    def drop_resident_page(self, request_id: str, block_idx: int) -> Any:
        """Stop reading page ``block_idx`` from the GPU; the device block it was read from, None
        if it had none (vLLM's ``drop_resident_page``, on the Rust overlay)."""
        b = self._m._hisparse_drop_resident_page(self._hisparse_k, request_id, operator.index(block_idx))  # type: ignore[attr-defined]
        return None if b is None else self._m.block_pool._view(b)  # type: ignore[attr-defined]

    def adopt_resident_page(self, request_id: str, block_idx: int, block: Any) -> bool:
        """Read host-only page ``block_idx`` from device ``block`` (vLLM's
        ``adopt_resident_page``: no reference taken; False when the page is past the table or
        already resident). ``block`` must be a block of the device pool (``TypeError``); the
        null block is a ``ValueError``; nothing changes then."""
        pool = self._m.block_pool  # type: ignore[attr-defined]
        if getattr(block, "pool", None) is not pool:
            raise TypeError(f"{block!r} is not a block of the device pool")
        return bool(
            self._m._hisparse_adopt_resident_page(  # type: ignore[attr-defined]
                self._hisparse_k, request_id, operator.index(block_idx), block.block_id
            )
        )

    def get_residency_row(self, request_id: str, start: int = 0) -> list[Any]:
        """The request's pages from ``start`` on, each the device block it is read from or
        the null block (read from the host) (vLLM's ``get_residency_row``)."""
        view = self._m.block_pool._view  # type: ignore[attr-defined]
        return [view(b) for b in self._m._hisparse_residency_row(self._hisparse_k, request_id, operator.index(start))]  # type: ignore[attr-defined]


class _SourceCalls:
    """Marks the source group's view (its ``block_pool`` is the host pool, bound by
    :func:`bind`)."""

    _hisparse_source = True

    def take_host_cow_copies(self) -> list[tuple[HostBlock, HostBlock]]:
        """vLLM's ``HiSparseSourceManager.take_host_cow_copies()``: the pending host
        copy-on-write ``(source, copy)`` host blocks, drained without retaining them (the
        coordinator's ``take_host_block_copies`` retains them)."""
        view = self.block_pool._view  # type: ignore[attr-defined]
        return [(view(s), view(d)) for s, d in self._m._hisparse_take_host_cow_copies()]  # type: ignore[attr-defined]


class _HotCalls:
    """The hot group's state (mixed into its group view)."""

    _hisparse_hot_k: int

    @property
    def blocks_per_request(self) -> int:
        return int(self.kv_cache_spec.blocks_per_request)  # type: ignore[attr-defined]

    @property
    def hot_required(self) -> set[str]:
        """The requests that asked for a hot region (a snapshot of the Rust set)."""
        return set(self._m._hisparse_hot_required(self._hisparse_hot_k))  # type: ignore[attr-defined]

    def require_hot(self, request_id: str) -> None:
        """Ask for a hot region for ``request_id`` (allocated by its next
        ``allocate_slots``), as vLLM's ``HiSparseHotManager.require_hot``: recorded in the
        Rust residency (``hot_required`` is a snapshot, so vLLM's ``set.add`` would be lost)."""
        self._m._hisparse_require_hot(self._hisparse_hot_k, str(request_id))  # type: ignore[attr-defined]


def group_mixins(manager_cls: type) -> tuple[type, ...]:
    """The HiSparse calls the view class of vLLM's ``manager_cls`` adds (none for a group
    that is not HiSparse's)."""
    from vllm.v1.core import single_type_kv_cache_manager as st

    if issubclass(manager_cls, st.HiSparseSourceManager):
        return (_SourceCalls,)
    if issubclass(manager_cls, st.HiSparseResidentManager):
        return (_ResidentCalls,)
    if issubclass(manager_cls, st.HiSparseHotManager):
        return (_HotCalls,)
    return ()


def _plain_dataclass(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls`` is a plain dataclass with exactly the fields ``names`` (in order):
    instances with a ``__dict__``, ``object.__new__``, the generated ``__init__``, no
    ``__post_init__``, and (not frozen) no ``__setattr__`` of its own. Then :func:`_spill` and
    the core make the instance with ``object.__new__`` and set its fields themselves (vLLM's
    generated ``__init__`` sets each field with ``object.__setattr__``, frozen or not, two
    thirds of the cost of building a row through the class)."""
    params = getattr(cls, "__dataclass_params__", None)
    return (
        dataclasses.is_dataclass(cls)
        and params is not None
        and params.init
        and tuple(f.name for f in dataclasses.fields(cls)) == names
        and "__slots__" not in vars(cls)
        and not hasattr(cls, "__post_init__")
        and cls.__new__ is object.__new__
        and (params.frozen or cls.__setattr__ is object.__setattr__)
    )


_new_instance = object.__new__
_SPILL_FIELDS = ("transfer_id", "host_block_id", "resident_block_ids", "after_forward", "restore")
_FAST_SPILL = {
    True: _plain_dataclass(_vht.SparseKVPageTransfer, _SPILL_FIELDS),
    False: _plain_dataclass(_vht.SparseKVPageTransfer, _SPILL_FIELDS[:3] + _SPILL_FIELDS[4:]),
}
_FAST_MIRROR = _plain_dataclass(_vht.SparseKVRowMirror, ("source_starts", "destination_start", "num_rows"))
_FAST_UPDATE = _plain_dataclass(_vht.SparseKVResidencyUpdate, ("pages", "block_ids"))
_FAST_COMMAND = _plain_dataclass(_vht.SparseKVOffloadCommand, ("page_transfers",))
# (fast, after_forward, command_fast) for the core's SparseKVOffloadCommand builder
_TRANSFER_FLAGS = (_FAST_SPILL[RELEASE.hisparse_after_forward], RELEASE.hisparse_after_forward, _FAST_COMMAND)


def _spill(t: Sequence[Any]) -> Any:
    """vLLM's ``SparseKVPageTransfer`` of one Rust transfer row (``(transfer_id,
    host_block_id, resident_block_ids, after_forward, restore)``; ``after_forward`` only
    where the release has it): equal, field for field, to vLLM's ``__init__``'s."""
    after_forward = RELEASE.hisparse_after_forward
    if not _FAST_SPILL[after_forward]:
        kwargs: dict[str, Any] = dict(
            transfer_id=t[0], host_block_id=t[1], resident_block_ids=tuple(t[2]), restore=bool(t[4])
        )
        if after_forward:
            kwargs["after_forward"] = bool(t[3])
        return _vht.SparseKVPageTransfer(**kwargs)
    obj = _new_instance(_vht.SparseKVPageTransfer)
    d = obj.__dict__
    d["transfer_id"] = t[0]
    d["host_block_id"] = t[1]
    d["resident_block_ids"] = tuple(t[2])
    if after_forward:
        d["after_forward"] = bool(t[3])
    d["restore"] = bool(t[4])
    return obj


class _PendingSpillView:
    """One ``pending_spills`` entry (vLLM's ``_PendingSpill``), a snapshot: ``transfer_id``,
    ``page`` (``(request_id, page)``), ``host_block``, ``resident_blocks``, ``restore``,
    ``expected_worker_completions``, ``worker_completions``, ``enqueue_applied``."""

    def __init__(self, coordinator: "HiSparseCoordinatorView", row: Sequence[Any]) -> None:
        tid, rid, page, host, resident, restore, expected, done, applied = row
        self.transfer_id = tid
        self.page = (rid, page)
        self.host_block = coordinator.host_manager.block_pool._view(host)
        self.resident_blocks = tuple(coordinator.gpu_pool._view(b) for b in resident)
        self.restore = restore
        self.expected_worker_completions = expected
        self.worker_completions = done
        self.enqueue_applied = applied

    def __repr__(self) -> str:
        return f"_PendingSpill(transfer_id={self.transfer_id}, page={self.page})"


def _count(name: str, value: Any) -> int:
    """``value`` as a count (an integer >= 0); TypeError / ValueError otherwise."""
    n = operator.index(value)
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


class HiSparseCoordinatorView(_vhc.HiSparseCoordinator):
    """kvblock's HiSparse coordinator: an instance of vLLM's ``HiSparseCoordinator`` whose
    books are the Rust residency of kvblock's manager. Attributes (``resident_managers``,
    ``hot_managers``, ``host_manager``, ``host_group_id``, ``gpu_pool``,
    ``num_reprefillable_tokens``) are fixed at binding; ``transition_watermark`` and
    ``max_spill_pages`` are the Rust residency's (settable, as vLLM's); ``spills_to_send``, ``pending_spills``, ``request_states`` and ``copies`` are read
    from Rust on every access (snapshots: changing them changes nothing). The methods are
    vLLM's, run in Rust."""

    def __init__(self, manager: Any, coordinator: Any) -> None:  # noqa: D107 - vLLM's constructor is not run
        self._m = manager
        host_group, resident_groups, hot_groups, _, _ = manager._hisparse_layout()
        managers = tuple(coordinator.single_type_managers)
        self.managers = managers
        self.num_reprefillable_tokens = coordinator.num_reprefillable_tokens
        self.host_group_id = host_group
        self.host_manager = managers[host_group]
        self.has_host_cache = True
        self.resident_managers = tuple(managers[g] for g in resident_groups)
        self.hot_managers = tuple(managers[g] for g, _ in hot_groups)
        self.gpu_pool = manager.block_pool if self.resident_managers else None
        # vLLM builds its coordinator on the first get_hisparse_coordinator call; this view
        # exists from the manager's construction, so that call fixes 0.34's import step
        self._import_step_fixed = False
        if RELEASE.hisparse_import_reservations:
            self._import_step_tokens = 0
        # the connector's per-step calls bound straight to the core (the methods below say
        # the same): no Python frame per call, vLLM's result objects built in Rust
        self.advance_scheduled = manager._hisparse_advance_scheduled  # type: ignore[method-assign]
        self.update_spills = manager._hisparse_update_spills  # type: ignore[method-assign]
        self.all_context_pages_resident = manager._hisparse_all_context_pages_resident  # type: ignore[method-assign]
        self.build_row_mirrors = functools.partial(  # type: ignore[method-assign]
            manager._hisparse_row_mirror_objects, _vht.SparseKVRowMirror, _FAST_MIRROR
        )
        self.build_offload_command = functools.partial(  # type: ignore[method-assign]
            manager._hisparse_offload_command_object,
            _vht.SparseKVOffloadCommand, _vht.SparseKVPageTransfer, *_TRANSFER_FLAGS,
        )
        self.take_residency_updates = functools.partial(  # type: ignore[method-assign]
            manager._hisparse_residency_update_objects, _vht.SparseKVResidencyUpdate, _FAST_UPDATE
        )

    @property
    def import_step_tokens(self) -> int:  # type: ignore[override]
        """vLLM 0.34's ``import_step_tokens`` (tokens an admission-capped host import is
        sized further by). Set by the first :func:`get_hisparse_coordinator` call; setting it
        once a request was admitted raises AssertionError (vLLM's memoised coordinator), and
        before 0.34 there is none (AttributeError, as vLLM's)."""
        if not RELEASE.hisparse_import_reservations:
            raise AttributeError("import_step_tokens")
        return self._import_step_tokens

    @import_step_tokens.setter
    def import_step_tokens(self, value: int) -> None:
        n = operator.index(value)
        self._m._hisparse_set_import_step_tokens(n)
        self._import_step_tokens = n

    # -- state ------------------------------------------------------------------------------
    @property
    def max_spill_pages(self) -> int:  # type: ignore[override]
        """The spills one step may plan (``max_model_len // block_size`` at first). Setting it
        sets the Rust residency's (vLLM's tests lower it); a negative number is a
        ``ValueError``, nothing set."""
        return int(self._m._hisparse_layout()[3])

    @max_spill_pages.setter
    def max_spill_pages(self, value: int) -> None:
        self._m._hisparse_set_limits(max_spill_pages=_count("max_spill_pages", value))

    @property
    def transition_watermark(self) -> int:  # type: ignore[override]
        """Free device blocks below which requests start reading from the host. Settable,
        as ``max_spill_pages``."""
        return int(self._m._hisparse_layout()[4])

    @transition_watermark.setter
    def transition_watermark(self, value: int) -> None:
        self._m._hisparse_set_limits(transition_watermark=_count("transition_watermark", value))

    @property
    def spills_to_send(self) -> list[Any]:  # type: ignore[override]
        return [_spill(t) for t in self._m._hisparse_spills_to_send()]

    @spills_to_send.setter
    def spills_to_send(self, value: Any) -> None:
        raise TypeError("spills_to_send is a view of kvblock's residency (build_offload_command takes it)")

    @property
    def pending_spills(self) -> dict[int, Any]:  # type: ignore[override]
        return {row[0]: _PendingSpillView(self, row) for row in self._m._hisparse_pending_spills()}

    @pending_spills.setter
    def pending_spills(self, value: Any) -> None:
        raise TypeError("pending_spills is a view of kvblock's residency")

    @property
    def request_states(self) -> dict[str, Any]:  # type: ignore[override]
        out = {}
        for rid, valid, ready, pending, recorded, pinned, unpinned, adopt, synced, stale in self._m._hisparse_request_states():
            out[rid] = _vhc._HiSparseRequestState(
                valid_pages=set(valid),
                ready_prefix_pages=ready,
                pending_pages=dict(pending),
                copies_recorded_blocks=recorded,
                pinned_clean=set(pinned),
                unpinned_pages=set(unpinned),
                pages_to_adopt=adopt,
                synced_pages=synced,
                stale_pages=set(stale),
            )
        return out

    @request_states.setter
    def request_states(self, value: Any) -> None:
        raise TypeError("request_states is a view of kvblock's residency")

    @property
    def copies(self) -> dict[bytes, tuple[Any, ...]]:  # type: ignore[override]
        view = self._m.block_pool._view
        return {bytes(k): tuple(view(b) for b in ids) for k, ids in self._m._hisparse_copies()}

    @copies.setter
    def copies(self, value: Any) -> None:
        raise TypeError("copies is a view of kvblock's residency")

    # -- vLLM's calls -----------------------------------------------------------------------
    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """The step's requests (``(request_id, num_computed_tokens after the step)``): plan
        their spills and update their residency."""
        self._m._hisparse_advance_scheduled(requests)

    def update_residency(self, request_id: str) -> None:
        self._m._hisparse_update_residency(request_id)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        self._m._hisparse_plan_prefix_materialization(request_id, operator.index(num_computed_tokens))

    def update_spills(self, enqueued_counts: Mapping[int, int], completed_counts: Mapping[int, int]) -> None:
        """The workers' spill reports (``{transfer_id: workers}`` enqueued and completed)."""
        self._m._hisparse_update_spills(enqueued_counts, completed_counts)

    def build_offload_command(self) -> Any:
        """vLLM's ``SparseKVOffloadCommand`` of the planned spills (taken); None without
        resident groups."""
        return self._m._hisparse_offload_command_object(
            _vht.SparseKVOffloadCommand, _vht.SparseKVPageTransfer, *_TRANSFER_FLAGS
        )

    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]) -> tuple[Any, ...]:
        """vLLM's ``SparseKVRowMirror``s of the step's requests (``(request_id,
        num_computed_tokens, num_scheduled_tokens)``)."""
        return self._m._hisparse_row_mirror_objects(_vht.SparseKVRowMirror, _FAST_MIRROR, requests)  # type: ignore[no-any-return]

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        return bool(self._m._hisparse_all_context_pages_resident(requests))

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, Any]:
        """vLLM's ``SparseKVResidencyUpdate`` per request id (taken)."""
        return self._m._hisparse_residency_update_objects(_vht.SparseKVResidencyUpdate, _FAST_UPDATE, request_ids)  # type: ignore[no-any-return]

    def has_pending_work(self) -> bool:
        return bool(self._m._hisparse_has_pending_work())

    def has_pending_reclamation(self) -> bool:
        return bool(self._m._hisparse_has_pending_reclamation())

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        self._m._hisparse_record_pending_host_import(request_id, operator.index(num_tokens))

    def finish_host_import(self, request_id: str, failed: bool = False) -> None:
        self._m._hisparse_finish_host_import(request_id, bool(failed))

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        self._m._hisparse_complete_host_import(request_id, operator.index(num_computed_tokens))

    def get_host_block_pool(self) -> Any:
        return self.host_manager.block_pool

    def publish_when_ready(self, request: Any, num_computed_tokens: int, retention_interval: Any = None, **kwargs: Any) -> None:
        """Not a view call: kvblock's manager makes it itself, from the source group's
        ``cache_blocks`` (it keeps the request's hashes for the deferred publication). Raises
        ``NotImplementedError`` (vLLM's own body would change only a snapshot)."""
        raise NotImplementedError(
            "kvblock's manager publishes the host blocks itself (manager.cache_blocks); "
            "publish_when_ready is not a call of its HiSparse coordinator view"
        )

    def free(self, request_id: str) -> None:
        """Not a view call: kvblock's manager frees the residency with the request
        (``manager.free(request)``, which reads ``request.is_finished()``). Raises
        ``NotImplementedError`` (vLLM's own body would change only a snapshot)."""
        raise NotImplementedError(
            "kvblock's manager frees a request's residency itself (manager.free(request)); "
            "free(request_id) is not a call of its HiSparse coordinator view"
        )

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        """A prefix hit on the request's first ``num_host_pages`` host pages (capped at those
        it holds): they are clean, their GPU copies adopted at the next ``update_residency``.
        kvblock's manager makes this call itself on admission; this one is vLLM's, forwarded."""
        self._m._hisparse_commit_computed_blocks(request_id, _count("num_host_pages", num_host_pages))

    def take_host_block_copies(self) -> tuple[Any, ...]:
        """vLLM's ``take_host_block_copies()``: the host group's copy-on-write copies (a
        partial prefix hit on a host block redirected to a private host block), drained, as
        vLLM's ``KVCacheBlockCopy(src_block_id, dst_block_id)`` (host block ids). Both
        endpoints stay retained (``has_pending_work()`` is true) until
        :meth:`release_completed_host_copies` names the copy."""
        return tuple(
            _vhc.KVCacheBlockCopy(src_block_id=src, dst_block_id=dst)
            for src, dst in self._m._hisparse_take_host_block_copies()
        )

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        """vLLM's ``release_completed_host_copies(dst_block_ids)``: the copies the worker ran
        (by destination host block id; unknown ids ignored) free both endpoints into the
        host pool, last endpoint first."""
        self._m._hisparse_release_completed_host_copies([operator.index(b) for b in dst_block_ids])

    def __repr__(self) -> str:
        return f"<kvblock HiSparseCoordinator over {len(self.managers)} group(s)>"


HiSparseCoordinatorView.__name__ = HiSparseCoordinatorView.__qualname__ = "HiSparseCoordinator"


def get_hisparse_coordinator(kv_cache_manager: Any, *, import_step_tokens: int | None = None) -> Any:
    """vLLM 0.34's ``get_hisparse_coordinator(kv_cache_manager, *, import_step_tokens=None)``
    for kvblock's manager as well as vLLM's: the coordinator shared by the manager's HiSparse
    groups. For kvblock's manager it is the bound :class:`HiSparseCoordinatorView`; the first
    call sets its ``import_step_tokens`` (vLLM builds its coordinator with it then) and a later
    call with another value raises AssertionError, as vLLM's does. Any other manager goes to
    vLLM's function."""
    for group in kv_cache_manager.coordinator.single_type_managers:
        view = getattr(group, "coordinator", None)
        if isinstance(view, HiSparseCoordinatorView):
            if not view._import_step_fixed and import_step_tokens is not None:
                view.import_step_tokens = import_step_tokens
            view._import_step_fixed = True
            assert import_step_tokens in (None, view.import_step_tokens)
            return view
    return _vllm_get_hisparse_coordinator(kv_cache_manager, import_step_tokens=import_step_tokens)


_vllm_get_hisparse_coordinator = original(_vhc, "get_hisparse_coordinator")


def _install_coordinator_lookup() -> None:
    """Make vLLM's ``get_hisparse_coordinator`` (in its module and, once imported, the HiSparse
    connector's) find kvblock's view with 0.34's ``import_step_tokens`` (idempotent; vLLM's
    managers still get vLLM's function)."""
    import sys

    if not RELEASE.hisparse_import_reservations:
        return
    modules = [_vhc, sys.modules.get("vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector")]
    for module in modules:
        if module is None or getattr(module, "get_hisparse_coordinator", None) is get_hisparse_coordinator:
            continue
        keep_original(module, "get_hisparse_coordinator")
        module.get_hisparse_coordinator = get_hisparse_coordinator


class _ResidencyWatcher:
    """The reuse watcher the HiSparse residency registers on the device pool, as vLLM code
    reads it from ``BlockPool._reuse_watchers``: called with a block, the residency loses the
    pages that block held, as when the pool reuses it. Holds the manager weakly (the pool
    must not keep its manager alive)."""

    def __init__(self, manager: Any) -> None:
        self._manager = weakref.ref(manager)

    def __call__(self, block: Any) -> None:
        manager = self._manager()
        if manager is not None:
            manager._hisparse_on_blocks_reused([operator.index(block.block_id)])


def bind(manager: Any, coordinator: Any) -> HiSparseCoordinatorView:
    """Bind a :class:`HiSparseCoordinatorView` on the HiSparse group views of kvblock's
    ``manager`` (its ``coordinator`` view): the source group gets the host pool view, the
    resident groups their residency calls; every HiSparse group's ``coordinator`` is the
    view, as vLLM's coordinator binds itself."""
    host_group, resident_groups, hot_groups, _, _ = manager._hisparse_layout()
    views = coordinator.single_type_managers
    host_pool = views[host_group]._hisparse_pool = HostBlockPool(manager)
    # the manager's KVCacheBlocks view the source group's ids through the host pool
    # (weakly: the host pool view holds the manager, whose Rust state holds the device pool,
    # and the cyclic GC cannot see through that edge)
    manager.block_pool._hisparse_group_view = (host_group, weakref.WeakMethod(host_pool._view))
    for k, g in enumerate(resident_groups):
        views[g]._hisparse_k = k
    for k, (g, _) in enumerate(hot_groups):
        views[g]._hisparse_hot_k = k
    out = HiSparseCoordinatorView(manager, coordinator)
    for g in (host_group, *resident_groups, *(g for g, _ in hot_groups)):
        views[g].coordinator = out
    manager.block_pool._residency_on_reuse = _ResidencyWatcher(manager)
    _install_coordinator_lookup()
    return out


def host_metrics_collector(device_collector: Any) -> Any:
    """The host pool's own collector, as vLLM's ``bind_host_pool`` makes it: vLLM's
    ``KVCacheMetricsCollector(device_collector.sample_rate)`` (None without a device
    collector). Made before kvblock's manager builds anything, so that a rate vLLM's
    constructor refuses (outside ``(0, 1]``, NaN) raises its ``AssertionError`` with nothing
    built."""
    if device_collector is None:
        return None
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    return KVCacheMetricsCollector(device_collector.sample_rate)


def bind_host_metrics(manager: Any, collector: Any) -> None:
    """Make the Rust host pool of kvblock's ``manager`` record residency metrics for
    ``collector`` (from :func:`host_metrics_collector`), and set it as the host pool view's
    ``metrics_collector`` (:func:`kvblock.vllm.metrics.bind`: sampled at its ``sample_rate``,
    seeded from Python's ``random``)."""
    from .metrics import bind as bind_metrics

    host = next(v for v in manager.coordinator.single_type_managers if getattr(v, "_hisparse_source", False))
    pool = host.block_pool
    bind_metrics(collector, pool)
    pool.metrics_collector = collector


def reset_prefix_cache(manager: Any) -> bool:
    """vLLM's coordinator ``reset_prefix_cache()`` on kvblock's manager with HiSparse groups:
    each pool once, in the order its first group comes (the host pool first when the source
    group is group 0), every pool tried; True if every pool was reset."""
    host_group = manager._hisparse_layout()[0]
    host = manager.coordinator.single_type_managers[host_group].block_pool
    pools = [host, manager.block_pool] if host_group == 0 else [manager.block_pool, host]
    return all([pool.reset_prefix_cache() for pool in pools])


def pop_blocks_for_free(manager: Any, request: Any) -> list[Any]:
    """vLLM's ``KVCacheManager.pop_blocks_for_free(request)`` on a manager with HiSparse
    groups: every group's blocks in group order, the source group's as host blocks of the
    host pool view (so the device pool view's ``free_blocks`` routes them there by
    ``block.pool``, as vLLM's does); the request forgotten and the coordinator's
    ``free(request)`` made with ``request.is_finished()``. Nothing is freed yet."""
    host = next(v for v in manager.coordinator.single_type_managers if getattr(v, "_hisparse_source", False))
    host_view = host.block_pool._view
    device_view = manager.block_pool._view
    return [host_view(b) if is_host else device_view(b) for b, is_host in manager._hisparse_pop_blocks_for_free(request)]
