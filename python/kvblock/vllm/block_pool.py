"""kvblock's :class:`~kvblock.block_pool.BlockPool` for vLLM: the same Rust pool and object
API, building vLLM's own KV event classes (``vllm.distributed.kv_events``), with the installed
release's surface (:mod:`kvblock.vllm.releases`): 0.34's ``free_blocks(evict_first=)``, public
event helpers and block-id ``BlockHashToBlockMap``."""

from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any, Iterable

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core import block_pool as _vbp

from ..block_pool import BlockHashToBlockMap as _BlockHashToBlockMap
from ..block_pool import BlockPool as _BlockPool
from ..block_pool import KVCacheBlock, PoolKeysView
from .metrics import bind, pool_finalized, unsupported_reason
from .originals import original
from .releases import current as _current_release

__all__ = ["BlockHashToBlockMap", "BlockPool", "IdsBlockHashToBlockMap"]

RELEASE = _current_release()

#: vLLM's own pool class (read before any patching: kvblock's stands in for it).
_VllmBlockPool = original(_vbp, "BlockPool")
_POOL_SIGNATURE = inspect.signature(_VllmBlockPool.__init__)


def _pool_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``BlockPool(...)`` call's arguments bound to the installed vLLM's own constructor,
    defaults applied, by name (``self`` left out). Raises TypeError as vLLM's would."""
    bound = _POOL_SIGNATURE.bind(None, *args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    del out[next(iter(out))]
    return out


def _untracked(obj: Any) -> Any:
    """vLLM 0.34 keeps its map's dict out of the cyclic GC (``gc_untrack``); the views that
    stand in for it hold no reference that could form a cycle (only a weak one to the pool)."""
    from vllm.utils.gc_utils import gc_untrack

    return gc_untrack(obj)


class _IdsCache(PoolKeysView):
    """vLLM 0.34's ``cached_block_hash_to_block._cache``: ``{BlockHashWithGroupId: block_id}``,
    one id per key (the earliest cached block of the key), a view of the Rust map. Popping a
    key takes it out of the map while its blocks keep their hash (as popping vLLM's dict
    does); assigning the popped id back restores every block the key held."""

    __slots__ = ("_pool_ref", "_detached")

    def __init__(self, pool: "BlockPool") -> None:
        self._pool_ref = weakref.ref(pool)
        self._detached: dict[bytes, list[int]] = {}

    @property
    def _pool(self) -> "BlockPool":
        pool = self._pool_ref()
        if pool is None:
            raise ReferenceError("the block pool of this map is gone")
        return pool

    def __getitem__(self, key: bytes) -> int:
        entry = self._pool.lookup_key_entry(key)
        if entry is None:
            raise KeyError(key)
        return entry[0][0]

    def __setitem__(self, key: bytes, block_id: int) -> None:
        block_id = operator.index(block_id)
        held = self._detached.get(key)
        ids = held if held and held[0] == block_id else [block_id]
        self._pool.map_reattach(key, ids)
        self._detached.pop(key, None)

    def __delitem__(self, key: bytes) -> None:
        ids = self._pool.map_detach(key)
        if not ids:
            raise KeyError(key)
        self._detached[key] = list(ids)

    def clear(self) -> None:
        super().clear()
        self._detached.clear()

    def __copy__(self) -> dict[bytes, int]:
        return {k: ids[0] for k, (ids, _multi) in self._pool.cached_entries().items()}

    copy = __copy__

    def __repr__(self) -> str:
        return repr(self.copy())


class IdsBlockHashToBlockMap(_BlockHashToBlockMap):
    """vLLM 0.34's ``BlockHashToBlockMap`` face of the pool's hash -> block map: ``_cache``
    holds one block id per key, ``_dup_ids`` the ids of keys cached by several blocks
    (``{key: {block_id: None}}``, in caching order), ``clear()`` empties the map in place."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool_ref = weakref.ref(pool)
        self._cache = _untracked(_IdsCache(pool))  # type: ignore[assignment]

    @property  # type: ignore[override]
    def _pool(self) -> "BlockPool":
        pool = self._pool_ref()
        if pool is None:
            raise ReferenceError("the block pool of this map is gone")
        return pool

    @_pool.setter
    def _pool(self, value: Any) -> None:
        self._pool_ref = weakref.ref(value)

    @property
    def _dup_ids(self) -> dict[bytes, dict[int, None]]:
        return {k: dict.fromkeys(ids) for k, (ids, _multi) in self._pool.cached_entries().items() if len(ids) > 1}

    def clear(self) -> None:
        self._cache.clear()


#: The installed release's ``BlockHashToBlockMap`` face: 0.34's block-id layout, or the
#: block-object layout of 0.32 / 0.33 (``kvblock.block_pool.BlockHashToBlockMap``).
BlockHashToBlockMap: type[_BlockHashToBlockMap] = (
    IdsBlockHashToBlockMap if RELEASE.block_hash_map_ids else _BlockHashToBlockMap
)


class BlockPool(_BlockPool):
    """vLLM 0.33.0's ``BlockPool`` (same constructor and methods) on kvblock's Rust pool;
    its KV events are vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. A
    ``metrics_collector`` (vLLM's ``KVCacheMetricsCollector``) gets its residency metrics
    from the Rust pool (:mod:`kvblock.vllm.metrics`); a collector kvblock cannot feed (a
    subclass overriding a hook, a non-number ``sample_rate``) is a ``TypeError``, nothing
    built."""

    event_classes = (BlockStored, BlockRemoved, AllBlocksCleared)
    #: vLLM's ``cache_full_blocks`` takes a block listed twice in one call (the later listing
    #: promotes the key the earlier one gave): so does this pool.
    _distinct_cached_blocks = False

    if RELEASE.block_hash_map_ids:

        @property  # type: ignore[override]
        def cached_block_hash_to_block(self) -> IdsBlockHashToBlockMap:
            """The pool's one ``BlockHashToBlockMap`` (0.34: the same object for the pool's
            life, cleared in place by ``reset_prefix_cache``)."""
            m = self.__dict__.get("_kvblock_hash_map")
            if m is None:
                m = self.__dict__["_kvblock_hash_map"] = IdsBlockHashToBlockMap(self)
            return m

    if RELEASE.free_evict_first:

        def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False) -> None:
            """vLLM 0.34's ``free_blocks``: drop one reference per block in the given order;
            blocks reaching 0 are queued, unhashed ones (and, with ``evict_first``, hashed
            ones too: blocks another tier already holds) to the head, the other hashed ones to
            the tail. The null block is skipped; blocks of another pool are freed into theirs
            with the same ``evict_first``. Raises ValueError, changing nothing, if a block
            holds fewer references than dropped."""
            own, others = self._split_own(ordered_blocks)
            self.free_ids(own, skip_null=True, evict_first=bool(evict_first))
            for pool, blocks in others:
                pool.free_blocks(blocks, evict_first=evict_first)

    if RELEASE.public_pool_helpers:

        def generate_event_extra_keys(self, request: Any, start: int, end: int, start_mm_idx: int) -> Any:
            """vLLM 0.34's public helper: the extra keys a ``BlockStored`` reports for tokens
            ``[start, end)`` (the hash's lookahead window included), and the next multimodal
            index."""
            from vllm.v1.core.kv_cache_utils import (
                generate_block_hash_extra_keys,
                generate_lookahead_block_hash_extra_keys,
            )

            ahead = self.num_hash_lookahead_tokens
            if ahead:
                return generate_lookahead_block_hash_extra_keys(request, start, end, end + ahead, start_mm_idx)
            return generate_block_hash_extra_keys(request, start, end, start_mm_idx)

        def get_lookahead_token_ids(self, request: Any, block_end: int) -> list[int]:
            """vLLM 0.34's public helper: the ``num_hash_lookahead_tokens`` token ids after
            ``block_end`` that the block's hash covers."""
            return request.all_token_ids[block_end : block_end + self.num_hash_lookahead_tokens]  # type: ignore[no-any-return]

    def __new__(cls, *args: Any, **kwargs: Any) -> "BlockPool":
        # the installed release's own constructor (0.32 has no num_hash_lookahead_tokens, so
        # its positions differ), with its defaults
        a = _pool_arguments(args, kwargs)
        num_gpu_blocks = a["num_gpu_blocks"]
        # vLLM asserts a positive int count; its callers get its AssertionError
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise AssertionError(f"num_gpu_blocks: must be a positive int, got {num_gpu_blocks!r}")
        return super().__new__(cls, **a)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        a = _pool_arguments(args, kwargs)
        collector = a.get("metrics_collector")
        if collector is not None:
            reason = unsupported_reason(collector)
            if reason is not None:
                raise TypeError(f"kvblock's block pool cannot record residency metrics: {reason}")
        super().__init__(**a)
        if collector is not None:
            bind(collector, self)

    def __del__(self) -> None:
        # residency metrics: the events recorded and not read yet stay the collector's
        if self.__dict__.get("metrics_collector") is not None:
            pool_finalized(self)

    @classmethod
    def _for_manager(cls, **kwargs: Any) -> "BlockPool":
        """The pool of a :class:`kvblock.vllm.KVCacheManager`, from kvblock's own parameters
        (``num_hash_lookahead_tokens`` included, on every release), by keyword."""
        n = kwargs["num_gpu_blocks"]
        if not isinstance(n, int) or n <= 0:
            raise AssertionError(f"num_gpu_blocks: must be a positive int, got {n!r}")
        pool = _BlockPool.__new__(cls, **kwargs)
        _BlockPool.__init__(pool, **kwargs)
        return pool  # type: ignore[return-value]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """vLLM's ``evict_blocks``: drop the cache keys of these blocks (ref counts and queue
        positions unchanged). As vLLM, an id past the pool is an ``AssertionError`` (a KV
        connector bug) and a negative one counts from the end (Python indexing of
        ``blocks``); unlike vLLM, nothing is evicted when one id is bad."""
        n = self.num_gpu_blocks
        ids = []
        for block_id in block_ids:
            i = operator.index(block_id)
            assert i < n, (
                f"Invalid block_id {i} >= {n}. This indicates a bug in the KV connector - workers "
                "should only report block IDs that were allocated by the scheduler."
            )
            if i < 0:
                if i < -n:
                    raise IndexError("list index out of range")
                i += n
            ids.append(i)
        self.evict_ids(ids)


# introspection sees the installed release's own constructor
BlockPool.__signature__ = inspect.signature(_VllmBlockPool)  # type: ignore[attr-defined]
