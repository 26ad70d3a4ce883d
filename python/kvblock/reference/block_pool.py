"""Reference block pool: vLLM 0.33.0's ``KVCacheBlock``, free queue, hash map and ``BlockPool``.

Plain Python, written for reading (spec §2-§4, §8):

* :class:`KVCacheBlock` is one KV-cache block: its id, reference count, primary cache key and
  the two pointers of the intrusive free list.
* :class:`FreeKVCacheBlockQueue` is the free list *and* the LRU eviction order: allocation
  pops the head; freed blocks without a hash are prepended (reused first), freed cached
  blocks are appended (evicted last).
* :class:`BlockHashToBlockMap` maps a ``BlockHashWithGroupId`` to one block, or to several
  blocks with the same content (duplicates are kept; the first inserted answers lookups).
* :class:`BlockPool` ties them together. Block 0 is the null block, a placeholder for
  skipped positions that is never allocated, counted, cached or freed. A cached block keeps
  its key while it sits in the free queue and loses it only when it is handed out again
  (lazy eviction) or explicitly evicted.

Every state-changing method validates its input before it changes anything: bad input raises
``ValueError`` or ``TypeError`` and leaves the pool as it was.
"""

from __future__ import annotations

import operator

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .retention import BlockRetention, LeveledFreeQueue
from ..events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from ..hashing import (
    block_hash_to_event_int,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)
from ..extra_keys import (
    generate_block_hash_extra_keys,
    get_mm_features_in_window,
    to_event_extra_keys,
)

__all__ = [
    "MEDIUM_GPU",
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
]

logger = logging.getLogger(__name__)

#: The ``medium`` of every event this pool emits.
MEDIUM_GPU = "GPU"


@dataclass(slots=True)
class KVCacheBlock:
    """One KV-cache block (vLLM's ``KVCacheBlock``, a slotted dataclass).

    Attributes:
        block_id: index of the block in its pool, ``0 .. num_blocks - 1``.
        ref_cnt: number of request block tables holding the block; 0 means it is free
            (in the free queue, possibly still cached).
        prev_free_block, next_free_block: free-list links; both ``None`` when the block is
            not in the free queue.
        is_null: True only for the pool's null block (block 0).

    The primary cache key (``BlockHashWithGroupId`` bytes, or None) is stored in
    ``_block_hash`` and read through :attr:`block_hash`.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: bytes | None = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> bytes | None:
        """The block's cache key (block hash + 4-byte group id), or None if not cached."""
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """The prefix length (tokens) the block's key covers, or None."""
        return self._block_hash_num_tokens

    @block_hash.setter
    def block_hash(self, block_hash: bytes) -> None:
        """Set the cache key of an uncached block.

        Raises:
            ValueError: the block already has a key (vLLM asserts the same); call
                :meth:`reset_hash` first.
        """
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a block hash")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the block's cache key (used on eviction and on prefix-cache reset)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        # The free-list neighbours are shown by id: printing them in full would walk the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self._block_hash!r}, prev_free_block={prev_id}, "
            f"next_free_block={next_id}, is_null={self.is_null})"
        )


def _is_linked(block: KVCacheBlock) -> bool:
    return block.prev_free_block is not None or block.next_free_block is not None


def _check_count(name: str, n: Any) -> None:
    """A count argument or request field, read as kvblock's Rust core reads them: a bool or
    a non-int (no ``__index__``) is a TypeError, an int outside int64 or a negative one a
    ValueError, each naming ``name``."""
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"{name}: expected int, got {type(n).__name__}")
    n = operator.index(n)
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"{name}: {n} is out of range (must fit in a signed 64-bit integer)")
    if n < 0:
        raise ValueError(f"{name}: must be >= 0, got {n}")


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    Mirrors vLLM's ``FreeKVCacheBlockQueue``: two sentinel blocks (id -1) bound the list so
    every operation is O(1) per block without branches for the ends. The head is the next
    block to allocate (and to evict if it is cached). Initial order is the given order.

    Args:
        blocks: the blocks that start out free, head first.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self._link_chain(self.fake_free_list_head, blocks, self.fake_free_list_tail)

    @staticmethod
    def _link_chain(before: KVCacheBlock, blocks: Sequence[KVCacheBlock], after: KVCacheBlock) -> None:
        prev = before
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev

    @staticmethod
    def _unlink(block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt  # type: ignore[union-attr]
        nxt.prev_free_block = prev  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None

    def _check_unlinked(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if _is_linked(block):
                raise ValueError(f"block {block.block_id} is already in the free queue")
        if len({id(block) for block in blocks}) != len(blocks):
            raise ValueError("the same block is given twice")

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            ValueError: ``"No free blocks available"`` when the queue is empty.
            RuntimeError: the head block has no successor link (a corrupted list).
        """
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("No free blocks available")
        if block.next_free_block is None:
            raise RuntimeError("Invalid block found in popleft(): it has no next_free_block")
        self._unlink(block)
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first (``[]`` for ``n == 0``).

        Raises:
            TypeError: ``n`` is not an int.
            ValueError: ``n < 0`` or ``n > num_free_blocks`` (vLLM asserts); the queue is
                unchanged.
        """
        _check_count("n", n)
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            block = block.next_free_block
        self.fake_free_list_head.next_free_block = block
        assert block is not None
        block.prev_free_block = self.fake_free_list_head
        for popped in out:
            popped.prev_free_block = popped.next_free_block = None
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (O(1)).

        Raises:
            RuntimeError: the block is not in the queue.
        """
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not in the free queue: {block}")
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (evicted last).

        Raises:
            ValueError: the block is already in the queue.
        """
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the tail, in list order (the last one becomes the tail).

        Raises:
            ValueError: a block is already in the queue or given twice; nothing is linked.
        """
        if not blocks:
            return
        self._check_unlinked(blocks)
        tail = self.fake_free_list_tail
        self._link_chain(tail.prev_free_block, blocks, tail)  # type: ignore[arg-type]
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks`` at the head, in list order (the first one becomes the head).

        Raises:
            ValueError: a block is already in the queue or given twice; nothing is linked.
        """
        if not blocks:
            return
        self._check_unlinked(blocks)
        head = self.fake_free_list_head
        self._link_chain(head, blocks, head.next_free_block)  # type: ignore[arg-type]
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to allocate / evict) first."""
        out: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockHashToBlockMap:
    """``BlockHashWithGroupId -> block(s)``: the prefix cache's lookup table (spec §2).

    A key usually maps to one block, stored bare. When a second block with the same key is
    cached (two requests computed the same block independently), the value becomes an inner
    ``{block_id: block}`` dict; lookups return its first-inserted block. Duplicates are never
    merged, so block ids handed to requests never change.
    """

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """A block cached under ``key`` (the first inserted one), or None."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        """Cache ``block`` under ``key``, next to any other blocks already there."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from ``key``; return it, or None if it is not there.

        Other blocks under the same key stay cached.
        """
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether block ``block_id`` is cached under ``key``."""
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if isinstance(blocks, KVCacheBlock):
            return blocks.block_id == block_id
        return block_id in blocks

    def items(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """Every ``(key, block)`` pair; a key with several blocks yields one pair per block."""
        for key, blocks in self._cache.items():
            if isinstance(blocks, KVCacheBlock):
                yield key, blocks
            else:
                for block in blocks.values():
                    yield key, block

    def __len__(self) -> int:
        """The number of keys (not blocks)."""
        return len(self._cache)


class BlockPool:
    """All KV-cache blocks of one device, their free queue and the prefix cache (spec §4).

    Args:
        num_gpu_blocks: number of blocks including the null block (>= 1).
        enable_caching: whether full blocks are cached and evicted lazily.
        hash_block_size: tokens per entry of ``request.block_hashes`` (> 0).
        enable_kv_cache_events: whether cache changes are queued as KV events
            (:meth:`take_events`).
        priority_retention: free cached blocks wait by retention priority
            (:mod:`kvblock.reference.retention`); off: vLLM's single LRU queue.
        default_retention_priority, decay_granularity_s: see
            :class:`kvblock.reference.retention.BlockRetention`.

    Every block has a generation, bumped when it is handed out anew or loses its keys to
    ``evict_blocks`` (stale-hit detection).

    Block 0 becomes the null block, so a fresh free queue is ``[1, 2, ..., num_gpu_blocks-1]``.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        *,
        priority_retention: bool = False,
        default_retention_priority: int = 35,
        decay_granularity_s: float = 1.0,
    ) -> None:
        _check_count("num_gpu_blocks", num_gpu_blocks)
        if num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks: must be >= 1 (block 0 is the null block)")
        _check_count("hash_block_size", hash_block_size)
        if hash_block_size < 1:
            raise ValueError("hash_block_size: must be > 0")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.retention: BlockRetention | None = None
        self.free_block_queue: Any
        if priority_retention:
            self.retention = BlockRetention(default_retention_priority, decay_granularity_s)
            self.free_block_queue = LeveledFreeQueue(self.blocks, KVCacheBlock(block_id=-1))
        else:
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.generation = [0] * num_gpu_blocks
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- validation ------------------------------------------------------------------------
    def _check_own(self, block: Any) -> None:
        if not isinstance(block, KVCacheBlock):
            raise TypeError(f"expected a KVCacheBlock, got {type(block).__name__}")
        block_id = block.block_id
        if not 0 <= block_id < self.num_gpu_blocks or self.blocks[block_id] is not block:
            raise ValueError(f"block {block_id} does not belong to this pool")

    # -- lookup and caching ----------------------------------------------------------------
    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses.

        Args:
            block_hash: a block hash (digest bytes, without group id).
            kv_cache_group_ids: the groups to look up, in order.
        """
        cached: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, group_id)
            )
            if block is None:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes.

        Block ``i`` gets the key ``(hash of block i, kv_cache_group_id)``, where the hashes are
        ``request.block_hashes`` viewed at ``block_size`` (spec §1.9); null blocks are skipped.
        With events on, one ``BlockStored`` covers the whole range: parent = hash of block
        ``num_cached_blocks - 1`` (None for 0), ``token_ids`` = the range's tokens, one
        untagged ``extra_keys`` entry per cached block (an empty ``BlockStored`` when every
        block of the range is null, as vLLM 0.33.0 emits). Nothing happens when
        ``num_cached_blocks >= num_full_blocks``.

        Raises:
            ValueError: negative counts, or a range past ``blocks`` or past the request's
                hashes; nothing is changed.
            AssertionError: a block of the range already has a key covering as many tokens
                (vLLM 0.33.0 asserts that only a partial entry is re-keyed); nothing is
                changed.
        """
        _check_count("num_cached_blocks", num_cached_blocks)
        _check_count("num_full_blocks", num_full_blocks)
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise ValueError(
                f"num_full_blocks ({num_full_blocks}) exceeds the request's blocks ({len(blocks)}) "
                f"or block hashes ({len(block_hashes)})"
            )
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        # vLLM 0.33.0 asserts that a block already keyed is a partial entry being promoted
        # to the full block (a shorter prefix); checked before anything changes
        for i, block in enumerate(new_full_blocks, start=num_cached_blocks):
            if block.is_null or block.block_hash is None:
                continue
            covered = block.block_hash_num_tokens
            if covered is None or covered >= (i + 1) * block_size:
                raise AssertionError(
                    f"block {block.block_id} already holds a key covering {covered} tokens; "
                    f"cannot cache it for {(i + 1) * block_size}"
                )

        events = self.enable_kv_cache_events
        stored_hashes: list[int] = []
        for i, block in enumerate(new_full_blocks, start=num_cached_blocks):
            if block.is_null:
                continue
            key = make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id)
            self._maybe_evict_cached_block(block)
            block.block_hash = key
            block._block_hash_num_tokens = (i + 1) * block_size
            self.cached_block_hash_to_block.insert(key, block)
            if events:
                stored_hashes.append(block_hash_to_event_int(block_hashes[i]))

        if events:
            parent = (
                block_hash_to_event_int(block_hashes[num_cached_blocks - 1])
                if num_cached_blocks > 0
                else None
            )
            cached_indices = [
                i for i in range(num_cached_blocks, num_full_blocks) if not blocks[i].is_null
            ]
            self.kv_event_queue.append(
                self._block_stored_event(
                    request, stored_hashes, parent, num_cached_blocks, num_full_blocks,
                    cached_indices, block_size, kv_cache_group_id,
                )
            )

    def emit_cached_block_events(
        self, request: Any, num_cached_blocks: int, block_size: int, kv_cache_group_id: int
    ) -> None:
        """Queue one ``BlockStored`` for the first ``num_cached_blocks`` blocks of a prefix hit.

        Used when ``request.kv_cache_report_mode == "full"``: the parent is None and the tokens
        start at position 0. Changes no block state; does nothing if events are off or
        ``num_cached_blocks == 0``.
        """
        if not self.enable_kv_cache_events or num_cached_blocks <= 0:
            return
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        hashes = [block_hash_to_event_int(block_hashes[i]) for i in range(num_cached_blocks)]
        self.kv_event_queue.append(
            self._block_stored_event(
                request, hashes, None, 0, num_cached_blocks,
                range(num_cached_blocks), block_size, kv_cache_group_id,
            )
        )

    @staticmethod
    def _block_stored_event(
        request: Any,
        block_hashes: list[int],
        parent_block_hash: int | None,
        first_block: int,
        end_block: int,
        cached_indices: Iterable[int],
        block_size: int,
        kv_cache_group_id: int,
    ) -> BlockStored:
        """A ``BlockStored`` for blocks ``[first_block, end_block)`` of ``request``.

        ``extra_keys`` holds one untagged entry per index of ``cached_indices``; the
        multimodal scan index is carried from block to block as the request hasher does.
        """
        indices = list(cached_indices)
        extra_keys: list[tuple | None] = []
        first_start = indices[0] * block_size if indices else 0
        mm_idx = get_mm_features_in_window(request.mm_features, first_start, first_start + block_size)
        for i in indices:
            start = i * block_size
            keys, mm_idx = generate_block_hash_extra_keys(request, start, start + block_size, mm_idx)
            extra_keys.append(to_event_extra_keys(keys))
        lora = request.lora_request
        return BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=request.all_token_ids[first_block * block_size : end_block * block_size],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.lora_name if lora else None,
            extra_keys=extra_keys or None,
            group_idx=kv_cache_group_id,
        )

    # -- allocation, reference counts, eviction -------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt = 1``.

        With caching on, a popped block that is still cached loses its key(s) now (lazy
        eviction), emitting one ``BlockRemoved`` per removed key.

        Raises:
            TypeError: ``num_blocks`` is not an int.
            ValueError: ``num_blocks < 0``, or ``"Cannot get {n} free blocks from the pool"``
                when fewer are free; nothing is changed.
        """
        _check_count("num_blocks", num_blocks)
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            self.generation[block.block_id] += 1
            if self.retention is not None:
                self.retention.reset(block.block_id)
        return blocks

    # -- retention (off unless priority_retention) -------------------------------------------
    def set_time(self, now_s: float) -> None:
        """Read the clock: free blocks whose priority ran out join the default level's tail."""
        r = self.retention
        if r is None:
            return
        level = 1 + r.default
        queue = self.free_block_queue
        for b in r.advance(now_s):
            block = self.blocks[b]
            if b in queue.level_of:
                queue.remove(block)
                queue.append_at(block, level)

    def assign_retention(self, block: KVCacheBlock, priority: int, duration_s: float | None) -> None:
        """A holder of ``block`` asks for ``priority`` for ``duration_s`` after release."""
        if self.retention is not None and not block.is_null and block.ref_cnt > 0:
            self.retention.assign(block.block_id, priority, duration_s)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s key from the map and reset its hash; True if a key was removed."""
        key = block.block_hash
        if key is None:
            return False
        block.reset_hash()
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[block_hash_to_event_int(get_block_hash(key))],
                    medium=MEDIUM_GPU,
                    group_idx=get_group_id(key),
                )
            )
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); the null block is skipped.

        A block with ``ref_cnt == 0`` is an eviction candidate in the free queue: touching it
        removes it from the queue, which also refreshes its recency for when it is freed.

        Raises:
            TypeError / ValueError: an object that is not a block of this pool, or a free
                block that is not in the queue; nothing is changed.
        """
        blocks = list(blocks)
        for block in blocks:
            self._check_own(block)
            if not block.is_null and block.ref_cnt == 0 and not _is_linked(block):
                raise ValueError(f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
                if self.retention is not None:
                    self.retention.unlink_bucket(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks reaching 0 return to the free queue.

        Blocks are processed in the given order (callers pass a request's table reversed).
        Blocks that reach ``ref_cnt == 0`` and have no hash (or caching is off) are
        *prepended* to the head - reused first -, cached ones *appended* to the tail - evicted
        last -; each group keeps the given order. The null block is skipped.

        Raises:
            TypeError / ValueError: an object that is not a block of this pool, or a block
                that is already free (a double free) or listed more often than it is
                referenced; nothing is changed.
        """
        listed = list(ordered_blocks)
        for block in listed:
            self._check_own(block)
        blocks = [block for block in listed if not block.is_null]
        counts = Counter(block.block_id for block in blocks)
        for block_id, count in counts.items():
            held = self.blocks[block_id].ref_cnt
            if held == 0:
                raise ValueError(f"block_ids: block {block_id} is already free (ref_cnt 0): double free")
            if held < count:
                raise ValueError(
                    f"block_ids: block {block_id} is listed {count} times in this call but holds "
                    f"{held} reference{'' if held == 1 else 's'}"
                )
        caching = self.enable_caching
        without_hash: list[KVCacheBlock] = []
        with_hash: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block.block_hash is not None:
                    with_hash.append(block)
                else:
                    without_hash.append(block)
        self.free_block_queue.prepend_n(without_hash)
        if self.retention is None:
            self.free_block_queue.append_n(with_hash)
        else:
            for block in with_hash:
                self.free_block_queue.append_at(block, self.retention.release_level(block.block_id))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the given blocks from the prefix cache (their keys; events emitted).

        Reference counts and free-queue positions are unchanged; uncached ids are ignored.

        Raises:
            TypeError / ValueError: a non-int id or one outside ``[0, num_gpu_blocks)``;
                nothing is changed.
        """
        ids = list(block_ids)
        for block_id in ids:
            _check_count("block_id", block_id)
            if block_id >= self.num_gpu_blocks:
                raise ValueError(f"Invalid block_id {block_id} >= {self.num_gpu_blocks}")
        for block_id in ids:
            if self._maybe_evict_cached_block(self.blocks[block_id]):
                self.generation[block_id] += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, if no block is in use.

        Returns False (with a warning, nothing changed) while any non-null block is
        referenced. Otherwise clears the map and every block's hash, queues
        ``AllBlocksCleared`` and returns True; the free-queue order is kept.
        """
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- accounting and events ---------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue, including cached blocks that are eviction candidates."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks in use, ``1 - free / (num_gpu_blocks - 1)``."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        """Return the queued KV events, oldest first, and clear the queue (``[]`` if off)."""
        if not self.enable_kv_cache_events:
            return []
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events
