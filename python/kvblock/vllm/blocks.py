"""vLLM's ``KVCacheBlocks`` backed by block ids: the result type of
``kvblock.vllm.KVCacheManager``, a subclass of vLLM's own so vLLM code takes it as is.

The manager hands out one ``BlockIds`` per group (no Python object per block); ``blocks``
builds the pool's :class:`~kvblock.block_pool.KVCacheBlock` views on first use.
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm.v1.core import kv_cache_manager as _vkm

from ..manager import IdsBackedBlocks
from .originals import original

__all__ = ["KVCacheBlocks"]

#: vLLM's class (read before any patching: kvblock's subclass stands in for it).
_VllmKVCacheBlocks = original(_vkm, "KVCacheBlocks")


class KVCacheBlocks(IdsBackedBlocks, _VllmKVCacheBlocks):  # type: ignore[misc, valid-type]
    """vLLM 0.33.0's ``KVCacheBlocks`` (``blocks[g][j]``: block ``j`` of group ``g``), held as
    block ids until ``blocks`` is read (:class:`kvblock.manager.IdsBackedBlocks`: ``_from_ids``,
    ``blocks``, ``get_block_ids``); every other method is vLLM's own."""

    __slots__ = ("_ids", "_pool", "_blocks")

    def __init__(self, blocks: tuple[Sequence[Any], ...]) -> None:
        self._blocks = tuple(blocks)
        self._ids = None
        self._pool = None

    def _set_blocks(self, value: tuple[Sequence[Any], ...]) -> None:
        self._blocks = tuple(value)
        self._ids = None

    #: vLLM's ``blocks`` field is assignable: blocks set as objects drop the ids
    blocks = property(IdsBackedBlocks._views, _set_blocks, doc=IdsBackedBlocks.blocks.__doc__)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KVCacheBlocks(blocks={self.blocks!r})"
