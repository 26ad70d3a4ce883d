"""vLLM-compatible ``BlockPool`` over the Rust pool (spec §2–§4).

:class:`BlockPool` *is* the Rust pool (it subclasses ``kvblock._core.BlockPoolCore``), with two
faces: vLLM's methods taking and returning :class:`KVCacheBlock` objects, so code written
against ``vllm.v1.core.block_pool.BlockPool`` runs unchanged, and the fast id API of the core
(``allocate_ids``, ``free_ids``, ``touch_ids``, ``cache_ids``, ``lookup_prefix``, ...), one call
per request-level action with ints or numpy arrays. Block ids and free-queue order are
identical to vLLM 0.33.0's.

A :class:`KVCacheBlock` is a view (block id + pool): reading ``ref_cnt`` or ``block_hash``
asks the pool, so there is no per-block Python state to keep in sync.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from . import _core
from .events import AllBlocksCleared, KVCacheEvent, block_removed, block_stored_for_request
from .hashing import resolve_block_hashes

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """A block of the pool, as vLLM's ``KVCacheBlock`` shows it: ``block_id``, ``ref_cnt``,
    ``block_hash`` (``BlockHashWithGroupId`` bytes or None) and ``is_null``. Read-only view."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: "BlockPool", block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        return self._pool.ref_cnt(self.block_id)

    @property
    def block_hash(self) -> bytes | None:
        return self._pool.block_hash(self.block_id)

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlock) and other._pool is self._pool and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self._pool), self.block_id))

    def __repr__(self) -> str:
        h = self.block_hash
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={None if h is None else h.hex()})"


def _ids(blocks: Iterable[Any]) -> list[int]:
    return [b if isinstance(b, int) else b.block_id for b in blocks]


class FreeKVCacheBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` face of the pool's free queue (head = next to
    allocate). ``popleft``/``remove``/``append`` change the queue only, without reference
    counting, exactly as vLLM's queue does."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return [self._pool._view(b) for b in self._pool.free_queue_ids()]

    def popleft(self) -> KVCacheBlock:
        """Pop the head. Raises ``ValueError("No free blocks available")`` when empty."""
        if self._pool.get_num_free_blocks() == 0:
            raise ValueError("No free blocks available")
        return self._pool._view(self._pool._queue_popleft_n(1)[0])

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head; raises ValueError, changing nothing, if fewer are free."""
        return [self._pool._view(b) for b in self._pool._queue_popleft_n(n)]

    def remove(self, block: KVCacheBlock) -> None:
        self._pool._queue_remove(block.block_id)

    def append(self, block: KVCacheBlock) -> None:
        self._pool._queue_insert([block.block_id], False)

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._pool._queue_insert(_ids(blocks), False)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._pool._queue_insert(_ids(blocks), True)


class _BlockHashToBlockMap:
    """Read-only face of the hash -> block map (vLLM's ``BlockHashToBlockMap``)."""

    def __init__(self, pool: "BlockPool") -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_cached_keys()

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        b = self._pool.lookup_key(key)
        return None if b is None else self._pool._view(b)

    def contain(self, key: bytes, block_id: int) -> bool:
        return block_id in self._pool.lookup_key_all(key)

    def items(self) -> list[tuple[bytes, list[int]]]:
        return list(self._pool.cached_items().items())

    def __contains__(self, key: bytes) -> bool:
        return self._pool.lookup_key(key) is not None


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


class BlockPool(_core.BlockPoolCore):
    """The block pool (vLLM 0.33.0 ``BlockPool``), in Rust.

    Args:
        num_gpu_blocks: total blocks (> 0); block 0 becomes the null block.
        enable_caching: keep freed full blocks cached (prefix caching).
        hash_block_size: tokens per hashed block (> 0).
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` for :meth:`take_events`.
        medium: the ``medium`` field of events (``"GPU"``).

    Per block the pool keeps 24 bytes (ref count, key slot, two free-queue links, two
    duplicate-key links); building it is O(num_gpu_blocks) in Rust with no Python object per
    block. The id API (``cache_ids``) knows no request: its ``BlockStored`` events carry the
    hashes but empty ``token_ids``.
    """

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
        self._views: dict[int, KVCacheBlock] = {}
        self._pending_events: list[KVCacheEvent] = []

    # -- views ---------------------------------------------------------------------------------
    def _view(self, block_id: int) -> KVCacheBlock:
        v = self._views.get(block_id)
        if v is None:
            v = self._views[block_id] = KVCacheBlock(self, block_id)
        return v

    @property
    def blocks(self) -> Sequence[KVCacheBlock]:
        """``blocks[i]`` is block ``i``."""
        return _Blocks(self)

    @property
    def null_block(self) -> KVCacheBlock:
        return self._view(0)

    @property
    def free_block_queue(self) -> FreeKVCacheBlockQueue:
        return FreeKVCacheBlockQueue(self)

    @property
    def cached_block_hash_to_block(self) -> _BlockHashToBlockMap:
        return _BlockHashToBlockMap(self)

    @property
    def num_gpu_blocks_total(self) -> int:
        return self.num_gpu_blocks

    # -- vLLM's BlockPool API ----------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        out = []
        for g in kv_cache_group_ids:
            b = self.lookup_key(block_hash + int(g).to_bytes(4, "big"))
            if b is None:
                return None
            out.append(self._view(b))
        return out

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks (evicting cached ones), each with ref_cnt 1. Raises
        ``ValueError("Cannot get {n} free blocks from the pool")``, changing nothing, if fewer
        are free."""
        return [self._view(b) for b in self.allocate_ids(num_blocks).tolist()]

    def touch(self, blocks: Any) -> None:
        """Take a reference on each block (a flat sequence, or one sequence per group); free
        cached blocks leave the free queue. The null block is skipped."""
        ids: list[int] = []
        for b in blocks:
            if isinstance(b, (list, tuple)):
                ids.extend(_ids(b))
            else:
                ids.append(b.block_id)
        self.touch_ids([i for i in ids if i != 0])

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block in the given order; blocks reaching 0 are queued
        (unhashed to the head, hashed to the tail). The null block is skipped."""
        self.free_ids([i for i in _ids(ordered_blocks) if i != 0])

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
        (at ``block_size``, from the hash-block-size hashes) and group ``kv_cache_group_id``;
        null blocks and masked-out blocks are skipped."""
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        if not isinstance(hashes, list):
            hashes = list(hashes)
        ids = _ids(blocks)
        if block_mask is not None:
            ids = [b if keep else 0 for b, keep in zip(ids, block_mask)] + ids[len(block_mask):]
        self._cache_for_request(request, ids, hashes, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of these blocks (ref counts and queue positions unchanged)."""
        self.evict_ids(list(block_ids))

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, oldest first (``[]`` with events off)."""
        self._drain_events()
        out, self._pending_events = self._pending_events, []
        return out

    def _drain_events(self) -> None:
        for raw in self.take_raw_events():
            kind = raw[0]
            if kind == "stored":
                _, hashes, parent, first, bs, group, req, end, nulls, tokens = raw
                self._pending_events.append(
                    block_stored_for_request(
                        req, hashes, parent, first, bs, group, self.medium, end_block=end, null_blocks=nulls,
                        token_ids=tokens,
                    )
                )
            elif kind == "removed":
                self._pending_events.append(block_removed(raw[1], raw[2], self.medium))
            else:
                self._pending_events.append(AllBlocksCleared())

