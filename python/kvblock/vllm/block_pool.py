"""kvblock's :class:`~kvblock.block_pool.BlockPool` for vLLM: the same Rust pool and object
API, building vLLM's own KV event classes (``vllm.distributed.kv_events``)."""

from __future__ import annotations

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from ..block_pool import BlockPool as _BlockPool

__all__ = ["BlockPool"]


class BlockPool(_BlockPool):
    """vLLM 0.33.0's ``BlockPool`` (same constructor and methods) on kvblock's Rust pool;
    its KV events are vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``."""

    event_classes = (BlockStored, BlockRemoved, AllBlocksCleared)
