"""vLLM's ``KVCacheBlocks`` backed by block ids: the result type of
``kvblock.vllm.KVCacheManager``, a subclass of vLLM's own so vLLM code takes it as is.

The manager hands out one ``BlockIds`` per group (no Python object per block); ``blocks``
builds the pool's :class:`~kvblock.block_pool.KVCacheBlock` views on first use.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm.v1.core import kv_cache_manager as _vkm

from .. import _core

__all__ = ["KVCacheBlocks"]

_BlockIds = _core.BlockIds

#: vLLM's class (read before any patching: kvblock's subclass stands in for it).
_VllmKVCacheBlocks = getattr(_vkm, "_kvblock_original_KVCacheBlocks", _vkm.KVCacheBlocks)


class KVCacheBlocks(_VllmKVCacheBlocks):  # type: ignore[misc, valid-type]
    """vLLM 0.33.0's ``KVCacheBlocks`` (``blocks[g][j]``: block ``j`` of group ``g``), held as
    block ids until ``blocks`` is read."""

    __slots__ = ("_ids", "_pool", "_blocks")

    def __init__(self, blocks: tuple[Sequence[Any], ...]) -> None:
        self._blocks = tuple(blocks)
        self._ids = None
        self._pool = None

    @classmethod
    def _from_ids(cls, pool: Any, ids: tuple[Sequence[int], ...]) -> "KVCacheBlocks":
        self = object.__new__(cls)
        self._ids = tuple(ids)
        self._pool = pool
        self._blocks = None
        return self

    @property  # type: ignore[override]
    def blocks(self) -> tuple[Sequence[Any], ...]:
        b = self._blocks
        if b is None:
            view = self._pool._view
            b = self._blocks = tuple([view(i) for i in group] for group in self._ids)
        return b

    @blocks.setter
    def blocks(self, value: tuple[Sequence[Any], ...]) -> None:
        self._blocks = tuple(value)
        self._ids = None

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None):  # type: ignore[override]
        # vLLM's scheduler calls get_block_ids(allow_none=True) on every running request's
        # new blocks every step, mostly the shared empty result: no generator, no per-group
        # isinstance (a generator expression cost twice vLLM's own method here)
        ids = self._ids
        if ids is None:
            return super().get_block_ids(allow_none, group_ids=group_ids)
        if group_ids is not None:
            ids = tuple([ids[g] for g in group_ids])
        if allow_none and not any(ids):  # every group empty (a group's truth is its length)
            return None
        if len(ids) == 1:
            g = ids[0]
            return (g.tolist() if type(g) is _BlockIds else list(g),)
        return tuple([g.tolist() if type(g) is _BlockIds else list(g) for g in ids])

    def __repr__(self) -> str:
        return f"KVCacheBlocks(blocks={self.blocks!r})"
