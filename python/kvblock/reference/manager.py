"""Reference KV cache manager: vLLM 0.33.0's ``KVCacheManager`` for one KV-cache group.

Plain Python, written for reading (spec §5, §6.2). The manager owns a :class:`BlockPool`
and, per request, its block table (``req_to_blocks``) and the number of its blocks already
cached (``num_cached_block``). The scheduler drives it:

* :meth:`KVCacheManager.get_computed_blocks` finds the longest cached prefix of a new
  request (never its last token) without taking references;
* :meth:`KVCacheManager.allocate_slots` checks capacity first (returning None with no side
  effect when blocks are short), then adopts the hit blocks, allocates new ones and caches
  every block that became full;
* :meth:`KVCacheManager.free` returns a request's blocks, tail first.

The group is full attention by default, or sliding-window attention when ``sliding_window``
is given (hits need a full window of contiguous cached blocks; blocks that fall out of the
window are replaced by the null block and freed).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..events import BlockStored, KVCacheEvent
from ..extra_keys import generate_block_hash_extra_keys, get_mm_features_in_window
from ..request import RequestStatus
from ..stats import PrefixCacheStats
from . import hashing as ref_hashing
from .block_pool import BlockPool, KVCacheBlock, _check_count
from .retention import StaleHitError, block_priority, check_duration, request_retention

__all__ = ["KVCacheBlocks", "KVCacheManager"]

logger = logging.getLogger(__name__)

#: ``max_model_len`` when none is given: no request is too long.
DEFAULT_MAX_MODEL_LEN = 2**31 - 1
_KV_CACHE_GROUP_ID = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler (vLLM 0.33.0 ``KVCacheBlocks``).

    ``blocks[g][j]`` is the ``j``-th block of KV-cache group ``g``. A group with no blocks is
    an empty tuple; the manager's shared ``empty_kv_cache_blocks`` is made of tuples only, so
    it cannot be mutated.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]
    #: The blocks' generations when get_computed_blocks found them (stale-hit check).
    generations: tuple[list[int], ...] | None = None

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Per-group concatenation into new lists."""
        return KVCacheBlocks(
            tuple(list(itertools.chain(mine, theirs)) for mine, theirs in zip(self.blocks, other.blocks))
        )

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; None instead of empty lists if ``allow_none`` and every group
        is empty."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a cache key (single group only).

        Raises:
            ValueError: there is more than one group.
        """
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids supports exactly one KV-cache group")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        """A new instance with the same number of groups and no blocks."""
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """vLLM 0.33.0's ``KVCacheManager`` over a single KV-cache group (spec §5).

    Args:
        num_blocks: blocks in the pool, including the null block 0.
        block_size: tokens per block (also the hash block size).
        enable_caching: automatic prefix caching on/off.
        hash_algo: ``"sha256"``, ``"sha256_cbor"``, ``"xxhash"`` or ``"xxhash_cbor"``; the
            request hasher chains from :attr:`none_hash`, this algorithm's root
            (:func:`~kvblock.reference.hashing.none_hash_for`), fixed for the manager's life.
        max_model_len: the longest sequence in tokens (None: ``2**31 - 1``).
        log_stats: collect :class:`PrefixCacheStats`.
        enable_kv_cache_events: queue KV events (:meth:`take_events`).
        use_eagle: EAGLE speculative decoding: a prefix hit drops its last block.
        watermark: fraction of ``num_blocks`` kept free when admitting waiting or preempted
            requests while others are scheduled.
        sliding_window: if set, the group is sliding-window attention over this many tokens.
        priority_retention, default_retention_priority, decay_granularity_s,
            max_pinned_fraction, clock: kvblock's retention (see
            :class:`kvblock.KVCacheManager`).
        verify_hits: verify on hit (see :class:`kvblock.KVCacheManager`): each cached block
            records its content id, generation, parent's content id, tokens and extra keys;
            a hit block that is not exactly the request's block ends the hit and counts in
            ``hit_verification_failures``. Full attention only (``ValueError`` with
            ``sliding_window``).

    Beyond vLLM, as kvblock's own API: stale hits raise :class:`StaleHitError`,
    :meth:`probe`, :meth:`pin_prefix` / :meth:`unpin_prefix`.

    Requests must be built with ``block_hasher=manager.request_block_hasher``.

    Raises:
        TypeError / ValueError: invalid sizes, algorithm or watermark.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        max_model_len: int | None = None,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        use_eagle: bool = False,
        watermark: float = 0.0,
        sliding_window: int | None = None,
        priority_retention: bool = False,
        default_retention_priority: int = 35,
        decay_granularity_s: float = 1.0,
        max_pinned_fraction: float = 0.25,
        clock: Any = None,
        verify_hits: bool = False,
    ) -> None:
        _check_count("block_size", block_size)
        if block_size < 1:
            raise ValueError("block_size: must be > 0")
        if max_model_len is None:
            max_model_len = DEFAULT_MAX_MODEL_LEN
        _check_count("max_model_len", max_model_len)
        if not watermark >= 0.0:
            raise ValueError(f"watermark: must be >= 0, got {watermark}")
        if sliding_window is not None:
            _check_count("sliding_window", sliding_window)
            if sliding_window < 1:
                raise ValueError("sliding_window: must be > 0")
            if verify_hits:
                raise ValueError(
                    "verify_hits: kv_cache_groups[0] is not full attention: only full-attention hits run from "
                    "block 0, where each block's parent can be verified"
                )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.sliding_window = sliding_window
        self.hash_fn = ref_hashing.get_hash_fn_by_name(hash_algo)
        self.none_hash = ref_hashing.none_hash_for(self.hash_fn)
        self.request_block_hasher = ref_hashing.get_request_block_hasher(
            block_size, self.hash_fn, none_hash=self.none_hash
        )

        if not 0 <= max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction: {max_pinned_fraction} must be in [0, 1]")
        self.block_pool = BlockPool(
            num_blocks, enable_caching, block_size, enable_kv_cache_events,
            priority_retention=priority_retention, default_retention_priority=default_retention_priority,
            decay_granularity_s=decay_granularity_s,
        )
        self.clock = time.monotonic if clock is None else clock
        self.max_pinned_blocks = math.floor(max_pinned_fraction * (num_blocks - 1))
        self.pins: dict[bytes, tuple[list[KVCacheBlock], int, float | None]] = {}
        self.pin_count: dict[int, int] = {}
        self.request_retention: dict[str, Any] = {}
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))
        if sliding_window is None:
            self._event_metadata: tuple[str, int | None] = ("full_attention", None)
            self._contiguous_blocks_for_hit = 0
        else:
            self._event_metadata = ("sliding_window", sliding_window)
            # The current token is part of its own window, hence the -1.
            self._contiguous_blocks_for_hit = _cdiv(sliding_window - 1, block_size) + int(use_eagle)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # verify on hit: block id -> (content id, generation, parent id, tokens, extra keys)
        self.verify_hits = bool(verify_hits) and enable_caching
        self._records: dict[int, tuple[int, int, int, tuple[int, ...], Any]] = {}
        self._next_content_id = 1
        self.hit_verification_failures = 0

    # -- properties and stats --------------------------------------------------------------
    @property
    def usage(self) -> float:
        """KV-cache usage between 0.0 and 1.0 (the null block is not counted)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats collected so far and start a fresh object (None if not logging)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Record an admission: ``request.num_tokens`` queried, ``num_hits`` tokens hit.

        Does nothing unless ``log_stats`` is on and the request reads the prefix cache
        (caching on and not ``request.skip_reading_prefix_cache``). A request with
        ``num_preemptions > 0`` counts only in the ``preempted_*`` fields.
        """
        _check_count("num_hits", num_hits)
        if not self.log_stats or not self._reads_prefix_cache(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def _reads_prefix_cache(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    # -- prefix lookup -----------------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        """The longest cached prefix of ``request``: ``(blocks, num_computed_tokens, 0)``.

        The hit is capped at ``request.num_tokens - 1`` tokens (the last token is always
        recomputed to produce logits) and is block aligned, so a fully cached block-aligned
        prompt loses its whole last block. Reference counts are not changed (that happens in
        :meth:`allocate_slots`). Returns ``(empty_kv_cache_blocks, 0, 0)`` when caching is off
        or the request skips reading the cache. With events on and
        ``request.kv_cache_report_mode == "full"``, a hit is reported as one ``BlockStored``
        (parent None, tokens from 0). The third element, the hybrid shared-prefix boundary,
        is always 0 for a single group.
        """
        if not self._reads_prefix_cache(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_cache_hit_length = max(request.num_tokens - 1, 0)
        blocks = self._find_longest_cache_hit(request.block_hashes, max_cache_hit_length, request)
        num_computed_tokens = len(blocks) * self.block_size
        if (
            blocks
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            self.block_pool.emit_cached_block_events(
                request, len(blocks), self.block_size, _KV_CACHE_GROUP_ID
            )
        result = self.create_kv_cache_blocks((blocks,))
        if blocks:
            result.generations = ([self.block_pool.generation[b.block_id] for b in blocks],)
        return result, num_computed_tokens, 0

    def probe(self, request: Any) -> int:
        """The hit length :meth:`get_computed_blocks` would report; nothing changes (no
        events even in "full" report mode)."""
        if not self._reads_prefix_cache(request):
            return 0
        max_cache_hit_length = max(request.num_tokens - 1, 0)
        hit = self._find_longest_cache_hit(request.block_hashes, max_cache_hit_length, request, count=False)
        return len(hit) * self.block_size

    # -- retention: the clock, pins ------------------------------------------------------------
    def tick(self) -> float | None:
        """Read the clock if priorities or TTL pins need it: decay, then expire pins (earliest
        first). Returns the reading, if taken."""
        if self.block_pool.retention is None and not any(p[2] is not None for p in self.pins.values()):
            return None
        now = float(self.clock())
        self.block_pool.set_time(now)
        due = sorted((p[2], k) for k, p in self.pins.items() if p[2] is not None and p[2] <= now)
        for _, k in due:
            self._release_pin(k)
        return now

    def _release_pin(self, key: bytes) -> int:
        blocks, num_tokens, _ = self.pins.pop(key)
        for b in blocks:
            self.pin_count[b.block_id] -= 1
            if not self.pin_count[b.block_id]:
                del self.pin_count[b.block_id]
        self.block_pool.free_blocks(list(reversed(blocks)))
        return num_tokens

    def pin_prefix(self, block_hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Pin the cached blocks of the prefix with these full-block hashes (see
        :meth:`kvblock.KVCacheManager.pin_prefix`); returns the pinned tokens."""
        ttl = check_duration(ttl_s, "ttl_s")
        hashes = list(block_hashes)
        if not self.enable_caching:
            raise ValueError("prefix: prefix caching is off: nothing is cached to pin")
        if not hashes:
            raise ValueError("prefix: holds no full block: nothing to pin")
        now = self.tick()
        expires_at = None if ttl is None else (float(self.clock()) if now is None else now) + ttl
        key = hashes[-1]
        hit = [b for b in self._find_longest_cache_hit(hashes, len(hashes) * self.block_size) if not b.is_null]
        num_tokens = len(self._find_longest_cache_hit(hashes, len(hashes) * self.block_size)) * self.block_size
        old = self.pins.get(key)
        if num_tokens == 0 or not hit:
            if old is not None:
                self.pins[key] = (old[0], old[1], expires_at)
                return old[1]
            return 0
        old_ids = [b.block_id for b in old[0]] if old else []
        after = {i for i, c in self.pin_count.items() if c != old_ids.count(i)} | {b.block_id for b in hit}
        if len(after) > self.max_pinned_blocks:
            raise ValueError(f"prefix: pinning it would hold {len(after)} distinct blocks, over the cap of {self.max_pinned_blocks}")
        self.block_pool.touch(hit)
        for b in hit:
            self.pin_count[b.block_id] = self.pin_count.get(b.block_id, 0) + 1
        if old is not None:
            self.pins[key] = (hit, num_tokens, expires_at)
            for b in old[0]:
                self.pin_count[b.block_id] -= 1
                if not self.pin_count[b.block_id]:
                    del self.pin_count[b.block_id]
            self.block_pool.free_blocks(list(reversed(old[0])))
        else:
            self.pins[key] = (hit, num_tokens, expires_at)
        return num_tokens

    def unpin_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Release the pin of this prefix; ``ValueError`` if it is not pinned."""
        hashes = list(block_hashes)
        if not hashes:
            raise ValueError("prefix: holds no full block: it is not pinned")
        if hashes[-1] not in self.pins:
            raise ValueError("prefix: is not pinned")
        self.tick()
        if hashes[-1] not in self.pins:
            raise ValueError("prefix: is not pinned (its TTL ran out)")
        return self._release_pin(hashes[-1])

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pin_count)

    def _find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, request: Any = None, count: bool = True
    ) -> list[KVCacheBlock]:
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        if self.sliding_window is None:
            return self._full_attention_hit(block_hashes, num_blocks, request, count)
        return self._sliding_window_hit(block_hashes, num_blocks)

    # -- verify on hit -----------------------------------------------------------------------
    def _block_content(self, request: Any, pos: int) -> tuple[tuple[int, ...], Any] | None:
        """The tokens and extra keys of the request's block ``pos`` (None if it holds a token
        outside int64, which is never recorded nor verified)."""
        bs = self.block_size
        tokens = tuple(request.all_token_ids[pos * bs : (pos + 1) * bs])
        if any(not -(2**63) <= t < 2**63 for t in tokens):
            return None
        s, e = pos * bs, (pos + 1) * bs
        mm_idx = get_mm_features_in_window(request.mm_features, s, e) if pos > 0 else 0
        extra, _ = generate_block_hash_extra_keys(request, s, e, mm_idx)
        return tokens, extra

    def _content_id(self, block: KVCacheBlock) -> int | None:
        """The block's content id if its record applies (recorded at its current generation)."""
        r = self._records.get(block.block_id)
        if r is None or r[1] != self.block_pool.generation[block.block_id]:
            return None
        return r[0]

    def _verify(self, block: KVCacheBlock, pos: int, parent: int, request: Any) -> bool:
        """True if ``block``, found at position ``pos``, holds exactly the request's block
        ``pos`` on top of the block whose content id is ``parent`` (0: the root)."""
        if self._content_id(block) is None:
            return False
        content = self._block_content(request, pos)
        _, _, rparent, tokens, extra = self._records[block.block_id]
        return content is not None and rparent == parent and (tokens, extra) == content

    def _record(self, request: Any, blocks: Sequence[KVCacheBlock], lo: int, hi: int) -> None:
        """Record the blocks the request just cached at positions ``lo..hi``."""
        for pos in range(lo, min(hi, len(blocks))):
            b = blocks[pos]
            if b.is_null:
                continue
            content = self._block_content(request, pos)
            if content is None:
                self._records.pop(b.block_id, None)
                continue
            if pos == 0:
                parent = 0
            else:
                prev = blocks[pos - 1]
                pid = None if prev.is_null else self._content_id(prev)
                parent = -1 if pid is None else pid
            self._records[b.block_id] = (
                self._next_content_id, self.block_pool.generation[b.block_id], parent, *content
            )
            self._next_content_id += 1

    def _full_attention_hit(
        self, block_hashes: Sequence[bytes], num_blocks: int, request: Any = None, count: bool = True
    ) -> list[KVCacheBlock]:
        """Left to right until the first miss (hashes are chained: later blocks miss too).
        With verify on hit (and a request), a block that is not exactly the request's block is
        a miss too."""
        pool, group_ids = self.block_pool, [_KV_CACHE_GROUP_ID]
        hit: list[KVCacheBlock] = []
        verify = self.verify_hits and request is not None
        parent = 0
        for i in range(num_blocks):
            cached = pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                break
            if verify:
                if not self._verify(cached[0], i, parent, request):
                    if count:
                        self.hit_verification_failures += 1
                    break
                parent = self._records[cached[0].block_id][0]
            hit.append(cached[0])
        if self.use_eagle and hit:
            hit.pop()
        return hit

    def _sliding_window_hit(self, block_hashes: Sequence[bytes], num_blocks: int) -> list[KVCacheBlock]:
        """Right to left for a window's worth of contiguous cached blocks (spec §6.2).

        Positions left of the window are the null block. Without a full window anywhere, the
        contiguous run starting at block 0 is the hit. EAGLE needs one more block and drops it.
        """
        pool, group_ids = self.block_pool, [_KV_CACHE_GROUP_ID]
        needed = self._contiguous_blocks_for_hit
        hit: list[KVCacheBlock] = [pool.null_block] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            cached = pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            hit[i] = cached[0]
            run += 1
            if run >= needed:
                del hit[i + run :]
                break
        else:
            del hit[run:]
        if self.use_eagle and hit:
            hit.pop()
        return hit

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (spec §5.3).

        Token layout: ``| computed | new_computed | external | new | lookahead |`` where
        ``computed = request.num_computed_tokens``. In order: check the arguments; free blocks
        that fell out of the sliding window; count the blocks needed, including hit blocks
        that are currently free (adopting them takes them out of the free pool); return None
        if they do not fit (no state changed); adopt the hit blocks (``touch``); allocate the
        new blocks; cache every block that is now full, up to ``request.num_tokens`` (draft
        tokens are never cached) unless ``delay_cache_blocks``.

        Args:
            request: the request (its ``num_computed_tokens`` is not changed here).
            num_new_tokens: tokens to compute in this step.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``.
            new_computed_blocks: the prefix hit from :meth:`get_computed_blocks` (new
                requests only).
            num_lookahead_tokens: speculative tokens that need slots but are not cached.
            num_external_computed_tokens: tokens a KV connector provides.
            delay_cache_blocks: skip caching (KV arriving asynchronously).
            num_encoder_tokens: cross-attention tokens (unused by this single
                decoder group).
            full_sequence_must_fit: first require room for the whole ``request.num_tokens``.
            reserved_blocks: free blocks to leave untouched.
            has_scheduled_reqs: whether other requests run this step (enables the watermark
                for WAITING/PREEMPTED requests).
            skip_zeroing_group_ids: groups whose new blocks need no zeroing (no effect here).

        Returns:
            The newly allocated blocks only (not the hit blocks); ``empty_kv_cache_blocks`` if
            none were needed; None if the pool is short.

        Raises:
            TypeError / ValueError: negative or non-int counts; ``num_new_tokens == 0`` with
                nothing to adopt; a request longer than ``max_model_len``; hit blocks whose
                count does not match ``num_new_computed_tokens``; computed tokens
                (``request.num_computed_tokens`` + hit + external) past ``max_model_len``
                (vLLM raises from ``get_new_blocks`` after taking the hits' references).
                Nothing is changed.
            AssertionError: hit blocks for a request that already holds blocks, or external
                tokens for one that holds blocks but has not adopted computed tokens (vLLM
                asserts an empty table). Nothing is changed.
        """
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_encoder_tokens", num_encoder_tokens),
            ("reserved_blocks", reserved_blocks),
            ("request.num_computed_tokens", request.num_computed_tokens),
            ("request.num_in_flight_tokens", getattr(request, "num_in_flight_tokens", 0)),
        ):
            _check_count(name, value)
        request_id = request.request_id
        ret = None
        if (
            self.block_pool.retention is not None
            and request_id not in self.request_retention
            and request_id not in self.num_cached_block
            and not self.req_to_blocks.get(request_id)
        ):
            ret = request_retention(request, getattr(request, "num_prompt_tokens", request.num_tokens))
        self.tick()
        # 1. There must be something to compute or to adopt.
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        gens = getattr(new_computed_blocks, "generations", None)
        if gens is not None and new_computed_blocks is not self.empty_kv_cache_blocks:
            for j, (b, g) in enumerate(zip(new_computed_blocks.blocks[0], gens[0])):
                if not b.is_null and self.block_pool.generation[b.block_id] != g:
                    raise StaleHitError(
                        f"new_computed_blocks: hit block {b.block_id} (position {j}) was evicted and reused "
                        f"after get_computed_blocks returned it; look the request up again"
                    )
        hit_blocks = self._new_computed_block_list(request_id, new_computed_blocks)
        if len(hit_blocks) * self.block_size != num_new_computed_tokens:
            raise ValueError(
                f"num_new_computed_tokens ({num_new_computed_tokens}) must equal the hit blocks' "
                f"tokens ({len(hit_blocks)} blocks x {self.block_size})"
            )
        adopts_hit = (
            new_computed_blocks is not None and new_computed_blocks is not self.empty_kv_cache_blocks
        )
        if hit_blocks and request_id not in self.num_cached_block:
            local = request.num_computed_tokens + num_new_computed_tokens
            skipped = self.get_num_skipped_tokens(local + num_external_computed_tokens) // self.block_size
            kept = len(hit_blocks) - min(skipped, len(hit_blocks))
            if kept and local % self.block_size and local // self.block_size + 1 != skipped + kept:
                # vLLM's copy-on-write redirect of a partial hit asserts the tail block sits
                # at index local // block_size (checked here before anything changes)
                raise AssertionError(
                    f"a hit ending at token {local} puts its tail block at index {local // self.block_size}, "
                    f"but the table would hold {skipped + kept} blocks"
                )
        if (
            num_external_computed_tokens > 0
            and self.req_to_blocks.get(request_id)
            and request_id not in self.num_cached_block
        ):
            # vLLM asserts the table is empty when it adopts computed tokens
            raise AssertionError(
                f"request {request_id} already holds blocks and cannot adopt external computed tokens"
            )

        # 2. Computed tokens: local (already computed + prefix hit) and external.
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_uncapped_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        if num_uncapped_computed_tokens > self.max_model_len:
            # The capacity check below counts slots up to max_model_len, while adopting
            # external tokens takes blocks for all of them: vLLM would raise from
            # get_new_blocks after touching the hit blocks. Refuse it before any change.
            field = (
                "num_external_computed_tokens" if num_external_computed_tokens
                else "num_new_computed_tokens" if num_new_computed_tokens
                else "request.num_computed_tokens"
            )
            raise ValueError(
                f"{field}: {request.num_computed_tokens} computed + {num_new_computed_tokens} hit + "
                f"{num_external_computed_tokens} external tokens exceed max_model_len {self.max_model_len}"
            )
        total_computed_tokens = num_uncapped_computed_tokens

        # 3. The watermark applies to admissions while other requests are scheduled.
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks

        free_blocks = self.block_pool.get_num_free_blocks()
        # 4. Admission gate: the whole sequence must fit.
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            needed = self._get_num_blocks_to_allocate(
                request_id, full_num_tokens, hit_blocks, total_computed_tokens, num_local_computed_tokens
            )
            if needed + watermark_blocks > free_blocks:
                return None

        # 5. Tokens that need a slot.
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)

        # 6. Free out-of-window blocks, on the processed-token basis (in-flight steps still
        #    read blocks below the optimistic boundary). Runs even if allocation fails.
        self.remove_skipped_blocks(
            request_id, max(0, total_computed_tokens - request.num_in_flight_tokens)
        )

        # 7-8. Capacity check before any state change.
        needed = self._get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hit_blocks, num_uncapped_computed_tokens, num_local_computed_tokens
        )
        if needed + watermark_blocks > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None

        # 9. Adopt the prefix hit (and allocate blocks for external tokens).
        if adopts_hit or num_external_computed_tokens > 0:
            self._allocate_new_computed_blocks(
                request_id, hit_blocks, num_local_computed_tokens, num_external_computed_tokens
            )

        # 10. New blocks for the tokens to compute.
        new_blocks = self._allocate_new_blocks(request_id, num_tokens_need_slot)

        # 11-12. Cache the blocks that became full (never unverified draft tokens).
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed_tokens + num_new_tokens, request.num_tokens))

        if ret is not None:
            self.request_retention[request_id] = ret
        # 13. Only the newly allocated blocks.
        return self.create_kv_cache_blocks((new_blocks,))

    def _new_computed_block_list(
        self, request_id: str, new_computed_blocks: KVCacheBlocks | None
    ) -> Sequence[KVCacheBlock]:
        if new_computed_blocks is None:
            return ()
        if not isinstance(new_computed_blocks, KVCacheBlocks):
            raise TypeError(
                f"new_computed_blocks: expected KVCacheBlocks, got {type(new_computed_blocks).__name__}"
            )
        if len(new_computed_blocks.blocks) != 1:
            raise ValueError("new_computed_blocks: expected exactly one KV-cache group")
        blocks = new_computed_blocks.blocks[0]
        # vLLM: a running request (in num_cached_block) adopts no hits; any other must have an
        # empty table (an allocation that raised may have left an empty one behind)
        if blocks and (request_id in self.num_cached_block or self.req_to_blocks.get(request_id)):
            raise AssertionError(
                f"request {request_id} already holds blocks and cannot adopt new computed blocks"
            )
        return blocks

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that attention no longer reads: 0 for full attention,
        ``max(0, n - sliding_window + 1)`` for a sliding window."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def _get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int = 0,
    ) -> int:
        """Blocks ``allocate_slots`` would take from the free pool for ``num_tokens`` slots.

        A running request needs ``cdiv(num_tokens, B) - len(table)``. A new one needs the
        blocks not covered by its hit (or by skipped out-of-window positions), plus each hit
        block inside the window that is currently free: adopting it removes it from the pool,
        plus one when the local computed tokens end inside a block (vLLM 0.33.0 reserves a
        copy-on-write block for a partial hit).
        """
        num_required_blocks = _cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0)
        num_skipped_hit_blocks = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable_blocks = sum(
            1
            for block in new_computed_blocks[num_skipped_hit_blocks:]
            if block.ref_cnt == 0 and not block.is_null
        )
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            num_new_blocks += 1
        return num_new_blocks + num_evictable_blocks

    def _allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Touch the hit blocks and start the request's table with them (null blocks for
        out-of-window positions), then allocate blocks for external tokens."""
        if request_id in self.num_cached_block:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_total_computed_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed_tokens)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        in_window = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(in_window)
        req_blocks.extend([self.block_pool.null_block] * num_skipped_blocks)
        req_blocks.extend(in_window)
        self.num_cached_block[request_id] = len(req_blocks)

        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total_computed_tokens - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens > 0:
            req_blocks.extend(
                self.block_pool.get_new_blocks(
                    _cdiv(num_total_computed_tokens, self.block_size) - len(req_blocks)
                )
            )

    def _allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        num_new_blocks = _cdiv(num_tokens, self.block_size) - len(self.req_to_blocks.get(request_id, ()))
        if num_new_blocks <= 0:
            return []
        # Taken before the table is made: a request that is not running, with computed tokens
        # outside a sliding window and no hit to adopt, is counted as if they were skipped but
        # gets blocks for all of them (as in vLLM); the pool may then be short, and the
        # error must leave no table behind.
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's blocks that are full within its first ``num_computed_tokens``
        tokens and not cached yet (no-op when caching is off).

        Only blocks with a hash count as full: ``min(n, len(block_hashes) * B) // B``. Past
        the blocks the request holds, vLLM 0.33.0 slices its table with events off (the held
        blocks are cached, the count recorded is the full one) and fails with events on.

        Raises:
            ValueError: with KV events on, more full blocks than the request holds; nothing
                is changed.
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_hashed_tokens = len(request.block_hashes) * self.block_size
        num_full_blocks = min(num_computed_tokens, num_hashed_tokens) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        end = num_full_blocks
        if end > len(blocks):
            if self.enable_kv_cache_events:
                raise ValueError(f"list index out of range: caching {num_full_blocks} full blocks of a request "
                                 f"holding {len(blocks)} (group {_KV_CACHE_GROUP_ID})")
            end = max(len(blocks), num_cached_blocks)
        if end > num_cached_blocks:
            self.block_pool.cache_full_blocks(
                request, blocks, num_cached_blocks, end, self.block_size, _KV_CACHE_GROUP_ID,
            )
            if self.verify_hits:
                self._record(request, blocks, num_cached_blocks, end)
        self.num_cached_block[request_id] = num_full_blocks

    # -- release ---------------------------------------------------------------------------
    def free(self, request: Any) -> None:
        """Return all of the request's blocks to the pool, tail first, and forget it.

        Its unhashed blocks go to the head of the free queue, its cached blocks to the tail,
        each in reverse table order, so a chain is evicted from its deepest block. Freeing an
        unknown or already freed request does nothing.
        """
        request_id = request.request_id
        self.tick()
        ret = self.request_retention.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks and ret is not None:
            bs = self.block_size
            for j, b in enumerate(blocks):
                if not b.is_null:
                    pd = block_priority(ret, j * bs, (j + 1) * bs)
                    if pd is not None:
                        self.block_pool.assign_retention(b, *pd)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace the blocks before the attention window by the null block and free them.

        ``num_computed_tokens`` counts fully processed tokens only. The blocks are freed
        tail first; the scan stops at the first block that already is null. No-op for full
        attention and for unknown requests.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null_block = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null_block:
                break
            removed.append(blocks[i])
            blocks[i] = null_block
        if removed:
            self.block_pool.free_blocks(removed)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (see :meth:`BlockPool.evict_blocks`)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache if no block is in use; on success mark the stats ``reset``."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # -- inspection --------------------------------------------------------------------------
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33.0 (cascade attention was removed): always ``[0]``."""
        return [0]

    def take_events(self) -> list[KVCacheEvent]:
        """The queued KV events; each ``BlockStored`` is annotated with the group's spec kind
        (``"full_attention"`` or ``"sliding_window"``) and sliding window."""
        events = self.block_pool.take_events()
        kind, window = self._event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if event.group_idx != _KV_CACHE_GROUP_ID:
                logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            event.kv_cache_spec_kind = kind
            event.kv_cache_spec_sliding_window = window
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table (a copy); empty for an unknown request."""
        return self.create_kv_cache_blocks((list(self.req_to_blocks.get(request_id, ())),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group."""
        return self.get_blocks(request_id).get_block_ids()

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group block lists; the shared ``empty_kv_cache_blocks`` if all are empty."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks
