"""vLLM's ``KVCacheCoordinator`` and ``SingleTypeKVCacheManager`` faces of kvblock's manager:
views over the Rust state (no copy kept in sync), with vLLM 0.33.0's attribute and method
names, for the scheduler, the engine core, KV connectors and vLLM's own tests.

The coordinator view is an instance of vLLM's coordinator class of the same kind
(``HybridKVCacheCoordinator`` ...) so that vLLM's ``isinstance`` checks hold; its state and
every method are kvblock's.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Iterator, Mapping, MutableMapping, Set
from typing import Any, NamedTuple, Sequence

from vllm.v1.core import kv_cache_coordinator as _vkc

from .originals import original

__all__ = ["make_coordinator", "SingleTypeManagerView"]


class SpecGroup(NamedTuple):
    """vLLM's ``SpecGroup``: groups with one spec, looked up together."""

    spec: Any
    group_ids: list[int]
    manager_cls: type
    use_eagle: bool


def _ids(blocks: Sequence[Any]) -> list[int]:
    return [b if isinstance(b, int) else b.block_id for b in blocks]


class _ReqToBlocks(MutableMapping):
    """``req_to_blocks`` of one group: ``{request_id: [KVCacheBlock, ...]}`` (vLLM's is a
    ``defaultdict(list)``: reading a missing request creates its empty table, here too)."""

    def __init__(self, manager: Any, group: int, owner: Any = None) -> None:
        self._m = manager
        self._g = group
        # the group view whose block_pool the table's blocks belong to (HiSparse's source
        # group: the host pool); None: the manager's pool
        self._owner = owner

    def __getitem__(self, request_id: str) -> "_Table":
        if self._m._group_table(self._g, request_id) is None:
            self._m._group_set_table(self._g, request_id, [])
        return _Table(self._m, self._g, request_id, self._owner)

    def get(self, request_id: str, default: Any = None) -> Any:  # type: ignore[override]
        if self._m._group_table(self._g, request_id) is None:
            return default
        return _Table(self._m, self._g, request_id, self._owner)

    def __setitem__(self, request_id: str, blocks: Sequence[Any]) -> None:
        self._m._group_set_table(self._g, request_id, _ids(blocks))

    def __delitem__(self, request_id: str) -> None:
        if not self._m._group_del_table(self._g, request_id):
            raise KeyError(request_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._m._group_request_ids(self._g))

    def __len__(self) -> int:
        return len(self._m._group_request_ids(self._g))

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self._m._group_table(self._g, request_id) is not None

    def __repr__(self) -> str:
        return repr({k: list(self.get(k)) for k in self})


_GC_UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack
_GC_UNTRACK.argtypes = [ctypes.py_object]
_GC_UNTRACK.restype = None


class _Table(Sequence):
    """One request's table in one group, as a list of blocks: read live while the request
    holds a table (assigning an item writes the Rust table); once it is freed, the table it
    had when last read (vLLM hands out the list itself, which keeps its blocks)."""

    def __init__(self, manager: Any, group: int, request_id: str, owner: Any = None) -> None:
        self._m = manager
        self._g = group
        self._rid = request_id
        self._owner = owner
        self._last = manager._group_table(group, request_id) or []
        # as vLLM's request block lists (0.34: `untracked_list`), hidden from the cyclic GC:
        # it refers to the manager, which never refers back to it, so it is in no cycle
        _GC_UNTRACK(self)

    def _list(self) -> list[int]:
        ids = self._m._group_table(self._g, self._rid)
        if ids is None:
            return list(self._last)
        self._last = ids
        return ids

    def __len__(self) -> int:
        return len(self._list())

    def __getitem__(self, i):  # type: ignore[override]
        ids = self._list()
        view = (self._m if self._owner is None else self._owner).block_pool._view
        if isinstance(i, slice):
            return [view(b) for b in ids[i]]
        return view(ids[i])

    def __setitem__(self, i: int, block: Any) -> None:
        ids = self._list()
        ids[i] = block if isinstance(block, int) else block.block_id
        self._m._group_set_table(self._g, self._rid, ids)

    def append(self, block: Any) -> None:
        ids = self._list()
        ids.append(block if isinstance(block, int) else block.block_id)
        self._m._group_set_table(self._g, self._rid, ids)

    def extend(self, blocks: Sequence[Any]) -> None:
        ids = self._list()
        ids.extend(_ids(blocks))
        self._m._group_set_table(self._g, self._rid, ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Table):
            return self._list() == other._list() and self._m is other._m
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class _NumCached(MutableMapping):
    """``num_cached_block`` of one group: ``{request_id: cached blocks}`` (read-only)."""

    def __init__(self, manager: Any, group: int) -> None:
        self._m = manager
        self._g = group

    def _dict(self) -> dict[str, int]:
        return dict(self._m._group_num_cached(self._g))

    def __getitem__(self, request_id: str) -> int:
        return self._dict()[request_id]

    def __setitem__(self, request_id: str, value: int) -> None:
        raise TypeError("num_cached_block is a view of kvblock's manager")

    def __delitem__(self, request_id: str) -> None:
        raise TypeError("num_cached_block is a view of kvblock's manager")

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._dict()


class _RequestStateMap(Mapping[str, Any]):
    """One per-request dict of a group's manager (vLLM's ``_checkpoints``,
    ``_partial_hit_reqs``, ``_producer_partial_tail_reqs``, ``last_state_block_idx``,
    ``_num_retired_blocks``), read live from the Rust state: ``{request_id: value}`` with
    blocks as the pool's ``KVCacheBlock`` views. Read-only, except ``_partial_hit_reqs``
    (``writable``), whose items vLLM's code and tests set and delete."""

    #: the position of each field in ``_group_request_states`` rows
    _FIELDS = {"last_state_block_idx": 1, "num_retired": 2, "checkpoint": 4, "partial_hit": 5, "producer_tail": 6}

    def __init__(self, manager: Any, group: int, field: str, writable: bool = False) -> None:
        self._m = manager
        self._g = group
        self._i = self._FIELDS[field]
        self._field = field
        self._writable = writable

    def _value(self, raw: Any) -> Any:
        view = self._m.block_pool._view
        if self._field == "partial_hit":
            return (raw[0], view(raw[1]))
        if self._field == "producer_tail":
            return (view(raw[0]), raw[1])
        return raw

    def _dict(self) -> dict[str, Any]:
        return {row[0]: self._value(row[self._i]) for row in self._m._group_request_states(self._g) if row[self._i] is not None}

    def __getitem__(self, request_id: str) -> Any:
        return self._dict()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._dict()

    def __setitem__(self, request_id: str, value: tuple[int, Any]) -> None:
        if not self._writable:
            raise TypeError(f"{self._field} is a read-only view of kvblock's manager")
        block_idx, block = value
        self._m._group_set_partial_hit(self._g, request_id, (operator.index(block_idx), _ids([block])[0]))

    def __delitem__(self, request_id: str) -> None:
        if not self._writable:
            raise TypeError(f"{self._field} is a read-only view of kvblock's manager")
        if request_id not in self:
            raise KeyError(request_id)
        self._m._group_set_partial_hit(self._g, request_id, None)

    def pop(self, request_id: str, *default: Any) -> Any:
        try:
            value = self[request_id]
        except KeyError:
            if default:
                return default[0]
            raise
        del self[request_id]
        return value

    def __repr__(self) -> str:
        return repr(self._dict())


class _AllocatedReqs(Set[str]):
    """vLLM's ``_allocated_block_reqs`` of a Mamba "align" group (a set of request ids), read
    live from the Rust state."""

    def __init__(self, manager: Any, group: int) -> None:
        self._m = manager
        self._g = group

    def _set(self) -> set[str]:
        return {row[0] for row in self._m._group_request_states(self._g) if row[3]}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._set()

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def __repr__(self) -> str:
        return repr(self._set())


class SingleTypeManagerView:
    """vLLM's ``SingleTypeKVCacheManager`` for group ``kv_cache_group_id`` of a kvblock
    manager: ``block_size``, ``kv_cache_spec``, ``req_to_blocks``, ``num_cached_block``,
    ``new_block_ids`` and the per-group calls, on the Rust state."""

    def __init__(self, manager: Any, group: int, info: dict[str, Any], spec: Any, manager_cls: type) -> None:
        self._m = manager
        self.kv_cache_group_id = group
        self.kv_cache_spec = spec
        self.block_size = info["block_size"]
        self.dcp_world_size = info["dcp_world_size"]
        self.pcp_world_size = info["pcp_world_size"]
        self.scheduler_block_size = info["scheduler_block_size"]
        self.cache_hit_alignment_tokens = info["cache_hit_alignment_tokens"]
        self.max_admission_blocks_per_request = info["max_admission_blocks_per_request"]
        self.enable_caching = info["enable_caching"]
        self.use_eagle = info["use_eagle"]
        self.shared_prefix_checkpoint = info["shared_prefix_checkpoint"]
        self.drop_eagle_checkpoint_block = info["drop_eagle_checkpoint_block"]
        self._record_new_block_ids = info["records_new_block_ids"]
        self.manager_cls = manager_cls
        self.supports_fine_grained_hash_lookup = manager_cls.supports_fine_grained_hash_lookup
        self.retains_longer_hit = False
        self.req_to_blocks = _ReqToBlocks(manager, group, self)
        self.num_cached_block = _NumCached(manager, group)
        self._partial_hit_reqs = _RequestStateMap(manager, group, "partial_hit", writable=True)
        if getattr(spec, "mamba_cache_mode", None) is not None:
            self.mamba_cache_mode = spec.mamba_cache_mode
            self.num_speculative_blocks = spec.num_speculative_blocks
            self.has_prefill_checkpoint_blocks = spec.mamba_cache_mode == "align" and spec.num_prefill_checkpoint_blocks > 0
            if spec.mamba_cache_mode == "align":
                # vLLM's MambaManager has these in "align" mode only
                self.last_state_block_idx = _RequestStateMap(manager, group, "last_state_block_idx")
                self._num_retired_blocks = _RequestStateMap(manager, group, "num_retired")
                self._allocated_block_reqs = _AllocatedReqs(manager, group)
                self._checkpoints = _RequestStateMap(manager, group, "checkpoint")
                self._producer_partial_tail_reqs = _RequestStateMap(manager, group, "producer_tail")
        if hasattr(spec, "sliding_window"):
            self.sliding_window = spec.sliding_window
        if hasattr(spec, "attention_chunk_size") and spec.attention_chunk_size is not None:
            self.attention_chunk_size = spec.attention_chunk_size

    @property
    def block_pool(self) -> Any:
        # HiSparse's source group: the host pool (kvblock.vllm.hisparse binds it)
        return self.__dict__.get("_hisparse_pool") or self._m.block_pool

    @property
    def _null_block(self) -> Any:
        return self.block_pool.null_block

    @property
    def records_new_block_ids(self) -> bool:
        return self._record_new_block_ids

    @property
    def new_block_ids(self) -> list[int]:
        return self._m._group_new_block_ids(self.kv_cache_group_id)

    @property
    def has_positionally_stable_blocks(self) -> bool:
        return getattr(self, "mamba_cache_mode", None) != "align"

    def take_new_block_ids(self) -> list[int]:
        return self._m._group_take_new_block_ids(self.kv_cache_group_id)

    @property
    def _pending_cow_copies(self) -> list[tuple[Any, Any]]:
        """vLLM's ``_pending_cow_copies``: the (source, copy) blocks of partial hits whose
        copy the worker has not been handed yet (a snapshot of the Rust list)."""
        view = self.block_pool._view
        return [(view(s), view(d)) for s, d in self._m._group_pending_cow_copies(self.kv_cache_group_id, False)]

    def take_pending_cow_copies(self) -> list[tuple[Any, Any]]:
        """vLLM's ``take_pending_cow_copies()``: the pending (source, copy) block pairs,
        drained (the manager's ``take_kv_cache_block_copies`` then finds them gone)."""
        view = self._m.block_pool._view
        return [(view(s), view(d)) for s, d in self._m._group_pending_cow_copies(self.kv_cache_group_id, True)]

    @property
    def _pending_boundary_state_offloads(self) -> list[tuple[str, int, Any, int]]:
        """vLLM's ``_pending_boundary_state_offloads``: ``(request_id, group, block,
        boundary_tokens)`` not yet handed to a connector (a snapshot of the Rust list)."""
        view = self._m.block_pool._view
        return [(r, g, view(b), t) for r, g, b, t in self._m._group_pending_offloads(self.kv_cache_group_id, False)]

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, Any, int]]:
        """vLLM's ``take_pending_boundary_state_offloads()``: the hand-offs, drained."""
        view = self._m.block_pool._view
        return [(r, g, view(b), t) for r, g, b, t in self._m._group_pending_offloads(self.kv_cache_group_id, True)]

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, Any, int] | None:
        """vLLM's ``finalize_partial_tail_offload``: ``(group, block, boundary_tokens)`` of
        the request's producer tail when it finished exactly there (consumed), else None."""
        out = self._m._group_finalize_partial_tail_offload(
            self.kv_cache_group_id, request_id, num_computed_tokens, num_in_flight_tokens
        )
        return None if out is None else (out[0], self._m.block_pool._view(out[1]), out[2])

    def cache_blocks(
        self,
        request: Any,
        num_tokens: int,
        retention_interval: int | None = None,
        *,
        replay_boundaries: Sequence[int],
    ) -> None:
        """vLLM's per-group ``cache_blocks(request, num_tokens, retention_interval,
        replay_boundaries=...)``: caches this group's full blocks of ``request`` up to
        ``num_tokens`` tokens (and, for Mamba "align", its partial tail), in the Rust core."""
        self._m._group_cache_blocks(
            self.kv_cache_group_id, request, num_tokens, retention_interval, list(replay_boundaries)
        )

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return self._m._group_num_skipped_tokens(self.kv_cache_group_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Any],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self._m._group_get_num_blocks_to_allocate(
            self.kv_cache_group_id,
            request_id,
            num_tokens,
            _ids(new_computed_blocks),
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        view = self.block_pool._view  # the group's pool (HiSparse's source group: the host pool)
        return [
            view(b)
            for b in self._m._group_allocate_new_blocks(self.kv_cache_group_id, request_id, num_tokens, num_tokens_main_model)
        ]

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        self._m._group_remove_skipped_blocks(self.kv_cache_group_id, request_id, processed_computed_tokens, num_prompt_tokens)

    def free(self, request_id: str) -> None:
        self._m._group_free(self.kv_cache_group_id, request_id)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: Any,
        kv_cache_spec: Any,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[Any], ...], int]:
        """vLLM's per-type ``find_longest_cache_hit`` (a classmethod there), answered by the
        Rust manager of this group: the hit blocks per group id and the hit length in tokens.
        ``block_pool`` must be this manager's pool and ``kv_cache_spec`` its group's spec
        (ValueError otherwise); DCP / PCP sizes are the manager's own."""
        if block_pool is not None and block_pool is not self._m.block_pool:
            raise ValueError("find_longest_cache_hit: block_pool is not this manager's pool")
        if kv_cache_spec is not None and kv_cache_spec != self.kv_cache_spec:
            raise ValueError("find_longest_cache_hit: kv_cache_spec is not this group's spec")
        hashes = getattr(block_hashes, "block_hashes", block_hashes)
        groups, n = self._m._group_find_longest_cache_hit(
            self.kv_cache_group_id,
            list(hashes),
            max_length,
            list(kv_cache_group_ids),
            drop_eagle_block,
            alignment_tokens,
        )
        view = self._m.block_pool._view
        return tuple([view(b) for b in g] for g in groups), n

    def __repr__(self) -> str:
        return f"<kvblock {self.manager_cls.__name__} view of group {self.kv_cache_group_id}>"


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(manager_cls: Any) -> type:
    """The view class of groups whose vLLM manager class is ``manager_cls``: a subclass of
    :class:`SingleTypeManagerView` and of ``manager_cls`` itself, named as vLLM's, so that
    vLLM's ``isinstance(manager, CrossAttentionManager)`` (``MambaManager`` ...) lookups over
    ``coordinator.single_type_managers`` find it. The view's own state and methods come first;
    vLLM's methods the view does not define run over the view (its tables and pool are
    kvblock's)."""
    cls = _VIEW_CLASSES.get(manager_cls)
    if cls is None:
        from .hisparse import group_mixins

        bases = (SingleTypeManagerView, *group_mixins(manager_cls), manager_cls)
        cls = type(manager_cls.__name__, bases, {"__qualname__": manager_cls.__qualname__})
        _VIEW_CLASSES[manager_cls] = cls
    return cls


class _CoordinatorView:
    """The coordinator face of a kvblock manager."""

    def __init__(self, manager: Any, kv_cache_config: Any) -> None:
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

        info = manager._coordinator_info()
        self._m = manager
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = info["scheduler_block_size"]
        self.hash_block_size = info["hash_block_size"]
        self.num_reprefillable_tokens = info["num_reprefillable_tokens"]
        self.enable_partial_hash_hits = info["enable_partial_hash_hits"]
        self.full_attention_group_id = info["full_attention_group_id"]
        self.eagle_group_ids = set(info["eagle_group_ids"])
        self.drop_eagle_group_ids = set(info["drop_eagle_group_ids"])
        self.retention_interval = info["retention_interval"]
        groups = kv_cache_config.kv_cache_groups
        classes = [KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec, getattr(g, "role", None)) for g in groups]
        self.single_type_managers = tuple(
            _view_class(cls)(manager, i, gi, g.kv_cache_spec, cls)
            for i, (gi, g, cls) in enumerate(zip(info["groups"], groups, classes))
        )
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        self.attention_groups = [
            SpecGroup(groups[ids[0]].kv_cache_spec, list(ids), classes[ids[0]], eagle)
            for ids, eagle in info["attention_groups"]
        ]
        if len(groups) == 1:
            self.kv_cache_spec = groups[0].kv_cache_spec
            self.block_size = self.single_type_managers[0].block_size
            self.dcp_world_size = self.single_type_managers[0].dcp_world_size
            self.pcp_world_size = self.single_type_managers[0].pcp_world_size
        self.num_single_type_manager = len(groups)
        if any(getattr(m, "_hisparse_source", False) for m in self.single_type_managers):
            from .hisparse import bind

            bind(manager, self)

    @property
    def block_pool(self) -> Any:
        return self._m.block_pool

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

    def _views(self, groups: Sequence[Sequence[int]]) -> tuple[list[Any], ...]:
        view = self._m.block_pool._view
        return tuple([view(b) for b in g] for g in groups)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_cache_hit_length: int) -> tuple[tuple[list[Any], ...], int, int]:
        groups, n, uncached = self._m._find_longest_cache_hit(list(block_hashes), max_cache_hit_length)
        return self._views(groups), n, uncached

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[bytes], max_cache_hit_length: int) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        groups, lens = self._m._find_longest_cache_hit_per_group(list(block_hashes), max_cache_hit_length)
        return self._views(groups), tuple(lens)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[Any], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self._m._get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            [_ids(g) for g in new_computed_blocks],
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        )

    def get_blocks(self, request_id: str) -> tuple[list[Any], ...]:
        return self._views(self._m._block_ids(request_id))

    def free(self, request_id: str) -> None:
        self._m.free_request_id(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[Any]:
        from types import SimpleNamespace

        view = self._m.block_pool._view
        return [view(b) for b in self._m._pop_blocks_for_free(SimpleNamespace(request_id=request_id))]

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        self._m.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._m.cache_blocks(request, num_computed_tokens)

    def new_step_starts(self) -> None:
        self._m.new_step_starts()

    def reset_prefix_cache(self) -> bool:
        if self._m._hisparse_host_free_blocks is not None:
            from .hisparse import reset_prefix_cache

            return reset_prefix_cache(self._m)
        return self._m.block_pool.reset_prefix_cache()

    def emit_cached_block_events(self, request: Any, computed_blocks: tuple[Sequence[Any], ...]) -> None:
        for g, blocks in enumerate(computed_blocks):
            if blocks:
                spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
                self._m.block_pool.emit_cached_block_events(request, len(blocks), spec.block_size, g)

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        n = num_computed_tokens
        if not isinstance(self, _vkc.HybridKVCacheCoordinator):
            return max(0, n - self.num_reprefillable_tokens)

        def align(x: int) -> int:
            return x if self.enable_partial_hash_hits else x // self.scheduler_block_size * self.scheduler_block_size

        cached = align(n)
        m = self.single_type_managers[kv_cache_group_id]
        if m.use_eagle and cached > 0:
            finalized = max(0, n - self.num_reprefillable_tokens)
            return min(finalized, align(finalized) + m.block_size)
        return cached

    def __repr__(self) -> str:
        return f"<kvblock {type(self).__name__} over {len(self.single_type_managers)} group(s)>"


def _original(name: str) -> type:
    return original(_vkc, name)  # type: ignore[no-any-return]


class HybridCoordinatorView(_CoordinatorView, _original("HybridKVCacheCoordinator")):  # type: ignore[misc]
    """kvblock's hybrid coordinator (an instance of vLLM's ``HybridKVCacheCoordinator``)."""


class UnitaryCoordinatorView(_CoordinatorView, _original("UnitaryKVCacheCoordinator")):  # type: ignore[misc]
    """kvblock's one-group coordinator (an instance of vLLM's ``UnitaryKVCacheCoordinator``)."""


class NoPrefixCacheCoordinatorView(_CoordinatorView, _original("KVCacheCoordinatorNoPrefixCache")):  # type: ignore[misc]
    """kvblock's coordinator with caching off (an instance of vLLM's
    ``KVCacheCoordinatorNoPrefixCache``)."""


# They stand for vLLM's classes: report vLLM's names (as logs and type checks read them).
for _view, _name in (
    (HybridCoordinatorView, "HybridKVCacheCoordinator"),
    (UnitaryCoordinatorView, "UnitaryKVCacheCoordinator"),
    (NoPrefixCacheCoordinatorView, "KVCacheCoordinatorNoPrefixCache"),
):
    _view.__name__ = _view.__qualname__ = _name


def make_coordinator(manager: Any, kv_cache_config: Any) -> _CoordinatorView:
    kind = manager._coordinator_info()["kind"]
    cls = {"hybrid": HybridCoordinatorView, "unitary": UnitaryCoordinatorView}.get(kind, NoPrefixCacheCoordinatorView)
    return cls(manager, kv_cache_config)
