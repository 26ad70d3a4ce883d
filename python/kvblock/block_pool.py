"""vLLM-compatible ``BlockPool`` over the Rust pool (spec §2–§4).

:class:`BlockPool` *is* the Rust pool (it subclasses ``kvblock._core.BlockPoolCore``), with two
faces: vLLM 0.33.0's methods taking and returning :class:`KVCacheBlock` objects, so code written
against ``vllm.v1.core.block_pool.BlockPool`` runs unchanged, and the fast id API of the core
(``allocate_ids``, ``free_ids``, ``touch_ids``, ``cache_ids``, ``lookup_prefix``, ...), one call
per request-level action with ints or numpy arrays. Block ids and free-queue order are
identical to vLLM 0.33.0's.

A :class:`KVCacheBlock` is a view (block id + pool), one object per block: reading
``ref_cnt`` or ``block_hash`` asks the pool, so there is no per-block Python state to keep in
sync. The pool's ``free_block_queue``, ``cached_block_hash_to_block`` (and its ``_cache``
dict), ``cached_block_hashes_by_block`` and ``kv_event_queue`` are views of the Rust state
with vLLM's shapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any

import kvblock._core as _core
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, block_removed, block_stored_for_request

#: The ``medium`` of events from a host pool that shares this pool's queue (vLLM's
#: ``MEDIUM_CPU``: HiSparse's host tier, ``SharedEventQueueBlockPool``).
HOST_MEDIUM = "CPU"


__all__ = ["BlockHashToBlockMap", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """A block of the pool, as vLLM's ``KVCacheBlock`` shows it: ``block_id``, ``ref_cnt``,
    ``block_hash`` (``BlockHashWithGroupId`` bytes or None), ``block_hash_num_tokens``,
    ``prev_free_block`` / ``next_free_block`` (free-queue neighbours), ``is_null``, ``pool``.

    A view: every field is read from (and ``ref_cnt`` / ``set_block_hash`` / ``reset_hash``
    written to) the Rust pool. The pool keeps one view per block, so ``is`` and ``==`` agree.
    """

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: "BlockPool", block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def pool(self) -> "BlockPool":
        """The :class:`BlockPool` this block belongs to."""
        return self._pool

    @property
    def ref_cnt(self) -> int:
        """Requests (and pins) holding the block (``int`` >= 0; 0: free, or the null block).

        Settable, as vLLM code sets it to retain both ends of a copy-on-write copy (``ValueError``
        for a negative count).
        """
        return self._pool.ref_cnt(self.block_id)

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        # vLLM code writes it to retain both ends of a copy-on-write copy
        self._pool.set_ref_cnt(self.block_id, value)

    @property
    def block_hash(self) -> bytes | None:
        """The block's cache key: ``BlockHashWithGroupId`` bytes (the block hash, 32 bytes for
        sha256 or 16 for xxhash, then the 4-byte group id), or None when it is not cached.
        """
        return self._pool.block_hash(self.block_id)

    _block_hash = block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Tokens of the request the key covers (``int``: a full block ends there; fewer for a
        partial block's key), or None without a key.
        """
        return self._pool.block_hash_num_tokens(self.block_id)

    _block_hash_num_tokens = block_hash_num_tokens

    def set_block_hash(self, block_hash: bytes, num_tokens: int | None = None) -> None:
        """Give the block a key (not in the map until inserted); AssertionError if it has one.
        The null block takes one too, as vLLM's does (its tests key blocks by hand)."""
        self._pool.set_block_hash(self.block_id, block_hash, num_tokens)

    def reset_hash(self) -> None:
        """Forget the block's key."""
        self._pool.reset_hash(self.block_id)

    @property
    def is_null(self) -> bool:
        """True for block 0, the null block (never allocated, cached or freed)."""
        return self.block_id == 0

    @property
    def prev_free_block(self) -> "KVCacheBlock | _QueueEnd | None":
        """The block before this one in the free queue (the queue's head end when it is first),
        or None when the block is not in the free queue.
        """
        prev, _, linked = self._pool.queue_neighbours(self.block_id)
        if not linked:
            return None
        return self._pool._view(prev) if prev is not None else self._pool._queue_head

    @property
    def next_free_block(self) -> "KVCacheBlock | _QueueEnd | None":
        """The block after this one in the free queue (the queue's tail end when it is last), or
        None when the block is not in the free queue.
        """
        _, nxt, linked = self._pool.queue_neighbours(self.block_id)
        if not linked:
            return None
        return self._pool._view(nxt) if nxt is not None else self._pool._queue_tail

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlock) and other._pool is self._pool and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self._pool), self.block_id))

    def __repr__(self) -> str:
        prev = self.prev_free_block
        nxt = self.next_free_block
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self.block_hash!r}, _block_hash_num_tokens={self.block_hash_num_tokens}, "
            f"prev_free_block={getattr(prev, 'block_id', None)}, next_free_block={getattr(nxt, 'block_id', None)})"
        )


class _QueueEnd:
    """A sentinel of the free queue (vLLM's ``fake_free_list_head`` / ``_tail``, block id -1)."""

    __slots__ = ("_pool", "_head")
    block_id = -1
    ref_cnt = 0
    block_hash = None
    is_null = False

    def __init__(self, pool: "BlockPool", head: bool) -> None:
        self._pool = pool
        self._head = head

    @property
    def next_free_block(self) -> "KVCacheBlock | _QueueEnd | None":
        if not self._head:
            return None
        first, _ = self._pool.queue_ends()
        return self._pool._view(first) if first is not None else self._pool._queue_tail

    @property
    def prev_free_block(self) -> "KVCacheBlock | _QueueEnd | None":
        if self._head:
            return None
        _, last = self._pool.queue_ends()
        return self._pool._view(last) if last is not None else self._pool._queue_head

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id=-1, {'head' if self._head else 'tail'} sentinel)"


def _ids(blocks: Iterable[Any]) -> list[int]:
    return [b if isinstance(b, int) else b.block_id for b in blocks]


def _own_ids(pool: "BlockPool", blocks: Iterable[Any], arg: str) -> list[int]:
    """Ids of blocks that must be views of ``pool`` (or plain ids)."""
    out = []
    for b in blocks:
        if isinstance(b, int):
            out.append(b)
        elif isinstance(b, KVCacheBlock) and b._pool is pool:
            out.append(b.block_id)
        else:
            raise TypeError(
                f"{arg}: {b!r} is not a block of this pool (kvblock's blocks are views of their pool's "
                "state; use the pool's blocks)"
            )
    return out


class FreeKVCacheBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` face of the pool's free queue (head = next to
    allocate). ``popleft``/``remove``/``append`` change the queue only, without reference
    counting, exactly as vLLM's queue does."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (``int``; the null block is never in it)."""
        return self._pool.get_num_free_blocks()

    @property
    def fake_free_list_head(self) -> _QueueEnd:
        """The queue's head sentinel (vLLM's ``fake_free_list_head``): its ``next_free_block`` is
        the next block to allocate.
        """
        return self._pool._queue_head

    @property
    def fake_free_list_tail(self) -> _QueueEnd:
        """The queue's tail sentinel: its ``prev_free_block`` is the block freed last."""
        return self._pool._queue_tail

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in queue order, head (next to allocate) first."""
        return [self._pool._view(b) for b in self._pool.free_queue_ids()]

    def iter_blocks_after(self, cursor: KVCacheBlock | None = None) -> Iterator[KVCacheBlock]:
        """The free blocks after ``cursor`` (from the head if None)."""
        ids = self._pool.free_queue_ids()
        start = 0 if cursor is None else ids.index(cursor.block_id) + 1
        for b in ids[start:]:
            yield self._pool._view(b)

    def popleft(self) -> KVCacheBlock:
        """Pop the head. Raises ``ValueError("No free blocks available")`` when empty."""
        if self._pool.get_num_free_blocks() == 0:
            raise ValueError("No free blocks available")
        return self._pool._view(self._pool._queue_popleft_n(1)[0])

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head; raises ValueError, changing nothing, if fewer are free."""
        return [self._pool._view(b) for b in self._pool._queue_popleft_n(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the free queue (no reference count changes), as vLLM's queue
        does when a cached block gets a hit. Raises ``RuntimeError`` if it is not in the queue.
        """
        self._pool._queue_remove(block.block_id)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the queue's tail (evicted last); no reference count changes. Raises
        ``RuntimeError`` for a block already in the queue or the null block.
        """
        self._pool._queue_insert([block.block_id], False)

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail in order (the last evicted last); no reference count
        changes. Raises ``RuntimeError`` for a block already in the queue or the null block.
        """
        self._pool._queue_insert(_ids(blocks), False)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head in order (``blocks[0]`` allocated first); errors as
        :meth:`append_n`.
        """
        self._pool._queue_insert(_ids(blocks), True)


def _entry(pool: "BlockPool", ids: list[int], multi: bool) -> "KVCacheBlock | dict[int, KVCacheBlock]":
    """A key's value as vLLM's map stores it: the block alone, or ``{block_id: block}`` once
    the key has held two blocks."""
    if not multi:
        return pool._view(ids[0])
    return {b: pool._view(b) for b in ids}


def _entry_ids(value: Any) -> list[int]:
    if isinstance(value, dict):
        return [b.block_id if not isinstance(b, int) else b for b in value.values()]
    return [value.block_id]


class PoolKeysView(MutableMapping):  # type: ignore[type-arg]
    """The keys of a pool's Rust hash map as a mapping: the part shared by the views that
    stand in for vLLM's ``cached_block_hash_to_block._cache`` (this module's
    ``_CacheDict``, ``kvblock.vllm.block_pool``'s ``_IdsCache`` for vLLM 0.34). A subclass
    gives ``_pool`` and the value side (``__getitem__``, ``__setitem__``, ``__delitem__``)."""

    __slots__ = ()
    _pool: Any

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._pool.cached_items()))

    def __len__(self) -> int:
        return self._pool.num_cached_keys()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and bool(self._pool.lookup_key_all(key))

    def clear(self) -> None:
        self._pool.map_detach_all()


class _CacheDict(PoolKeysView):
    """``cached_block_hash_to_block._cache``: the map as vLLM's dict of
    ``{BlockHashWithGroupId: block | {block_id: block}}``. Popping a key takes it out of the
    map while its blocks keep their hash (as popping vLLM's dict does); assigning the popped
    value back restores it."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    def __getitem__(self, key: bytes) -> Any:
        entry = self._pool.lookup_key_entry(key)
        if entry is None:
            raise KeyError(key)
        return _entry(self._pool, *entry)

    def __setitem__(self, key: bytes, value: Any) -> None:
        self._pool.map_reattach(key, _entry_ids(value))

    def __delitem__(self, key: bytes) -> None:
        if not self._pool.map_detach(key):
            raise KeyError(key)

    def __copy__(self) -> dict:
        return {k: _entry(self._pool, ids, multi) for k, (ids, multi) in self._pool.cached_entries().items()}

    copy = __copy__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _CacheDict):
            other = other.copy()
        return isinstance(other, dict) and self.copy() == other

    def __repr__(self) -> str:
        return repr(self.copy())


class BlockHashToBlockMap:
    """vLLM's ``BlockHashToBlockMap`` face of the pool's hash -> block map."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool
        self._cache = _CacheDict(pool)

    def __len__(self) -> int:
        return self._pool.num_cached_keys()

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        """The first block cached under ``key``, or None."""
        b = self._pool.lookup_key(key)
        return None if b is None else self._pool._view(b)

    def contain(self, key: bytes, block_id: int) -> bool:
        """True if block ``block_id`` is cached under ``key`` (``BlockHashWithGroupId`` bytes)."""
        return block_id in self._pool.lookup_key_all(key)

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        """Cache ``block`` under ``key`` (``BlockHashWithGroupId`` bytes), beside any block
        already there (vLLM keeps duplicates). The null block is taken, as by vLLM's map.
        """
        self._pool.map_insert(key, block.block_id)

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Take ``block_id`` off ``key``; the block, or None if it was not there."""
        return self._pool._view(block_id) if self._pool.map_pop(key, block_id) else None

    def items(self) -> list[tuple[bytes, list[int]]]:
        """``[(key, [block_id, ...])]``: every cache key and the blocks under it."""
        return list(self._pool.cached_items().items())

    def __contains__(self, key: bytes) -> bool:
        return self._pool.lookup_key(key) is not None


class _SecondaryKeys(MutableMapping):
    """``cached_block_hashes_by_block``: ``{block_id: {keys}}`` of the blocks' further keys."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    def __getitem__(self, block_id: int) -> set[bytes]:
        keys = self._pool.secondary_keys(block_id) if 0 <= block_id < self._pool.num_gpu_blocks else []
        if not keys:
            raise KeyError(block_id)
        return set(keys)

    def __setitem__(self, block_id: int, keys: Any) -> None:
        raise TypeError("cached_block_hashes_by_block is a view of the pool; use cache_partial_block")

    def __delitem__(self, block_id: int) -> None:
        raise TypeError("cached_block_hashes_by_block is a view of the pool; use _maybe_evict_cached_block")

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._pool.secondary_items()))

    def __len__(self) -> int:
        return len(self._pool.secondary_items())

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == other

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class _EventQueue(list):
    """``kv_event_queue``: the pool's buffered events as a list (vLLM code may append)."""


class _Blocks(Sequence[KVCacheBlock]):
    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._pool._view(b) for b in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block id out of range")
        return self._pool._view(i)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        view = self._pool._view
        return (view(i) for i in range(len(self)))


class BlockPool(_core.BlockPoolCore):
    """The block pool (vLLM 0.33.0 ``BlockPool``), in Rust.

    Args:
        num_gpu_blocks: total blocks (> 0); block 0 becomes the null block.
        enable_caching: keep freed full blocks cached (prefix caching).
        hash_block_size: tokens per hashed block (> 0).
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` for :meth:`take_events`.
        metrics_collector: vLLM's ``KVCacheMetricsCollector`` (kept, and reset by a successful
            :meth:`reset_prefix_cache`; :class:`kvblock.vllm.BlockPool` has the Rust pool record
            its residency metrics).
        num_hash_lookahead_tokens: tokens after each block its hash covers (events report
            them as ``lookahead_token_ids``).
        medium: the ``medium`` field of events (``"GPU"``).

    Per block the pool keeps 32 bytes (ref count, key slot, key token count, reuse
    generation, two free-queue links, two key-list links); building it is O(num_gpu_blocks) in Rust with no Python
    object per block. The id API (``cache_ids``) knows no request: its ``BlockStored`` events
    carry the hashes but empty ``token_ids``.

    Raises:
        ValueError: ``num_gpu_blocks <= 0``, ``hash_block_size <= 0``.
    """

    #: The KV event classes the pool builds (vLLM's own in :class:`kvblock.vllm.BlockPool`).
    event_classes: tuple[Any, Any, Any] = (BlockStored, BlockRemoved, AllBlocksCleared)
    #: :meth:`cache_full_blocks` refuses a block listed twice in its range (kvblock's own API);
    #: :class:`kvblock.vllm.BlockPool` takes it as vLLM does (the later listing promotes the
    #: key the earlier one just gave).
    _distinct_cached_blocks: bool = True
    #: HiSparse only: ``(source group, host pool view)``, so a manager's ``KVCacheBlocks`` view
    #: that group's ids (host-pool ids) through the host pool (``kvblock.vllm.hisparse.bind``).
    _hisparse_group_view: tuple[int, Callable[[], Callable[[int], Any]]] | None = None

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = "GPU",
    ) -> None:
        self.medium = medium
        self.metrics_collector = metrics_collector
        self._views: list[KVCacheBlock | None] = []
        self._events = _EventQueue()
        self._watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
        self._next_watcher = 0
        self._queue_head = _QueueEnd(self, True)
        self._queue_tail = _QueueEnd(self, False)

    # -- views ---------------------------------------------------------------------------------
    def _view(self, block_id: int) -> KVCacheBlock:
        views = self._views
        try:
            v = views[block_id]
        except IndexError:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise IndexError(f"block id {block_id} out of range") from None
            views.extend([None] * (block_id + 1 - len(views)))
            v = None
        if v is None:
            v = views[block_id] = KVCacheBlock(self, block_id)
        return v

    @property
    def blocks(self) -> Sequence[KVCacheBlock]:
        """``blocks[i]`` is block ``i``."""
        return _Blocks(self)

    @property
    def null_block(self) -> KVCacheBlock:
        """Block 0, the null block: the placeholder of a table entry with no KV (skipped
        sliding-window blocks, Mamba's unused slots); never allocated, cached or freed.
        """
        return self._view(0)

    @property
    def free_block_queue(self) -> FreeKVCacheBlockQueue:
        """vLLM's ``FreeKVCacheBlockQueue`` face of the free queue (a new view per read; the
        queue itself lives in Rust).
        """
        return FreeKVCacheBlockQueue(self)

    @property
    def cached_block_hash_to_block(self) -> BlockHashToBlockMap:
        """vLLM's ``BlockHashToBlockMap`` face of the cache map (key -> blocks; a new view per
        read).
        """
        return BlockHashToBlockMap(self)

    @property
    def cached_block_hashes_by_block(self) -> _SecondaryKeys:
        """``{block_id: set of keys}`` for every cached block: the keys each block is cached under
        (a mapping view read from Rust).
        """
        return _SecondaryKeys(self)

    @property
    def kv_event_queue(self) -> list[KVCacheEvent]:
        """The buffered events (a list vLLM code may append to)."""
        self._drain_events()
        return self._events

    @property
    def num_gpu_blocks_total(self) -> int:
        """``num_gpu_blocks``: every block of the pool, the null block included."""
        return self.num_gpu_blocks

    # -- vLLM's BlockPool API ----------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses. Raises
        TypeError / ValueError naming ``kv_cache_group_ids[i]`` for a group id that is not an
        int in ``[0, 2**32)``."""
        ids = self.get_cached_block_ids(block_hash, list(kv_cache_group_ids))
        return None if ids is None else [self._view(b) for b in ids]

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks (evicting cached ones), each with ref_cnt 1. Raises
        ``ValueError("Cannot get {n} free blocks from the pool")``, changing nothing, if fewer
        are free."""
        out = [self._view(b) for b in self.allocate_ids(num_blocks).tolist()]
        if self._watchers:
            self._fire_reuse_watchers()
        return out

    def touch(self, blocks: Any) -> None:
        """Take a reference on each block (a flat sequence, or one sequence per group); free
        cached blocks leave the free queue. The null block is skipped."""
        ids: list[int] = []
        for b in blocks:
            if isinstance(b, (list, tuple)):
                ids.extend(_own_ids(self, b, "blocks"))
            else:
                ids.extend(_own_ids(self, (b,), "blocks"))
        self.touch_ids(ids, skip_null=True)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block in the given order; blocks reaching 0 are queued
        (unhashed to the head, hashed to the tail). The null block is skipped; blocks of
        another pool are freed into theirs, as vLLM forwards them. Raises ValueError,
        changing nothing, if a block holds fewer references than dropped."""
        own, others = self._split_own(ordered_blocks)
        self.free_ids(own, skip_null=True)
        for pool, blocks in others:
            pool.free_blocks(blocks)

    def _split_own(self, ordered_blocks: Iterable[Any]) -> tuple[list[int], list[tuple[Any, list[Any]]]]:
        """The ids of this pool's blocks in ``ordered_blocks``, and the blocks of each other
        pool (vLLM forwards those to their pool). Raises TypeError for anything else."""
        own: list[int] = []
        others: dict[int, tuple[Any, list[Any]]] = {}
        for b in ordered_blocks:
            pool = getattr(b, "pool", None)
            if isinstance(pool, weakref.ref):
                # vLLM 0.34's blocks hold their pool weakly; a block of a pool that is gone is
                # skipped, as vLLM skips it
                pool = pool()
                if pool is None:
                    continue
            if isinstance(b, int):
                own.append(b)
            elif pool is not None and pool is not self and callable(getattr(pool, "free_blocks", None)):
                # a block of another pool (kvblock's, or vLLM's own, e.g. a HiSparse host pool)
                others.setdefault(id(pool), (pool, []))[1].append(b)
            elif isinstance(b, KVCacheBlock) and pool is self:
                own.append(b.block_id)
            else:
                raise TypeError(
                    f"ordered_blocks: {b!r} is not a block of this pool (kvblock's blocks are views of "
                    "their pool's state)"
                )
        return own, list(others.values())

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's block hashes
        (viewed at ``block_size``) and group ``kv_cache_group_id``; null blocks and blocks
        ``block_mask`` (aligned with the range) rules out are skipped. With events on, one
        ``BlockStored`` covers the range.

        Raises ValueError naming ``blocks``, changing nothing and recording no event, for a
        block listed twice in the range (:class:`kvblock.vllm.BlockPool`, as vLLM's, takes the
        later listing as the promotion of the key the earlier one gave)."""
        # only the range is read (as vLLM's does)
        ids = [0] * num_cached_blocks + _own_ids(self, blocks[num_cached_blocks:num_full_blocks], "blocks")
        self._cache_full_blocks(
            request,
            ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            None if block_mask is None else [bool(m) for m in block_mask],
            self._distinct_cached_blocks,
        )

    def emit_cached_block_events(
        self, request: Any, num_cached_blocks: int, block_size: int, kv_cache_group_id: int
    ) -> None:
        """A ``BlockStored`` for the first ``num_cached_blocks`` blocks of a prefix hit (for
        ``kv_cache_report_mode == "full"``); no state changes."""
        self._emit_cached_block_events(request, num_cached_blocks, block_size, kv_cache_group_id)

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        """Make ``block`` reachable from the prefix boundary at ``num_tokens`` (a positive
        multiple of the hash block size): the key registered, or None for the null block."""
        return self._cache_partial_block(
            request, block.block_id, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
        )

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point ``src_block``'s cache keys to ``dst_block`` (which has none); no events.
        Raises, changing nothing, AssertionError if ``dst_block`` has a key and ValueError
        (naming ``dst``) if it is the null block, which never holds a key."""
        self.move_block_hash_ids(src_block.block_id, dst_block.block_id)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the tail of the free queue
        as last-resort candidates. ``on_reuse(block)`` fires when ``get_new_blocks`` hands a
        block out or the cache is reset."""
        w = self._next_watcher
        self._next_watcher += 1
        self._watchers[w] = on_reuse
        self.unpin_ids(_own_ids(self, blocks, "blocks"), w)

    #: What a HiSparse residency reuse watcher does when vLLM code calls it by hand
    #: (``_reuse_watchers[block_id](block)``): set by ``kvblock.vllm.hisparse`` when a manager
    #: with HiSparse groups binds this pool; the pool fires those watchers inside the manager.
    _residency_on_reuse: Callable[[KVCacheBlock], None] | None = None

    @property
    def _reuse_watchers(self) -> dict[int, Callable[[KVCacheBlock], None]]:
        """vLLM's ``_reuse_watchers``: ``{block_id: on_reuse}`` for the blocks
        :meth:`unpin_blocks` watches, in registration order (a snapshot: changing it changes
        nothing). The HiSparse residency's own watchers show as ``_residency_on_reuse``."""
        out: dict[int, Callable[[KVCacheBlock], None]] = {}
        for block_id, w in self._watched_blocks():
            cb = self._residency_on_reuse if w is None else self._watchers.get(w)
            if cb is not None:
                out[block_id] = cb
        return out

    def _fire_reuse_watchers(self) -> None:
        for block_id, w in self._take_fired_watchers():
            cb = self._watchers.get(w)
            if cb is not None:
                cb(self._view(block_id))
        if not self._has_watchers():
            self._watchers.clear()

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop the block's cache keys (one ``BlockRemoved`` each); False if it had none."""
        return self.maybe_evict_id(block.block_id)

    def is_block_writable(self, block: KVCacheBlock) -> bool:  # type: ignore[override]
        """Not null, one reference, no hash."""
        return super().is_block_writable(block.block_id)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of these blocks (ref counts and queue positions unchanged)."""
        self.evict_ids(list(block_ids))

    def reset_prefix_cache(self) -> bool:
        """Clear every cache key if no block is in use; False, changing nothing, otherwise."""
        ok = super().reset_prefix_cache()
        if ok and self._watchers:
            self._fire_reuse_watchers()
        if ok and self.metrics_collector:
            # as vLLM's pool, after the reuse watchers (the Rust metrics were reset with the keys)
            self.metrics_collector.reset()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, oldest first (``[]`` with events off)."""
        if not self.enable_kv_cache_events:
            return []
        self._drain_events()
        out, self._events = self._events, _EventQueue()
        return list(out)

    def _drain_events(self) -> None:
        stored, removed, cleared = self.event_classes
        for raw in self.take_raw_events():
            if isinstance(raw, _core.RawBlockStored):
                self._events.append(
                    block_stored_for_request(
                        raw.request, raw.block_hashes, raw.parent_block_hash, raw.token_start, raw.token_end,
                        raw.block_size, raw.group, raw.key_ranges, raw.tokens,
                        medium=HOST_MEDIUM if raw.host else self.medium,
                        lookahead=0 if raw.host else self.num_hash_lookahead_tokens, cls=stored,
                    )
                )
            elif isinstance(raw, _core.RawBlockRemoved):
                medium = HOST_MEDIUM if raw.host else self.medium
                self._events.append(block_removed(raw.block_hash, raw.group, medium, cls=removed))
            else:
                self._events.append(cleared())

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_gpu_blocks={self.num_gpu_blocks}, free={self.get_num_free_blocks()}, "
            f"cached_keys={self.num_cached_keys()})"
        )

