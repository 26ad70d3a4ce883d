"""``kvblock.vllm.KVCacheManager``: vLLM 0.33.0's ``KVCacheManager`` with kvblock's Rust core
behind vLLM's exact constructor, methods and result types.

It is built from vLLM's ``KVCacheConfig`` and works on vLLM's own ``Request`` objects. Its
``block_pool`` is kvblock's :class:`~kvblock.block_pool.BlockPool` (vLLM's object API over the
Rust pool), its ``coordinator`` a view of the Rust coordinator; both are views, not copies.
A configuration kvblock does not manage (see :func:`kvblock.vllm.describe`) gets vLLM's own
manager instead, with one warning naming the reason (``KVBLOCK_VLLM_STRICT=1``: an error).
"""

from __future__ import annotations

import inspect
import logging
import operator
from typing import Any, Sequence

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.utils.math_utils import cdiv
from vllm.v1.core import kv_cache_manager as _vkm
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    MambaSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from .. import _core
from ..block_pool import KVCacheBlock
from .block_pool import BlockPool
from .blocks import KVCacheBlocks
from .config import env_flag, translate
from .coordinator import HybridCoordinatorView, make_coordinator
from .originals import original
from .releases import current as _current_release

#: The installed vLLM release (kvblock.vllm.releases): what differs between releases.
RELEASE = _current_release()

__all__ = ["KVCacheManager", "UnsupportedConfiguration"]

#: A child of vLLM's "vllm" logger: its lines print as vLLM's own do ("WARNING 12-02 10:00:00
#: [manager.py:59] ..."), through the handlers vLLM configures; with VLLM_CONFIGURE_LOGGING=0
#: they reach the application's logging configuration instead.
logger = logging.getLogger("vllm.kvblock")

#: vLLM's own manager class (read before any patching), for the fallback.
VllmKVCacheManager = original(_vkm, "KVCacheManager")

_warned: set[str] = set()


class UnsupportedConfiguration(ValueError):
    """A KV-cache configuration kvblock does not manage, with ``KVBLOCK_VLLM_STRICT=1``."""


def _fallback(reason: str) -> None:
    if env_flag("KVBLOCK_VLLM_STRICT"):
        raise UnsupportedConfiguration(f"kvblock does not manage this KV cache configuration: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("kvblock: using vLLM's own KV cache manager: %s", reason)
    fallback_counter[0] += 1


#: ``[number of managers that fell back, number built on kvblock]`` in this process.
fallback_counter = [0]
kvblock_counter = [0]


class KVCacheManager(_core.KVCacheManagerCore):
    """vLLM 0.33.0's ``KVCacheManager`` on kvblock's Rust core (same constructor).

    Args are vLLM's: ``kv_cache_config`` (vLLM's ``KVCacheConfig``), ``max_model_len``,
    ``scheduler_block_size`` (tokens; a multiple of every group's block size),
    ``hash_block_size`` (tokens per block hash; divides every cacheable group's block size),
    ``max_in_flight_tokens`` (default ``max_model_len``), ``enable_caching``, ``use_eagle``,
    ``num_hash_lookahead_tokens``, ``num_prefill_lookahead``, ``log_stats``,
    ``enable_kv_cache_events``, ``dcp_world_size``, ``pcp_world_size``, ``metrics_collector``
    (vLLM's ``KVCacheMetricsCollector``: the Rust pool records its residency metrics, see
    :mod:`kvblock.vllm.metrics`; with a HiSparse host tier the host pool records into a
    collector of its own at the same ``sample_rate``, as vLLM's ``bind_host_pool`` makes it),
    ``watermark`` (fraction of blocks),
    ``enable_mamba_shared_prefix_checkpoint``.

    Returns vLLM's own ``KVCacheManager`` for a configuration kvblock does not manage.

    Raises:
        AssertionError / ValueError: where vLLM's constructor raises (block sizes that do not
            divide, Mamba prefix caching outside "align" mode, a bad retention interval...);
            with a HiSparse host tier also where vLLM's ``bind_host_pool`` raises (the
            ``AssertionError`` of a ``metrics_collector.sample_rate`` outside ``(0, 1]``, which
            vLLM raises at its first ``get_hisparse_coordinator``), nothing built.
        UnsupportedConfiguration: an unsupported configuration with ``KVBLOCK_VLLM_STRICT=1``.

    Bad input to its methods: where vLLM's manager raises, the same exception type
    (``AttributeError`` for an object lacking a request attribute, ``IndexError`` past a
    request's hashes or table, ``AssertionError`` for vLLM's protocol checks, ...), and
    nothing changes, also where vLLM changes its state before it raises. Arguments are read as
    vLLM's method bodies read them: a bool count is 0 or 1, a flag counts by its truth value, a
    non-``str`` id is an unknown request in by-id lookups. A count that is not an int in
    ``[0, 2**63)`` (a float, a negative or huge int), which vLLM would act on wrongly, is a
    ``TypeError`` / ``ValueError`` naming the argument (past 64 bits
    :class:`kvblock.IntOutOfRangeError`, also vLLM's ``OverflowError``), changing nothing (docs/proof.md,
    "Where kvblock deliberately differs from vLLM 0.33.0"; ``tests/test_vllm_bad_input.py``).
    """

    # KVCacheManagerCore's allocate_slots and cache_blocks behind fastcall entries: the call
    # shapes vLLM's scheduler uses for every running request every step
    # (``allocate_slots(request, n, num_lookahead_tokens=k)``, ``cache_blocks(request, n)``)
    # run the method's own steps without PyO3's argument matching; any other call is passed
    # to the method (rust/src/py/fast_entry.rs)
    allocate_slots = _core._fast_entry("allocate_slots")
    cache_blocks = _core._fast_entry("cache_blocks")

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # the installed release's own constructor signature (its positions shift between
        # releases: 0.32 has no num_hash_lookahead_tokens), with its defaults
        a = _vllm_arguments(args, kwargs)
        kv_cache_config, metrics_collector = a["kv_cache_config"], a["metrics_collector"]
        max_in_flight_tokens, enable_caching, use_eagle = a["max_in_flight_tokens"], a["enable_caching"], a["use_eagle"]
        log_stats, enable_kv_cache_events, watermark = a["log_stats"], a["enable_kv_cache_events"], a["watermark"]
        enable_mamba_shared_prefix_checkpoint = a["enable_mamba_shared_prefix_checkpoint"]
        # vLLM takes bools and numpy ints where it takes ints
        max_model_len, scheduler_block_size, hash_block_size = (
            operator.index(a["max_model_len"]), operator.index(a["scheduler_block_size"]), operator.index(a["hash_block_size"])
        )
        num_hash_lookahead_tokens = operator.index(a.get("num_hash_lookahead_tokens", 0))
        num_prefill_lookahead = operator.index(a["num_prefill_lookahead"])
        dcp_world_size, pcp_world_size = operator.index(a["dcp_world_size"]), operator.index(a["pcp_world_size"])
        path = translate(
            kv_cache_config, dcp_world_size, pcp_world_size, metrics_collector, bool(enable_caching), bool(use_eagle)
        )
        if not path.on_kvblock:
            _fallback(path.reason)
            # by keyword, as the installed release names them
            return VllmKVCacheManager(**a)
        assert watermark >= 0.0, "watermark must be non-negative"
        host_collector = None
        if path.hisparse_host_num_blocks is not None:
            # vLLM's bind_host_pool gives the host pool a collector of its own; made before
            # anything is built, so that a rate its constructor refuses raises with nothing built
            from .hisparse import host_metrics_collector

            host_collector = host_metrics_collector(metrics_collector)
        pool = BlockPool._for_manager(
            num_gpu_blocks=kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=None,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        )
        # the core raises vLLM's own types for vLLM's callers (spec::Caller::Vllm): its
        # ValueErrors (prefix_cache_retention_interval, multi-module MTP) as ValueErrors with
        # vLLM's message, what vLLM asserts as AssertionErrors
        self = super().__new__(
            cls,
            pool,
            path.groups,
            max_model_len,
            scheduler_block_size,
            hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            watermark_blocks=int(watermark * kv_cache_config.num_blocks),
            needs_kv_cache_zeroing=kv_cache_config.needs_kv_cache_zeroing,
            retention_interval=kv_cache_config.prefix_cache_retention_interval,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
            release_rules=RELEASE.core_rules(),
            hisparse_host_num_blocks=path.hisparse_host_num_blocks,
            # 0.34's coordinator takes import_step_tokens (get_hisparse_coordinator's, 0 by default)
            hisparse_import_step_tokens=0 if RELEASE.hisparse_import_reservations else None,
        )
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        if metrics_collector is not None:
            # the scheduler's collector, fed by the Rust pool from now on (translate() checked it)
            from .metrics import bind

            bind(metrics_collector, pool)
            pool.metrics_collector = metrics_collector
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.retained_hit_group_ids = ()
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        # held as (empty) ids too, so that get_block_ids() on it, which vLLM's scheduler calls
        # for most decode steps, takes the ids path; its blocks are vLLM's empty tuples
        self.empty_kv_cache_blocks = KVCacheBlocks._from_ids(pool, tuple(() for _ in kv_cache_config.kv_cache_groups))
        self.empty_kv_cache_blocks._blocks = tuple(() for _ in kv_cache_config.kv_cache_groups)
        self._init_python(
            self.empty_kv_cache_blocks,
            KVCacheBlocks,
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            Request,
            hit_limit_field=RELEASE.hit_limit_field,
        )
        self.coordinator = make_coordinator(self, kv_cache_config)
        if host_collector is not None:
            from .hisparse import bind_host_metrics

            bind_host_metrics(self, host_collector)
        self.mamba_shared_prefix_checkpoint = self._coordinator_info()["mamba_shared_prefix_checkpoint"]
        kvblock_counter[0] += 1
        if kvblock_counter[0] == 1:
            # one line per process, so an operator can tell kvblock is in use
            from .. import __version__

            logger.info(
                "kvblock %s manages the KV cache (vLLM %s; %d KV cache group(s), %d blocks)",
                __version__, RELEASE.series, len(kv_cache_config.kv_cache_groups), kv_cache_config.num_blocks,
            )
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # built in __new__

    # -- stats ---------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """vLLM's ``usage``: the fraction of the pool's blocks in use, in [0, 1] (the null
        block not counted)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's: the prefix-cache stats recorded since the last call (a fresh
        ``PrefixCacheStats`` takes their place), or None when ``log_stats`` is off."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """vLLM's: caching on, and the request reads the cache (0.32 / 0.33:
        ``not request.skip_reading_prefix_cache``; 0.34: ``request.prefix_cache_hit_limit != 0``)."""
        if RELEASE.hit_limit_field == "prefix_cache_hit_limit":
            return self.enable_caching and request.prefix_cache_hit_limit != 0
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM 0.34's probe for cache-aware admission: how many of the request's tokens the
        prefix cache holds (the hit ``get_computed_blocks`` would find, bounded by
        ``request.num_tokens - 1`` but not by the request's hit limit, as in vLLM), touching
        nothing: no reference count, LRU position, stats or event changes. 0 when the request
        does not read the cache. Raises ``AttributeError`` on vLLM releases before 0.34 (they
        have no such method)."""
        if not RELEASE.num_cached_tokens_probe:
            raise AttributeError(f"'KVCacheManager' object has no attribute 'get_num_cached_tokens' (vLLM {RELEASE.series})")
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        return self.probe(request, request.num_tokens - 1)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """vLLM's: count one lookup of ``request.num_tokens`` tokens that hit ``num_hits``
        (tokens), as a preempted request's when it was preempted; nothing when ``log_stats``
        is off or the request does not read the cache."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    # -- lookups -------------------------------------------------------------------------------
    if not RELEASE.lookup_bound:
        # vLLM 0.32's lookups take the request alone (0.33 added the bound)

        def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:  # type: ignore[override]
            """vLLM 0.32's ``get_computed_blocks(request)``: the longest cached prefix, at most
            ``request.num_tokens - 1`` tokens; see the core's method."""
            return _core.KVCacheManagerCore.get_computed_blocks(self, request)  # type: ignore[no-any-return]

        def get_computed_blocks_for_connector(self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
            """vLLM 0.32's ``get_computed_blocks_for_connector(request)``."""
            return self._computed_blocks_for_connector(request, None)

    else:

        def get_computed_blocks_for_connector(
            self, request: Request, max_cache_hit_length: int | None = None
        ) -> tuple[KVCacheBlocks, int, int, bool]:
            """vLLM's ``get_computed_blocks_for_connector``: for hybrid Mamba models, the
            full-attention hit and whether a group hit less (a partial hit); otherwise
            ``get_computed_blocks`` and False."""
            return self._computed_blocks_for_connector(request, max_cache_hit_length)

    def _computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        coordinator = self.coordinator
        if not (
            self.kv_cache_config.has_mamba_layers
            and isinstance(coordinator, HybridCoordinatorView)
            and coordinator.full_attention_group_id is not None
        ):
            return *self._lookup(request, max_cache_hit_length), False
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if RELEASE.hit_limit_field == "prefix_cache_hit_limit":
            max_cache_hit_length = request.get_max_cache_hit_length(max_cache_hit_length)
        elif max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        fa = coordinator.full_attention_group_id
        groups, per_group = self._find_longest_cache_hit_per_group(request.block_hashes, max_cache_hit_length)
        if any(hit > per_group[fa] for hit in per_group):
            return *self._lookup(request, max_cache_hit_length), False
        num_local = per_group[fa]
        blocks = self.create_kv_cache_blocks(tuple(groups))
        return blocks, num_local, 0, min(per_group) < num_local

    def _lookup(self, request: Request, max_cache_hit_length: int | None) -> tuple[KVCacheBlocks, int, int]:
        if max_cache_hit_length is None:
            return _core.KVCacheManagerCore.get_computed_blocks(self, request)  # type: ignore[no-any-return]
        return _core.KVCacheManagerCore.get_computed_blocks(self, request, max_cache_hit_length)  # type: ignore[no-any-return]

    # -- the rest of vLLM's API ----------------------------------------------------------------
    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """vLLM's: remove the request's block tables and return their blocks in the order
        ``free`` would release them (tail first, every group), without freeing them; the
        caller frees them (``block_pool.free_blocks``). With HiSparse, the host tier's blocks
        are spilled first, as vLLM's coordinator does."""
        if self._hisparse_host_free_blocks is not None:
            from .hisparse import pop_blocks_for_free

            return pop_blocks_for_free(self, request)
        view = self.block_pool._view
        return [view(b) for b in self._pop_blocks_for_free(request)]

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's: drop the cached hashes of ``block_ids`` (ints; uncached blocks are
        skipped, blocks in use stay allocated), as when a connector reports their KV lost.
        An id past the pool is vLLM's ``AssertionError``, nothing evicted (see
        ``BlockPool.evict_blocks``)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block (each pool, HiSparse's host pool too); False,
        and nothing changed, while any block other than the null block is in use. Marks the
        stats reset when ``log_stats`` is on."""
        if self._hisparse_host_free_blocks is not None:
            # the host pool too, as vLLM's coordinator resets every group's pool
            from .hisparse import reset_prefix_cache

            ok = reset_prefix_cache(self)
        else:
            ok = self.block_pool.reset_prefix_cache()
        if not ok:
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    if RELEASE.common_prefix_blocks:

        def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
            """vLLM 0.32 / 0.33's (deprecated: cascade attention is gone): 0 per group."""
            return [0] * self.num_kv_cache_groups

    def _take_pool_events(self) -> list[KVCacheEvent]:
        # take_events (the core's) with KV events on
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if event.group_idx < 0 or event.group_idx >= len(meta):
                _vkm.logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = meta[event.group_idx]
        return events

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """vLLM's: the request's block ids, one list per KV-cache group (empty lists for an
        unknown request)."""
        return tuple(self._block_ids(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """vLLM's: per group, the request's block ids covering its first
        ``num_computed_tokens`` tokens (attention groups cut at ``cdiv(num_computed_tokens,
        block_size)``; Mamba, cross-attention and encoder-only groups whole)."""
        out: list[list[int]] = []
        for group, ids in zip(self.kv_cache_config.kv_cache_groups, self._block_ids(request_id)):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
                out.append(ids)
                continue
            out.append(ids[: cdiv(num_computed_tokens, spec.block_size)])
        return tuple(out)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """vLLM's: a ``KVCacheBlocks`` of ``blocks`` (per group, ``KVCacheBlock``s or block
        ids of this pool); the shared empty one when every group is empty."""
        if not any(blocks):
            return self.empty_kv_cache_blocks
        if all(all(isinstance(b, KVCacheBlock) for b in g) for g in blocks):
            return KVCacheBlocks(tuple(blocks))
        return KVCacheBlocks._from_ids(self.block_pool, tuple([b if isinstance(b, int) else b.block_id for b in g] for g in blocks))

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """vLLM's: a lookup's ``blocks`` cut to what ``num_computed_tokens`` tokens need, per
        group as its manager cuts them (groups that cache nothing stay empty)."""
        truncated: list[list[KVCacheBlock]] = []
        for group_blocks, manager, group in zip(
            blocks.blocks, self.coordinator.single_type_managers, self.kv_cache_config.kv_cache_groups, strict=True
        ):
            if not group.kv_cache_spec.prefix_cacheable:
                assert not group_blocks
                truncated.append([])
                continue
            assert num_computed_tokens % manager.block_size == 0
            num_blocks = num_computed_tokens // manager.block_size
            if isinstance(group.kv_cache_spec, MambaSpec):
                num_blocks = min(num_blocks, len(group_blocks))
            else:
                assert num_blocks <= len(group_blocks)
            truncated.append(list(group_blocks[:num_blocks]))
        return self.create_kv_cache_blocks(tuple(truncated))

    def _kv_cache_block_copies_of(self, pairs: list[tuple[int, int]]) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        # take_kv_cache_block_copies (the core's) when there are copies: vLLM's result types
        view = self.block_pool._view
        copies = [KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in pairs]
        return copies, [view(b) for pair in pairs for b in pair]

    def __repr__(self) -> str:
        return (
            f"kvblock.vllm.KVCacheManager(groups={self.num_kv_cache_groups}, "
            f"blocks={self.block_pool.num_gpu_blocks}, free={self.block_pool.get_num_free_blocks()})"
        )


_SIGNATURE: list[inspect.Signature] = []


def _vllm_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``KVCacheManager(...)`` call bound to the installed vLLM's own
    constructor, defaults applied, by name (``self`` left out).

    Raises:
        TypeError: as vLLM's constructor would (a missing, unknown or repeated argument).
    """
    if not _SIGNATURE:
        _SIGNATURE.append(inspect.signature(VllmKVCacheManager.__init__))
    bound = _SIGNATURE[0].bind(None, *args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    del out[next(iter(out))]
    return out


def _vllm_signature_methods() -> Sequence[str]:
    """The vLLM ``KVCacheManager`` methods kvblock implements (the drift test checks their
    signatures against the installed vLLM's)."""
    return [
        name
        for name in dir(VllmKVCacheManager)
        if not name.startswith("_") and callable(getattr(VllmKVCacheManager, name, None))
    ]


# introspection (inspect.signature, IDEs) sees the installed release's own constructor
KVCacheManager.__signature__ = inspect.signature(VllmKVCacheManager)  # type: ignore[attr-defined]
