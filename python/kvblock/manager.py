"""``KVCacheManager``: vLLM 0.33.0's KV cache manager for any engine (spec §5, §6): one block
pool shared by every KV-cache group of a model (full attention, sliding window, chunked local
attention, Mamba, cross attention), with vLLM's coordinator rules.

The scheduler-facing calls (``get_computed_blocks``, ``allocate_slots``, ``free``) are Rust
methods inherited from ``kvblock._core.KVCacheManagerCore``: each reads the request's
``request_id``, ``num_computed_tokens``, token counts and ``block_hashes`` and performs the
whole action, for every group, in one boundary crossing; per-request block tables live in
Rust. Stats, events and the result types are Python. ``kvblock.vllm.KVCacheManager`` is the
same core behind vLLM's own constructor and result types.

Beyond vLLM (kvblock's own API only; ``kvblock.vllm`` keeps vLLM 0.33.0's behaviour):

* **Stale hits are impossible.** The hit blocks ``get_computed_blocks`` returns carry each
  block's generation (bumped whenever the pool hands the block out anew or drops its keys).
  ``allocate_slots`` refuses hits whose block moved on since (evicted and reused by another
  request between the two calls, as custom schedulers and batch admission allow) with
  :class:`kvblock.StaleHitError` (a ``ValueError``), changing nothing: the caller looks the
  request up again. ``admit_batch`` looks each request up right before allocating it, so its
  hits cannot go stale. Hits built by hand (``KVCacheBlocks(...)``) carry no generations and
  are not checked.
* ``probe(request)``: the hit length, touching nothing (no LRU move, stats or events).
* Priority retention (``priority_retention=True``), pinned prefixes (:meth:`KVCacheManager.pin_prefix`)
  with a cap and TTLs, read off an injectable ``clock``.
* Verify on hit (``verify_hits=True``): a hash collision can never hand out foreign KV.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

import kvblock._core as _core

from . import hashing
from .block_pool import BlockPool, KVCacheBlock
from .events import BlockStored, KVCacheEvent
from .request import Request, RequestStatus
from .specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    _groups,
    _positive,
    core_groups,
    resolve_block_sizes,
)
from .stats import PrefixCacheStats

__all__ = ["IdsBackedBlocks", "KVCacheBlocks", "KVCacheManager"]

_BlockIds = _core.BlockIds

#: ``max_model_len`` when none is given.
DEFAULT_MAX_MODEL_LEN = 1 << 40


class IdsBackedBlocks:
    """The base of both ``KVCacheBlocks`` classes (this module's, and ``kvblock.vllm``'s,
    which also subclasses vLLM's own): the result is held as block ids per group (one
    ``kvblock._core.BlockIds`` per group when the manager made it: no Python object per
    block) and ``blocks`` builds the pool's :class:`~kvblock.block_pool.KVCacheBlock` views
    on first use. Each subclass declares the slots ``_ids``, ``_pool``, ``_blocks`` itself
    (the Rust core fills them by name on the exact class).
    """

    __slots__ = ()
    _ids: tuple[Sequence[int], ...] | None
    _pool: Any
    _blocks: tuple[Sequence[KVCacheBlock], ...] | None

    @classmethod
    def _from_ids(cls, pool: Any, ids: tuple[Sequence[int], ...]) -> Any:
        self = object.__new__(cls)
        self._ids = tuple(ids)
        self._pool = pool
        self._blocks = None
        return self

    def _views(self) -> tuple[Sequence[KVCacheBlock], ...]:
        b = self._blocks
        if b is None:
            view = self._pool._view
            b = tuple([view(i) for i in group] for group in self._ids)  # type: ignore[union-attr]
            # HiSparse: the source group's ids are host-pool ids (kvblock.vllm.hisparse.bind)
            host = getattr(self._pool, "_hisparse_group_view", None)
            if host is not None and host[0] < len(b):
                g, host_view = host[0], host[1]()
                b = (*b[:g], [host_view(i) for i in self._ids[g]], *b[g + 1 :])  # type: ignore[index]
            self._blocks = b
        return b

    blocks = property(_views, doc="``blocks[g][j]``: the ``j``-th block of group ``g`` (views made on first use).")

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """``tuple[list[int], ...]`` of block ids per group (None if ``allow_none`` and every
        selected group is empty)."""
        # vLLM's scheduler calls get_block_ids(allow_none=True) on every running request's
        # new blocks every step, mostly the shared empty result: no generator, no per-group
        # isinstance (a generator expression cost twice vLLM's own method here)
        ids = self._ids
        if ids is None:  # blocks assigned as objects (vLLM's class only): vLLM's own method
            return super().get_block_ids(allow_none, group_ids=group_ids)  # type: ignore[misc]
        if group_ids is not None:
            ids = tuple([ids[g] for g in group_ids])
        if allow_none and not any(ids):  # every group empty (a group's truth is its length)
            return None
        if len(ids) == 1:
            g = ids[0]
            return (g.tolist() if type(g) is _BlockIds else list(g),)
        return tuple([g.tolist() if type(g) is _BlockIds else list(g) for g in ids])


# vLLM's scheduler calls get_block_ids(allow_none=True) on every scheduled request's new blocks
# every step, in its own code outside the manager's calls: a METH_FASTCALL method of the Rust
# core answers get_block_ids(), (b) and (allow_none=b) with a bool b on ids held as BlockIds /
# lists / tuples, as the method above does, and calls the method above for anything else
# (rust/src/py/fast/block_ids_method.rs)
_get_block_ids_py = IdsBackedBlocks.get_block_ids
IdsBackedBlocks.get_block_ids = _core._fast_get_block_ids(  # type: ignore[method-assign]
    IdsBackedBlocks, _get_block_ids_py
)


class KVCacheBlocks(IdsBackedBlocks):
    """vLLM's allocation result: ``blocks[g][j]`` is the ``j``-th block of group ``g``.

    Backed by block ids (a ``kvblock._core.BlockIds`` when the manager made it: no Python int
    per block until they are read); ``blocks`` builds
    :class:`~kvblock.block_pool.KVCacheBlock` views on first use (:class:`IdsBackedBlocks`).
    """

    __slots__ = ("_ids", "_pool", "_blocks")

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self._blocks = tuple(blocks)
        self._ids = tuple([b.block_id for b in group] for group in self._blocks)
        self._pool = next((b._pool for group in self._blocks for b in group), None)

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        ids = tuple(list(itertools.chain(a, b)) for a, b in zip(self._ids, other._ids))
        return KVCacheBlocks._from_ids(self._pool or other._pool, ids)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a block hash (single group)."""
        if len(self._ids) != 1:
            raise ValueError("Only one group is supported")
        return [b for b in self._ids[0] if self._pool.block_hash(b) is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, the ids of the blocks without a block hash (null blocks left out): the
        blocks not cached yet.
        """
        return [[b for b in g if b != 0 and self._pool.block_hash(b) is None] for g in self._ids]

    def new_empty(self) -> "KVCacheBlocks":
        """A ``KVCacheBlocks`` with the same number of groups, each empty."""
        return KVCacheBlocks._from_ids(self._pool, tuple(() for _ in self._ids))

    def __len__(self) -> int:
        return len(self._ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlocks) and self.get_block_ids() == other.get_block_ids()

    def __repr__(self) -> str:
        return f"KVCacheBlocks(block_ids={self.get_block_ids()})"


def _check_flags(**flags: Any) -> None:
    """The constructor's on/off arguments must be bools (numpy's included): anything else is
    a ``TypeError`` naming the argument (an int or a string is more likely a misplaced
    argument than a choice)."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}: must be a bool, got {type(value).__name__} {value!r}")


def _request_attr(request: Any, name: str) -> Any:
    """``request.<name>``; a ``TypeError`` naming ``request`` when it has no such attribute
    (None, a request id given for the request), in the words of the core's request checks."""
    try:
        return getattr(request, name)
    except AttributeError:
        raise TypeError(f"request: expected a request with a `{name}` attribute, got {type(request).__name__}") from None


#: The most blocks a pool holds (block ids are int32).
_MAX_BLOCKS = 2**31 - 1


def _check_num_blocks(num_blocks: Any) -> None:
    """``num_blocks`` is an int > 0 (the error names it as the caller passed it, not the
    pool's ``num_gpu_blocks``)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        raise TypeError(f"num_blocks: must be an int, got {type(num_blocks).__name__}")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks: must be > 0 (block 0 is the null block), got {num_blocks}")
    if num_blocks > _MAX_BLOCKS:
        raise ValueError(f"num_blocks: {num_blocks} exceeds the int32 block-id range (at most {_MAX_BLOCKS})")


def _check_own_arguments(
    groups: Sequence[KVCacheGroupSpec], enable_caching: bool, max_model_len: Any, dcp: Any, pcp: Any
) -> None:
    """What kvblock's own constructor refuses before anything is built (kvblock.vllm takes
    vLLM's arguments as vLLM does): counts that are not positive ints, each named, and
    cross attention with prefix caching on (never cached: vLLM turns prefix caching off for
    encoder-decoder models, and its cross-attention manager raises on every lookup)."""
    if max_model_len is not None:
        _positive("max_model_len", max_model_len)
    _positive("dcp_world_size", dcp)
    _positive("pcp_world_size", pcp)
    if enable_caching:
        for i, g in enumerate(groups):
            if isinstance(g.kv_cache_spec, CrossAttentionSpec):
                raise ValueError(
                    f"kv_cache_groups[{i}]: cross attention is never prefix-cached; "
                    "build an encoder-decoder model's manager with enable_caching=False"
                )


class KVCacheManager(_core.KVCacheManagerCore):
    """vLLM 0.33.0's ``KVCacheManager`` over kvblock's Rust core, for any engine.

    Two ways to build one:

    * one group: ``KVCacheManager(num_blocks, block_size)`` (full attention, or sliding
      window with ``sliding_window=``);
    * any model: ``KVCacheManager(num_blocks, kv_cache_groups=[FullAttentionSpec(16),
      SlidingWindowSpec(16, sliding_window=4096), MambaSpec(64, mamba_cache_mode="align")])``
      (:mod:`kvblock.specs`): one pool, one manager per group, a hit is the longest prefix
      every group agrees on.

    Args:
        num_blocks: blocks in the pool (block 0 is the null block), shared by all groups.
        block_size: tokens per block of the one group (with no ``kv_cache_groups``).
        kv_cache_groups: the groups' specs (or :class:`kvblock.specs.KVCacheGroupSpec`).
        hash_block_size: tokens per block hash (default: vLLM's rule, see
            :func:`kvblock.specs.resolve_block_sizes`; must divide every cacheable group's
            block size).
        scheduler_block_size: the scheduling granularity (default: the LCM of the groups'
            block sizes).
        enable_caching: prefix caching on/off.
        hash_algo: ``"sha256"`` (default), ``"sha256_cbor"``, ``"xxhash"`` or
            ``"xxhash_cbor"``; sets :attr:`request_block_hasher`, which chains from
            :attr:`none_hash`, this algorithm's root (:func:`kvblock.hashing.none_hash_for`),
            fixed for the manager's life: managers of other algorithms never change it.
        max_model_len: longest sequence (tokens); a longer request is refused (ValueError);
            slots asked for past it (lookahead) are not allocated.
        max_in_flight_tokens: tokens scheduled but not yet settled (the sliding-window and
            chunked-local admission cap; default ``max_model_len``).
        log_stats: keep :class:`PrefixCacheStats`.
        enable_kv_cache_events: record KV events for :meth:`take_events`.
        use_eagle: drop the last hit block of EAGLE groups (EAGLE needs its hidden states).
        watermark: fraction of blocks (in [0, 1]) kept free when admitting waiting/preempted
            requests.
        sliding_window: with one group, make it sliding-window attention of this window.
        digest_memo_blocks: slots of :attr:`request_block_hasher`'s digest memo (None: the
            default for the block size; 0: none).
        num_hash_lookahead_tokens: tokens after each block its hash covers (EAGLE successor
            hashing).
        num_prefill_lookahead: multi-module MTP's prefill lookahead.
        prefix_cache_retention_interval: sparse sliding-window / Mamba retention (vLLM's
            ``kv_cache_config.prefix_cache_retention_interval``).
        dcp_world_size, pcp_world_size: context-parallel world sizes (full attention).
        enable_mamba_shared_prefix_checkpoint: checkpoint Mamba states at shared-prefix
            junctions (EAGLE Mamba "align" groups).
        priority_retention: evict by retention priority (TensorRT-LLM's 0–100 scale) before
            recency: the free queue becomes one LRU list per priority and eviction takes the
            least recently used block of the lowest priority present (O(1) per block).
            Priorities come from each request's ``retention`` (``[(start, end, priority,
            duration_s)]`` token ranges) and ``retention_priority`` (the rest of its tokens),
            read when the manager first admits it and applied to its blocks when it is freed
            (a block keeps the highest priority its holders asked for); a priority decays to
            the default ``duration_s`` seconds after release (lazily, by buckets of
            ``decay_granularity_s``). Off (the default): vLLM 0.33.0's LRU order exactly, and
            requests' retention fields are not read.
        default_retention_priority: the priority of blocks no request asked more of (35).
        decay_granularity_s: width of the decay time buckets (seconds, > 0): a priority ends
            at most this late.
        max_pinned_fraction: cap on the blocks :meth:`pin_prefix` may hold, as a fraction of
            the pool (``[0, 1]``).
        clock: ``clock() -> seconds`` read by priority decay and pin TTLs (default
            ``time.monotonic``); inject one in tests.
        verify_hits: verify every prefix hit against the exact content of the blocks it
            returns, so that a collision of the chained block hash (``xxhash``'s 128 bits, or a
            custom hasher) can never hand a request another prompt's KV (vLLM PR #54727 asks
            for this). Each cached block keeps, in Rust, its token ids, an exact encoding of its
            extra keys (multimodal, LoRA, cache salt, EAGLE lookahead tokens) and its parent's
            identity (a content id that is never reused); a hit is verified block by block
            from block 0, so parent equality follows by induction (see
            ``rust/src/manager/hit_verify.rs``). The first block that differs ends the hit
            there, exactly as if its hash had not been found, and counts in
            :attr:`hit_verification_failures`; never an exception. Applies to
            :meth:`get_computed_blocks`, :meth:`admit_batch` and :meth:`probe` (which
            counts nothing); :meth:`pin_prefix` hands out no KV and is not verified. Costs
            ``8 * block_size`` bytes per block and a comparison of the hit tokens per lookup.
            Every prefix-cacheable group must be full attention at the hash block size
            (``ValueError`` otherwise: sliding-window, chunked-local and Mamba hits skip the
            blocks a parent chain is verified through). Off (the default): nothing is kept or
            checked, vLLM 0.33.0's behaviour.

    Raises:
        ValueError: ``num_blocks <= 0``, a spec or argument vLLM rejects (block sizes that do
            not divide, an empty group list, Mamba prefix caching outside "align" mode, ...),
            an unknown ``hash_algo``, a ``digest_memo_blocks`` out of range; nothing is built
            and no global state changes.
        TypeError: ``kv_cache_groups`` that are not kvblock specs.

    A method given a request whose id UTF-8 cannot encode (a lone surrogate) raises
    ``ValueError`` naming ``request_id`` and changes nothing.
    """

    # Set in __new__ (the Rust base is built there).
    request_block_hasher: Callable[[Any], list[hashing.BlockHash]]
    hash_fn: hashing.HashFunction
    none_hash: hashing.BlockHash
    enable_caching: bool
    enable_kv_cache_events: bool
    log_stats: bool
    use_eagle: bool
    sliding_window: int | None
    num_kv_cache_groups: int
    hash_block_size: int
    kv_cache_spec_kind: str
    prefix_cache_stats: PrefixCacheStats | None
    empty_kv_cache_blocks: KVCacheBlocks

    if TYPE_CHECKING:
        # The scheduler calls are the Rust base's (``_core.pyi`` types them loosely, as the
        # base cannot name these Python classes); their types as this class has them.
        @property
        def block_pool(self) -> BlockPool: ...

        def get_computed_blocks(self, request: Request | Any) -> tuple[KVCacheBlocks, int, int]: ...

        def allocate_slots(
            self,
            request: Request | Any,
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
            skip_zeroing_group_ids: Sequence[int] | None = None,
        ) -> KVCacheBlocks | None: ...

        def allocate_slots_batch(
            self,
            requests: list[Request] | list[Any],
            num_new_tokens: int | Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
            num_lookahead_tokens: int = 0,
        ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...

        def admit_batch(
            self, requests: list[Request] | list[Any], num_lookahead_tokens: int = 0, has_scheduled_reqs: bool = True
        ) -> tuple[int, npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...

        def free(self, request: Request | Any) -> None: ...

        def probe(self, request: Request | Any, max_cache_hit_length: int | None = None) -> int: ...

        def cache_blocks(self, request: Request | Any, num_computed_tokens: int) -> None: ...

    def __new__(
        cls,
        num_blocks: int,
        block_size: int | None = None,
        *,
        kv_cache_groups: Sequence[Any] | None = None,
        hash_block_size: int | None = None,
        scheduler_block_size: int | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        max_model_len: int | None = None,
        max_in_flight_tokens: int | None = None,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        use_eagle: bool = False,
        watermark: float = 0.0,
        sliding_window: int | None = None,
        digest_memo_blocks: int | None = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        prefix_cache_retention_interval: int | None = None,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        priority_retention: bool = False,
        default_retention_priority: int = 35,
        decay_granularity_s: float = 1.0,
        max_pinned_fraction: float = 0.25,
        clock: Callable[[], float] | None = None,
        verify_hits: bool = False,
    ) -> "KVCacheManager":
        _check_num_blocks(num_blocks)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float, np.integer, np.floating)):
            raise TypeError(f"watermark: a fraction of the blocks (a float in [0, 1]), got {type(watermark).__name__}")
        if not 0 <= watermark <= 1:  # NaN too
            raise ValueError(f"watermark: a fraction of the blocks, must be in [0, 1], got {watermark}")
        _check_flags(
            enable_caching=enable_caching,
            log_stats=log_stats,
            enable_kv_cache_events=enable_kv_cache_events,
            use_eagle=use_eagle,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
            priority_retention=priority_retention,
            verify_hits=verify_hits,
        )
        if kv_cache_groups is None:
            if block_size is None:
                raise TypeError("KVCacheManager: give block_size (one group) or kv_cache_groups")
            spec = SlidingWindowSpec(block_size, sliding_window) if sliding_window is not None else FullAttentionSpec(block_size)
            groups = [KVCacheGroupSpec(spec)]
        else:
            if block_size is not None or sliding_window is not None:
                raise ValueError("block_size / sliding_window: give them in kv_cache_groups' specs")
            groups = _groups(kv_cache_groups)
        _check_own_arguments(groups, enable_caching, max_model_len, dcp_world_size, pcp_world_size)
        sched, h = resolve_block_sizes(groups, enable_caching, hash_block_size, dcp_world_size)
        if scheduler_block_size is not None:
            sched = scheduler_block_size
        hash_fn = hashing.get_hash_fn_by_name(hash_algo)
        pool = BlockPool(
            num_blocks, enable_caching, h, enable_kv_cache_events, num_hash_lookahead_tokens=num_hash_lookahead_tokens
        )
        # the root is this manager's: nothing global changes (kvblock.hashing.none_hash_for)
        none_hash = hashing.none_hash_for(hash_fn)
        request_block_hasher = hashing.get_request_block_hasher(
            int(h), hash_fn, num_hash_lookahead_tokens, digest_memo_blocks=digest_memo_blocks, none_hash=none_hash
        )
        mml = DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len
        if clock is not None and not callable(clock):
            raise TypeError("clock: must be a callable returning seconds")
        self = super().__new__(
            cls,
            pool,
            core_groups(groups),
            mml,
            sched,
            h,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            watermark_blocks=int(watermark * num_blocks),
            needs_kv_cache_zeroing=any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups),
            retention_interval=prefix_cache_retention_interval,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
            caller="kvblock",
            priority_retention=priority_retention,
            default_retention_priority=default_retention_priority,
            decay_granularity_s=decay_granularity_s,
            clock=time.monotonic if clock is None else clock,
            max_pinned_fraction=max_pinned_fraction,
            verify_hits=verify_hits,
            hit_extra_keys=hashing._request_extra_keys if verify_hits else None,
        )
        self.hash_fn = hash_fn
        self.kv_cache_groups = groups
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.use_eagle = use_eagle
        self.sliding_window = sliding_window
        self.hash_block_size = h
        self.scheduler_block_size = sched
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.kv_cache_event_metadata = tuple(
            (g.kv_cache_spec.spec_kind, g.kv_cache_spec.sliding_window) for g in groups
        )
        self.empty_kv_cache_blocks = KVCacheBlocks._from_ids(self.block_pool, tuple(() for _ in groups))
        self._init_python(
            self.empty_kv_cache_blocks,
            KVCacheBlocks,
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            Request,
        )
        #: The root this manager's request hasher chains from (its algorithm's, fixed).
        self.none_hash = none_hash
        self.request_block_hasher = request_block_hasher
        return self

    # -- beyond vLLM: pinned prefixes (probe(request) is inherited from the Rust core) ----------
    def _prefix_hashes(
        self, prefix: Sequence[int] | Sequence[bytes], lora_request: Any = None, cache_salt: str | None = None
    ) -> list[bytes]:
        items = list(prefix)
        if items and all(isinstance(x, bytes) for x in items):
            if lora_request is not None or cache_salt is not None:
                raise ValueError("lora_request / cache_salt: give them with token ids, block hashes already hold them")
            return items
        if any(isinstance(x, bytes) for x in items):
            raise TypeError("prefix: token ids or block hashes (bytes), not a mix")
        req = Request(
            "kvblock-pin", items, lora_request=lora_request, cache_salt=cache_salt,
            block_hasher=self.request_block_hasher,
        )
        return list(req.block_hashes)

    def pin_prefix(
        self,
        prefix: Sequence[int] | Sequence[bytes],
        ttl_s: float | None = None,
        *,
        lora_request: Any = None,
        cache_salt: str | None = None,
    ) -> int:
        """Pin a prefix's cached blocks against eviction.

        ``prefix``: token ids (hashed with :attr:`request_block_hasher`, with ``lora_request``
        / ``cache_salt`` as a request would be) or the prefix's block hashes (bytes, one per
        full block of ``hash_block_size`` tokens). The longest cached part of it (every
        group's hit blocks, as :meth:`get_computed_blocks` finds them) gets one reference
        that no request owns: those blocks are never evicted until :meth:`unpin_prefix` or
        the TTL (``ttl_s`` seconds on the manager's clock, None: none) ends, whatever the
        requests that made them do. Pinned blocks are not free (``get_num_free_blocks``
        excludes them). The pin is named by the prefix's last full block hash: pinning it
        again restarts its TTL and takes in blocks cached since. Pinned blocks are in use, so
        :meth:`reset_prefix_cache` fails (False) while any pin is held. A TTL runs out at the
        first manager call at or after its end.

        Returns the pinned tokens (a multiple of the block size; 0, pinning nothing, when no
        block of the prefix is cached).

        Raises, changing nothing: ``ValueError`` for a prefix without a full block, a
        negative or non-finite TTL, caching off, or when the distinct pinned blocks would
        exceed ``max_pinned_fraction`` of the pool; ``TypeError`` for a prefix mixing token
        ids and hashes.
        """
        return self._pin_prefix(self._prefix_hashes(prefix, lora_request, cache_salt), ttl_s)

    def unpin_prefix(
        self, prefix: Sequence[int] | Sequence[bytes], *, lora_request: Any = None, cache_salt: str | None = None
    ) -> int:
        """Release a pin made by :meth:`pin_prefix` (same prefix): its blocks go back to the free
        queue (tail first) unless requests hold them. Returns the tokens it held.

        Raises ``ValueError``, changing nothing, if the prefix is not pinned (or its TTL
        ran out)."""
        return self._unpin_prefix(self._prefix_hashes(prefix, lora_request, cache_salt))

    @property
    def pinned_prefixes(self) -> list[tuple[bytes, int, list[int], float | None]]:
        """The pins: ``(last block hash, pinned tokens, block ids, expires_at or None)``,
        sorted by hash (``expires_at`` in the clock's seconds)."""
        return self._pins()

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks pins hold."""
        return self._pinned_blocks[0]

    @property
    def max_pinned_blocks(self) -> int:
        """The cap on :attr:`num_pinned_blocks` (``floor(max_pinned_fraction * (num_blocks - 1))``)."""
        return self._pinned_blocks[1]

    # -- vLLM's KVCacheManager API (the scheduler calls are inherited from the Rust core) -------
    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1] (``1 - free / (num_blocks - 1)``)."""
        return self.block_pool.get_usage()

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """True if ``request`` reads the prefix cache: caching is on and its
        ``skip_reading_prefix_cache`` is false (vLLM's rule; stats count only such requests).
        """
        skip = _request_attr(request, "skip_reading_prefix_cache")
        return self.enable_caching and not skip

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Record one admission: ``queries += request.num_tokens``, ``hits += num_hits``
        (or the ``preempted_*`` counters for a preempted request). No-op unless ``log_stats``
        and the request reads the prefix cache.

        Raises (the stats unchanged):
            TypeError: ``request`` is not a request (None, a request id: no
                ``skip_reading_prefix_cache``, ``num_tokens`` or ``num_preemptions``), or
                ``num_hits`` is not an int; each named.
            ValueError: ``num_hits`` negative, or more than ``request.num_tokens``.
        """
        hashing._count_arg("num_hits", num_hits, 0)
        if not self.prefix_cache_lookup_enabled(request) or not self.log_stats:
            return
        num_tokens = _request_attr(request, "num_tokens")
        preempted = _request_attr(request, "num_preemptions") > 0
        self.prefix_cache_stats.record(num_tokens=num_tokens, num_hits=num_hits, preempted=preempted)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The current stats (None without ``log_stats``); a fresh object takes their place."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Clear every cache key if no block is in use (then ``prefix_cache_stats.reset`` is
        set); False, with no change, otherwise."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's KV events, each ``BlockStored`` annotated with its group's spec kind and
        sliding window (as vLLM's manager does)."""
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for e in events:
            if isinstance(e, BlockStored) and e.group_idx is not None and 0 <= e.group_idx < len(meta):
                e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window = meta[e.group_idx]
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks, one list per group (empty if unknown)."""
        return self.create_kv_cache_blocks(tuple(self._block_ids(request_id)))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group, in table order."""
        return tuple(self._block_ids(request_id))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33.0 (cascade attention was removed): always zeros."""
        return [0] * self.num_kv_cache_groups

    def evict_blocks(self, block_ids: Any) -> None:
        """Drop the cache keys of these blocks."""
        self.block_pool.evict_blocks(block_ids)

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """The request's blocks (every group, allocation order, leading null blocks trimmed);
        the request is forgotten and the caller frees the blocks (reversed)."""
        view = self.block_pool._view
        return [view(b) for b in self._pop_blocks_for_free(request)]

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[KVCacheBlock]]:
        """The pending copy-on-write copies ``(src_block_id, dst_block_id)`` of partial hits,
        and the blocks retained until they ran (both ends of each copy)."""
        pairs = self._take_kv_cache_block_copies()
        view = self.block_pool._view
        return list(pairs), [view(b) for pair in pairs for b in pair]

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks:
        """``KVCacheBlocks`` of these per-group blocks (or ids); the shared empty instance when
        every group is empty."""
        if all(len(g) == 0 for g in blocks):
            return self.empty_kv_cache_blocks
        ids = tuple([b if isinstance(b, int) else b.block_id for b in g] for g in blocks)
        return KVCacheBlocks._from_ids(self.block_pool, ids)

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.block_pool.num_gpu_blocks}, groups={self.num_kv_cache_groups}, "
            f"block_size={self.block_size}, free={self.block_pool.get_num_free_blocks()}, "
            f"requests={self.num_requests})"
        )
