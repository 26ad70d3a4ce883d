"""kvblock's :class:`~kvblock.block_pool.BlockPool` for vLLM: the same Rust pool and object
API, building vLLM's own KV event classes (``vllm.distributed.kv_events``)."""

from __future__ import annotations

import operator
from typing import Any, Iterable

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from ..block_pool import BlockPool as _BlockPool

__all__ = ["BlockPool"]


class BlockPool(_BlockPool):
    """vLLM 0.33.0's ``BlockPool`` (same constructor and methods) on kvblock's Rust pool;
    its KV events are vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``."""

    event_classes = (BlockStored, BlockRemoved, AllBlocksCleared)

    def __new__(cls, num_gpu_blocks: int, *args: Any, **kwargs: Any) -> "BlockPool":
        # vLLM 0.33.0 asserts a positive int count; its callers get its AssertionError
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise AssertionError(f"num_gpu_blocks: must be a positive int, got {num_gpu_blocks!r}")
        return super().__new__(cls, num_gpu_blocks, *args, **kwargs)

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
