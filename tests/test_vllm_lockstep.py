"""kvblock.vllm.KVCacheManager and vLLM 0.33.0's own KVCacheManager in lockstep.

A hypothesis state machine builds a random KV-cache configuration (1-4 groups of full
attention, MLA, R-SWA, sliding window (and its MLA form), chunked local attention, Mamba in
"none" and "align" modes, circular buffers, cross attention; block sizes that are multiples
of the hash block size; EAGLE, hash lookahead, multi-token prefill lookahead, retention
intervals, watermark, tiny pools, caching on and off) and builds it twice: vLLM's unpatched
manager (with vLLM's own block pool, coordinator and per-type managers) and kvblock's. Each
gets its own copy of the same vLLM ``Request`` objects (hashed by vLLM's own
``get_request_block_hasher``), and both are driven the way vLLM's scheduler drives a manager:
prefix-cache lookups then ``allocate_slots`` with the hit (external tokens, async loads with
delayed caching, encoder tokens, lookahead, the full-sequence gate, reserved blocks),
chunked prefill (Mamba "align" chunks split by vLLM's own scheduler rule), decode and
speculative decode steps, async scheduling with tokens in flight, preemption, finishing
(``free`` and the deferred ``pop_blocks_for_free`` path), ``remove_skipped_blocks``,
``cache_blocks``, the end of a step (``take_new_block_ids``, ``take_kv_cache_block_copies``
with the copy's retained blocks freed, boundary-state offloads, ``new_step_starts``), resets,
evictions and the read-only queries. Calls with arguments a scheduler never passes probe
the error paths.

After every step everything observable must be equal: return values (block ids per group,
hit lengths, None vs blocks), every group's ``req_to_blocks`` and ``num_cached_block``, the
Mamba "align" bookkeeping of every request, the blocks recorded for zeroing, the free queue
order, every block's ref count, hash and hashed token count, the hash -> block map (and the
blocks' further keys), the KV events (vLLM's event objects), prefix cache stats and the free
block count; with residency metrics on (a third of the configurations: vLLM's
``KVCacheMetricsCollector`` at sample rate 1.0 on each side), the sampled blocks in the
collector's dict order, the call each one was born and last accessed in and the calls of its
access history (kvblock's Rust clock against vLLM's ``time.monotonic_ns``, each timestamp
placed in the window of the call that made it), and the eviction events in order with their
number of reuse gaps. Where vLLM raises, kvblock raises the same exception type and changes nothing;
where vLLM changed its own state before raising, kvblock either made exactly the same change
(vLLM's frees outside the attention window before a refusal, its empty table) and the example
goes on, or changed nothing, and then the two can no longer be compared and the example stops
there (counted, see ``VLLM_CORRUPTED``).

``KVBLOCK_LOCKSTEP_EXAMPLES=N`` sets the number of examples (default 700, about 1.5 minutes
on two cores; the long profile is e.g. 3000); ``CI=true`` replays a fixed sequence
(derandomized). The test then checks what the run covered: every group kind, 1-4 groups,
caching off, EAGLE, tiny pools, mixed block sizes, windows smaller and larger than a block,
and errors compared.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from conftest import IN_CI, require_module

vllm = require_module("vllm")

import torch  # noqa: E402
import hypothesis  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_utils as vku  # noqa: E402
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as vst  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvblock.vllm as kv  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402
from kvblock.vllm.releases import current as _current_release  # noqa: E402

#: vLLM 0.34 bounds a request's cache hits by ``prefix_cache_hit_limit`` (prompt scoring).
HIT_LIMIT = _current_release().hit_limit_field == "prefix_cache_hit_limit"
#: vLLM 0.33+ hashes blocks with lookahead tokens; 0.32 has no such parameter.
HASH_LOOKAHEAD = _current_release().hash_lookahead
#: vLLM 0.32's Mamba prefix caching ("none" groups cache too; a partial tail is re-keyed).
MAMBA_PREFIX_CACHING_DIFFERS = _current_release().mamba_prefix_caching_differs
#: vLLM 0.32 returns leading null blocks from pop_blocks_for_free / get_blocks and counts the
#: null block's ref_cnt down; 0.33 skips it ("not maintained"): compared without the null block.
NULL_BLOCKS_COUNTED = _current_release().null_blocks_counted

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: vLLM's own hashing (the test process never patches kvblock in; checked in setup).
get_request_block_hasher = original(vku, "get_request_block_hasher")
init_none_hash = original(vku, "init_none_hash")

#: Why examples stopped early: vLLM changed its own state, then raised (so the two managers
#: can no longer be compared), keyed by the exception's type and first words.
VLLM_CORRUPTED: Counter[str] = Counter()
#: How often each rule ran and how often vLLM raised where kvblock raised the same (a
#: profile of what the run covered, printed and checked by ``test_vllm_lockstep``).
COVERAGE: Counter[str] = Counter()

TOKENS = [0, 1, 2, 3]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 50, 60, 70, 80], [7] * 16, [3, 1] * 8, []]
LORAS = [None, LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")]
SALTS = [None, None, "s1"]

A = dict(num_kv_heads=1, head_size=1)


# -- configurations ---------------------------------------------------------------------------


def _spec(kind: str, bs: int, p: dict, dtype) -> object:
    if kind == "full":
        return FullAttentionSpec(block_size=bs, dtype=dtype, **A)
    if kind == "mla":
        return MLAAttentionSpec(block_size=bs, dtype=dtype, **A)
    if kind == "rswa":
        return RSWASpec(block_size=bs, dtype=dtype, rswa_window=p["window"], **A)
    if kind == "sw":
        return SlidingWindowSpec(
            block_size=bs, dtype=dtype, sliding_window=p["window"], extra_retained_tokens=p["extra"], **A
        )
    if kind == "swmla":
        return SlidingWindowMLASpec(block_size=bs, dtype=dtype, sliding_window=p["window"], **A)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(block_size=bs, dtype=dtype, attention_chunk_size=p["chunk"], **A)
    if kind == "mamba":
        return MambaSpec(
            block_size=bs,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode=p["mode"],
            num_speculative_blocks=p["spec"],
            num_prefill_checkpoint_blocks=p["ckpt"],
            prefill_checkpoint_alignment=p["align"],
        )
    if kind == "circ":
        return CircularBufferSpec(block_size=bs, dtype=dtype, **A)
    if kind == "cross":
        return CrossAttentionSpec(block_size=bs, dtype=dtype, **A)
    raise AssertionError(kind)


def _manager_cls(spec) -> type:
    return KVCacheSpecRegistry.get_manager_class(spec, None)


@st.composite
def configs(draw) -> dict:
    """A KV-cache configuration and manager arguments vLLM accepts (``wild`` ones may break
    vLLM's rules, so that its constructor raises: kvblock must raise the same)."""
    wild = draw(st.integers(0, 15)) == 0
    caching = draw(st.sampled_from([True, True, True, False]))
    n = draw(st.integers(1, 4))
    kinds = draw(
        st.lists(
            st.sampled_from(["full", "full", "mla", "rswa", "sw", "sw", "swmla", "chunked", "mamba", "mamba", "circ", "cross"]),
            min_size=n,
            max_size=n,
        )
    )
    if caching and not wild:
        kinds = ["full" if k == "cross" else k for k in kinds]
        if n > 1 and all(k == "circ" for k in kinds):
            kinds[0] = "full"
    h = draw(st.sampled_from([1, 2, 2, 4]))
    groups = []
    for k in kinds:
        bs = h * draw(st.sampled_from([1, 1, 2, 4]))
        p: dict = {}
        if k in ("sw", "swmla"):
            p["window"] = draw(st.sampled_from(sorted({1, 2, 3, max(1, bs - 1), bs, bs + 1, 2 * bs + 1, 3 * bs})))
            p["extra"] = draw(st.sampled_from([0, 0, 0, 1, 2])) if k == "sw" else 0
        elif k == "rswa":
            p["window"] = draw(st.sampled_from([1, bs, 2 * bs + 1]))
        elif k == "chunked":
            p["chunk_mult"] = draw(st.sampled_from([1, 2, 3]))
        elif k == "mamba":
            mode = draw(st.sampled_from(["align", "none"]))
            if caching and not wild and not MAMBA_PREFIX_CACHING_DIFFERS:
                mode = "align"  # from 0.33 vLLM asserts that Mamba prefix caching is "align"
            p.update(
                mode=mode,
                spec=draw(st.sampled_from([0, 0, 1, 2])),
                ckpt=draw(st.sampled_from([0, 0, 1])),
                align_kind=draw(st.sampled_from([None, "hash", "block"])),
            )
        groups.append(
            {
                "kind": k,
                "bs": bs,
                "p": p,
                "eagle_group": draw(st.sampled_from([False, False, False, True])),
                "dtype": draw(st.sampled_from([torch.float32, torch.float32, torch.float32, torch.float16])),
            }
        )
    if n == 1 and caching and not wild:
        h = groups[0]["bs"]
    use_eagle = draw(st.booleans())
    # chunked local attention: hits must land on its block size (vLLM asserts it)
    for _ in range(3):
        sizes = [g["bs"] for g in groups]
        lcm = math.lcm(*sizes)
        specs = [_spec(g["kind"], g["bs"], _resolved(g, h), g["dtype"]) for g in groups]
        partial = n > 1 and vku.partial_hash_hits_enabled(
            [KVCacheGroupSpec(["x"], s) for s in specs], h, 1, [_manager_cls(s) for s in specs]
        )
        align = h if partial else lcm
        changed = False
        for g in groups:
            if g["kind"] == "chunked" and caching and not wild and g["bs"] != align:
                g["bs"] = align
                changed = True
        if not changed:
            break
    sizes = [g["bs"] for g in groups]
    scheduler_block_size = math.lcm(*sizes)
    if wild:
        scheduler_block_size *= draw(st.sampled_from([1, 2]))
    max_model_len = draw(st.integers(max(8, scheduler_block_size), 72))
    retention = draw(st.sampled_from([None, None, None, 0, 1, 2]))
    if retention is not None and retention > 0:
        retention *= scheduler_block_size
    if not wild and retention and not any(g["kind"] in ("sw", "swmla", "mamba") for g in groups):
        retention = 0
    npl = draw(st.sampled_from([0, 0, 0, 1, 2]))
    if not wild and caching and npl > scheduler_block_size:
        npl = 0
    if not wild and caching and use_eagle and any(g["kind"] == "chunked" for g in groups):
        use_eagle = False  # vLLM asserts chunked local attention has no EAGLE drop
    return dict(
        groups=groups,
        hash_block_size=h,
        scheduler_block_size=scheduler_block_size,
        max_model_len=max_model_len,
        num_blocks=draw(st.sampled_from([2, 3, 4, 6, 8, 10, 14, 20, 30, 40])),
        caching=caching,
        use_eagle=use_eagle,
        events=draw(st.sampled_from([True, True, False])),
        log_stats=draw(st.booleans()),
        num_hash_lookahead_tokens=draw(st.sampled_from([0, 0, 0, 1, 2] if HASH_LOOKAHEAD else [0])),
        num_prefill_lookahead=npl,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        max_in_flight_tokens=draw(st.one_of(st.none(), st.integers(1, max_model_len))),
        retention=retention,
        shared_prefix_checkpoint=draw(st.booleans()),
        metrics=draw(st.sampled_from([None, None, 1.0])),
        wild=wild,
    )


def _resolved(g: dict, h: int) -> dict:
    p = dict(g["p"])
    bs = g["bs"]
    if g["kind"] == "chunked":
        p["chunk"] = bs * p["chunk_mult"]
    if g["kind"] == "mamba":
        p["align"] = {None: None, "hash": h, "block": bs}[p["align_kind"]]
    return p


def build_config(c: dict) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(
            [f"layer.{i}"], _spec(g["kind"], g["bs"], _resolved(g, c["hash_block_size"]), g["dtype"]),
            is_eagle_group=g["eagle_group"],
        )
        for i, g in enumerate(c["groups"])
    ]
    return KVCacheConfig(
        num_blocks=c["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=c["retention"],
    )


def build_manager(cls: type, c: dict):
    ahead = {"num_hash_lookahead_tokens": c["num_hash_lookahead_tokens"]} if HASH_LOOKAHEAD else {}
    return cls(
        build_config(c),
        c["max_model_len"],
        c["scheduler_block_size"],
        c["hash_block_size"],
        max_in_flight_tokens=c["max_in_flight_tokens"],
        enable_caching=c["caching"],
        use_eagle=c["use_eagle"],
        **ahead,
        num_prefill_lookahead=c["num_prefill_lookahead"],
        log_stats=c["log_stats"],
        enable_kv_cache_events=c["events"],
        watermark=c["watermark"],
        enable_mamba_shared_prefix_checkpoint=c["shared_prefix_checkpoint"],
        metrics_collector=KVCacheMetricsCollector(c["metrics"]) if c["metrics"] else None,
    )


# -- observable state ----------------------------------------------------------------------------


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _result(blocks):
    """A KVCacheBlocks result as block ids per group (None stays None)."""
    if blocks is None:
        return None
    return tuple(_ids(g) for g in blocks.blocks)


def _cache_map(pool) -> dict:
    """The hash map as ``{key: ("one", id) | ("many", ids)}``: vLLM 0.32 / 0.33 store a block or
    ``{id: block}`` per key, 0.34 one id per key and the ids of keys cached by several blocks
    in ``_dup_ids``."""
    cache = pool.cached_block_hash_to_block
    dups = getattr(cache, "_dup_ids", None)
    out = {}
    for key, value in cache._cache.items():
        if isinstance(value, int):
            out[key] = ("many", list(dups[key])) if dups and key in dups else ("one", value)
        else:
            out[key] = ("many", list(value)) if isinstance(value, dict) else ("one", value.block_id)
    return out


def _further_keys(pool) -> set:
    """The further keys of vLLM's cached blocks (``cached_block_hashes_by_block``) as the
    ``(block hash, group)`` its ``BlockRemoved`` events carry."""
    return {(vku.maybe_convert_block_hash(vku.get_block_hash(k)), vku.get_group_id(k))
            for keys in pool.cached_block_hashes_by_block.values() for k in keys}


def _removed_key(e):
    if isinstance(e, BlockRemoved) and len(e.block_hashes) == 1:
        return (e.block_hashes[0], e.group_idx)
    return None


def events_as_vllm_defines(events, further: set) -> list:
    """KV events compared as vLLM 0.33.0 defines their order: a block's further keys are a
    Python ``set`` that ``_remove_cached_block_hashes`` pops, so the ``BlockRemoved`` events of
    a run of further keys come in the order of ``PYTHONHASHSEED`` (a multiset here); every
    other event, in order."""
    out: list = []
    i = 0
    while i < len(events):
        j = i
        while j < len(events) and _removed_key(events[j]) in further:
            j += 1
        if j - i > 1:
            out.append(("BlockRemoved of further keys, any order", sorted(repr(e) for e in events[i:j])))
            i = j
        else:
            out.append(events[i])
            i += 1
    return out


class Pair:
    """One request as both managers see it: vLLM's copy ``v`` and kvblock's copy ``k``, and
    the scheduler's bookkeeping of it."""

    def __init__(self, v: Request, k: Request, num_encoder_tokens: int) -> None:
        self.v = v
        self.k = k
        self.phase = "waiting"  # waiting | running | remote (an async KV load in flight)
        self.pending: list[tuple[int, int]] = []  # steps in flight: (tokens, outputs)
        self.num_encoder_tokens = num_encoder_tokens
        self.encoder_scheduled = False

    @property
    def rid(self) -> str:
        return self.v.request_id

    def both(self):
        return (self.v, self.k)

    def set(self, **fields) -> None:
        for r in self.both():
            for name, value in fields.items():
                setattr(r, name, value)


class VllmLockstep(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dead: str | None = None

    # -- setup -------------------------------------------------------------------------------
    @initialize(c=configs())
    def setup(self, c):
        assert not kv.is_patched(), "this test compares kvblock with vLLM's own manager: nothing may be patched"
        init_none_hash(sha256)
        self.c = c
        self.v = self.k = None
        errors = []
        for cls in (VllmKVCacheManager, kv.KVCacheManager):
            try:
                errors.append(build_manager(cls, c))
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                errors.append(e)
        v, k = errors
        if isinstance(v, Exception) or isinstance(k, Exception):
            assert type(v) is type(k), f"constructor: vLLM {v!r}, kvblock {k!r}"
            COVERAGE["constructor raised"] += 1
            self.dead = f"constructor raised {type(v).__name__}"
            return
        assert type(v) is VllmKVCacheManager, type(v)
        assert type(k) is kv.KVCacheManager, f"kvblock fell back to vLLM's manager for {c}"
        COVERAGE["configurations"] += 1
        COVERAGE["residency metrics"] += c["metrics"] is not None
        # the [start, end] clock windows of every call on each side (residency timestamps)
        self.windows: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        COVERAGE[f"groups={len(c['groups'])}"] += 1
        for g in c["groups"]:
            COVERAGE[f"kind={g['kind']}" + (f"/{g['p']['mode']}" if g["kind"] == "mamba" else "")] += 1
        COVERAGE["caching off"] += not c["caching"]
        for g in c["groups"]:
            if g["kind"] in ("sw", "swmla"):
                COVERAGE["window < block" if g["p"]["window"] < g["bs"] else "window >= block"] += 1
        COVERAGE["eagle"] += c["use_eagle"]
        COVERAGE["tiny pool"] += c["num_blocks"] <= 4
        COVERAGE["mixed block sizes"] += len({g["bs"] for g in c["groups"]}) > 1
        self.v, self.k = v, k
        ahead = [c["num_hash_lookahead_tokens"]] if HASH_LOOKAHEAD else []
        self.hasher = get_request_block_hasher(c["hash_block_size"], sha256, *ahead)
        self.pairs: list[Pair] = []
        self.counter = 0
        self.deferred: list[tuple[list, list]] = []  # blocks a scheduler frees later (v, k)
        self.has_cross = any(g["kind"] == "cross" for g in c["groups"])
        mamba = [g for g in c["groups"] if g["kind"] == "mamba"]
        self.mamba_align = bool(mamba) and mamba[0]["p"]["mode"] == "align"
        self.split = self._splitter() if self.mamba_align else None
        self.max_len = c["max_model_len"]
        # the scheduler's static info, compared once
        for attr in ("num_kv_cache_groups", "mamba_shared_prefix_checkpoint", "retained_hit_group_ids",
                     "kv_cache_event_metadata", "max_model_len", "enable_caching", "log_stats"):
            assert getattr(v, attr) == getattr(k, attr), attr
        cv, ck = v.coordinator, k.coordinator
        assert type(ck).__name__ == type(cv).__name__
        for attr in ("enable_partial_hash_hits", "full_attention_group_id", "eagle_group_ids",
                     "drop_eagle_group_ids", "num_reprefillable_tokens", "scheduler_block_size"):
            if hasattr(cv, attr):
                assert getattr(cv, attr) == getattr(ck, attr), attr
        for mv, mk in zip(cv.single_type_managers, ck.single_type_managers):
            # vLLM's code finds a group's manager by class (isinstance CrossAttentionManager ...)
            assert isinstance(mk, type(mv)) and type(mk).__name__ == type(mv).__name__
            for attr in ("block_size", "use_eagle", "cache_hit_alignment_tokens", "records_new_block_ids",
                         "max_admission_blocks_per_request", "shared_prefix_checkpoint"):
                assert getattr(mv, attr) == getattr(mk, attr), attr
            assert mv.kv_cache_spec == mk.kv_cache_spec

    def _splitter(self):
        """vLLM's own scheduler rule for Mamba "align" prefill chunks, on this manager."""
        c = self.c
        mgr = self.v
        mamba = next(g for g in mgr.kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
        partial = (
            c["hash_block_size"] < c["scheduler_block_size"] and mgr.coordinator.enable_partial_hash_hits
        )
        fake = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=mamba.kv_cache_spec.block_size),
            block_size=c["scheduler_block_size"],
            hash_block_size=c["hash_block_size"],
            mamba_partial_cache_hit=partial,
            use_eagle_block_drop=c["use_eagle"],
            num_hash_lookahead_tokens=c["num_hash_lookahead_tokens"],
            mamba_has_prefill_checkpoint_blocks=all(
                not isinstance(g.kv_cache_spec, MambaSpec) or g.kv_cache_spec.num_prefill_checkpoint_blocks > 0
                for g in mgr.kv_cache_config.kv_cache_groups
            ),
            mamba_prefill_checkpoint_alignment=mamba.kv_cache_spec.prefill_checkpoint_alignment,
            max_num_scheduled_tokens=1 << 20,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=partial and mgr.mamba_shared_prefix_checkpoint,
        )
        return lambda request, n, local=0, ext=0: VllmScheduler._mamba_block_aligned_split(fake, request, n, local, ext)

    def alive(self) -> bool:
        return self.dead is None

    # -- comparing ---------------------------------------------------------------------------
    def _state(self, m, vllm_side: bool):
        """Everything observable in one manager, as plain values equal between the two."""
        pool = m.block_pool
        rids = [p.rid for p in self.pairs]
        groups = []
        for g, stm in enumerate(m.coordinator.single_type_managers):
            tables = {rid: _ids(blocks) for rid, blocks in stm.req_to_blocks.items()}
            num_cached = dict(stm.num_cached_block.items())
            spec = stm.kv_cache_spec
            per_req = {}
            align = isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
            # the same vLLM attributes on both sides: kvblock's are views of its Rust state
            for rid in rids:
                ph = stm._partial_hit_reqs.get(rid)
                ph = None if ph is None else (ph[0], ph[1].block_id)
                if align:
                    tail = stm._producer_partial_tail_reqs.get(rid)
                    st_ = (stm.last_state_block_idx.get(rid), stm._num_retired_blocks.get(rid),
                           rid in stm._allocated_block_reqs, stm._checkpoints.get(rid), ph,
                           None if tail is None else (tail[0].block_id, tail[1]))
                else:
                    st_ = ph
                per_req[rid] = st_
            per_req["pending copies"] = [(s_.block_id, d.block_id) for s_, d in stm._pending_cow_copies]
            per_req["pending offloads"] = [(r, gg, b.block_id, t) for r, gg, b, t in stm._pending_boundary_state_offloads]
            groups.append((tables, num_cached, per_req, list(stm.new_block_ids)))
        blocks = [(b.ref_cnt, b.block_hash, b.block_hash_num_tokens) for b in pool.blocks]
        if NULL_BLOCKS_COUNTED:
            blocks[0] = (0, *blocks[0][1:])  # the null block's ref_cnt is not maintained
        return (
            groups,
            _ids(pool.free_block_queue.get_all_free_blocks()),
            pool.get_num_free_blocks(),
            blocks,
            _cache_map(pool),
            {b: set(keys) for b, keys in pool.cached_block_hashes_by_block.items()},
            events_as_vllm_defines(list(pool.kv_event_queue), self._seen_further(pool, vllm_side)),
            None if m.prefix_cache_stats is None else vars(m.prefix_cache_stats).copy(),
            self._residency(m, vllm_side),
        )

    def _call_of(self, t: int, vllm_side: bool) -> int | str:
        """The index of the call whose clock window holds timestamp ``t`` on that side."""
        w = self.windows[vllm_side]
        i = bisect.bisect_right(w, (t, 1 << 64)) - 1
        return i if i >= 0 and w[i][0] <= t <= w[i][1] else f"outside every call: {t}"

    def _residency(self, m, vllm_side: bool):
        """The residency metrics: the sampled blocks in dict order, each with the calls it was
        born and last accessed in and those of its access history; the eviction events (not
        drained yet) as their number of reuse gaps, in order."""
        c = m.metrics_collector
        if c is None:
            return None
        at = lambda t: self._call_of(t, vllm_side)  # noqa: E731
        blocks = [(b, at(s.birth_time_ns), at(s.last_access_ns), [at(t) for t in s.access_history])
                  for b, s in c.block_metrics.items()]
        events = list(c._eviction_events)
        for e in events:
            # vLLM's own fields, seconds as floats; kvblock reads the clock once per eviction, so
            # its idle time and gaps lie within the lifetime (vLLM reads it again for the idle
            # time, which can then exceed the lifetime of a block never accessed)
            assert e.idle_seconds >= 0 and len(e.reuse_gaps_seconds) <= 3 and min(e.reuse_gaps_seconds, default=0) >= 0
            if not vllm_side:
                assert e.idle_seconds + sum(e.reuse_gaps_seconds) <= e.lifetime_seconds + 1e-9, e
        return blocks, [len(e.reuse_gaps_seconds) for e in events]

    def _seen_further(self, pool, vllm_side: bool) -> set:
        """Every further key vLLM's pool has held in this example (read on vLLM's side, which
        is read first: both sides' events are then normalised with the same set)."""
        if not hasattr(self, "further"):
            self.further = set()
        if vllm_side:
            self.further |= _further_keys(pool)
        return self.further

    def _kill(self, reason: str) -> None:
        VLLM_CORRUPTED[reason] += 1
        self.dead = reason

    def call(self, name: str, fv, fk):
        """``fv()`` on vLLM, ``fk()`` on kvblock: ``(rv, rk, raised)``. Where one raises the
        other must raise the same type, and kvblock must have changed nothing."""
        COVERAGE[name] += 1
        before_v = self._state(self.v, True)
        before_k = self._state(self.k, False)
        t0 = time.monotonic_ns()
        try:
            rv, ev = fv(), None
        except Exception as e:  # noqa: BLE001
            rv, ev = None, e
        t1 = time.monotonic_ns()
        try:
            rk, ek = fk(), None
        except Exception as e:  # noqa: BLE001
            rk, ek = None, e
        self.windows[True].append((t0, t1))
        self.windows[False].append((t1, time.monotonic_ns()))
        if ev is None and ek is None:
            return rv, rk, False
        assert type(ev) is type(ek), f"{name}: vLLM {ev!r}, kvblock {ek!r}"
        COVERAGE[f"{name} raised {type(ev).__name__}"] += 1
        after_v = self._state(self.v, True)
        after_k = self._state(self.k, False)
        if after_v == before_v or after_k != after_v:
            # kvblock is atomic where vLLM is, and where vLLM is not, kvblock either changes
            # exactly what vLLM changed (checked above) or nothing
            assert after_k == before_k, f"{name}: kvblock changed its state, then raised {ek!r}"
        if after_v != before_v:
            if after_k == after_v:
                COVERAGE[f"{name} raised {type(ev).__name__} after the same change"] += 1
            else:
                self._kill(f"{name}: vLLM changed its state, then raised {type(ev).__name__}: {str(ev)[:60]}")
        return None, None, True

    # -- requests ----------------------------------------------------------------------------
    @precondition(alive)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.sampled_from(TOKENS), max_size=12),
        long=st.sampled_from([0, 0, 0, 1]),
        lora=st.sampled_from(LORAS),
        salt=st.sampled_from(SALTS),
        full_report=st.sampled_from([False, False, True]),
        skip_read=st.sampled_from([None, None, None, True]),
        mm=st.sampled_from([None, None, (2, 3), (0, 6)]),
        enc=st.integers(0, 12),
        hit_limit=st.sampled_from([None, None, None, 0, 3, 8]),
    )
    def new_request(self, prefix, suffix, long, lora, salt, full_report, skip_read, mm, enc, hit_limit):
        prompt = prefix + suffix
        if long:
            prompt = (prompt + [self.counter % 4] * self.max_len)[: self.max_len - long + 1]
        prompt = prompt[: self.max_len] or [0]
        rid = f"r{self.counter}"
        self.counter += 1
        copies = []
        for _ in range(2):
            # vLLM 0.34: prompt scoring from token N reads at most N tokens from the cache
            # (request.prefix_cache_hit_limit); earlier releases have no such bound
            scoring = {"prompt_logprobs": 1, "prompt_logprob_start": hit_limit} if HIT_LIMIT and hit_limit is not None else {}
            sp = SamplingParams(
                max_tokens=self.max_len,
                extra_args={"kv_cache_report_mode": "full"} if full_report else None,
                skip_reading_prefix_cache=skip_read,
                **scoring,
            )
            feats = None
            if mm is not None and len(prompt) >= mm[0] + mm[1]:
                feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=f"img{len(prompt) % 3}",
                                               mm_position=PlaceholderRange(offset=mm[0], length=mm[1]))]
            copies.append(Request(rid, list(prompt), sp, None, mm_features=feats, lora_request=lora,
                                  cache_salt=salt, block_hasher=self.hasher))
        v, k = copies
        assert v.block_hashes == k.block_hashes
        self.pairs.append(Pair(v, k, enc if self.has_cross else 0))

    def _waiting(self):
        return [p for p in self.pairs if p.phase == "waiting"]

    def _running(self, settled: bool = False):
        return [p for p in self.pairs if p.phase == "running" and (not settled or not p.pending)]

    def _lookup(self, p: Pair, data) -> tuple:
        """get_computed_blocks (or the connector's variant) on both: the hit each side got."""
        limit = data.draw(st.sampled_from([None, None, None, 0, p.v.num_tokens // 2]), label="max_cache_hit_length")
        connector = data.draw(st.sampled_from([False, False, False, True]), label="for_connector")
        if connector:
            rv, rk, err = self.call("get_computed_blocks_for_connector",
                                    lambda: self.v.get_computed_blocks_for_connector(p.v, limit),
                                    lambda: self.k.get_computed_blocks_for_connector(p.k, limit))
        else:
            rv, rk, err = self.call("get_computed_blocks", lambda: self.v.get_computed_blocks(p.v, limit),
                                    lambda: self.k.get_computed_blocks(p.k, limit))
        if err:
            return None
        assert (_result(rv[0]),) + tuple(rv[1:]) == (_result(rk[0]),) + tuple(rk[1:]), "lookup"
        # the empty result is the manager's shared empty KVCacheBlocks in both
        assert (rv[0] is self.v.empty_kv_cache_blocks) == (rk[0] is self.k.empty_kv_cache_blocks)
        return rv, rk

    def _advance(self, p: Pair, n: int, outputs: int, in_flight: bool) -> None:
        """``n`` tokens scheduled for ``p``; ``outputs`` tokens sampled when they complete."""
        p.set(num_computed_tokens=p.v.num_computed_tokens + n)
        if in_flight:
            p.set(num_in_flight_tokens=p.v.num_in_flight_tokens + n,
                  num_output_placeholders=p.v.num_output_placeholders + (1 if outputs else 0))
            p.pending.append((n, outputs))
        else:
            self._output(p, outputs)

    def _output(self, p: Pair, outputs: int) -> None:
        room = self.max_len - p.v.num_tokens
        toks = [(self.counter + i) % 4 for i in range(min(outputs, room))]
        if toks:
            for r in p.both():
                r.append_output_token_ids(list(toks))
            assert p.v.block_hashes == p.k.block_hashes

    def _chunk(self, p: Pair, start: int, data, local: int = 0, ext: int = 0) -> int:
        remaining = p.v.num_tokens - start
        if remaining <= 0:
            return 0
        n = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)), label="chunk")
        if self.split is not None:
            n = self.split(p.v, n, local, ext)
        return n

    @precondition(lambda self: self.alive() and self._waiting())
    @rule(data=st.data())
    def admit(self, data):
        """A waiting (or preempted) request is scheduled: lookup, then allocate_slots with the
        hit, as vLLM's scheduler does."""
        p = data.draw(st.sampled_from(self._waiting()), label="request")
        resumed = p.v.num_computed_tokens > 0  # an async load done: no lookup
        if resumed:
            hit = None
            num_local, boundary = 0, 0
        else:
            hit = self._lookup(p, data)
            if hit is None:
                num_local, boundary = 0, 0
            else:
                num_local, boundary = hit[0][1], hit[0][2]
                p.set(shared_prefix_boundary=boundary)
        base = p.v.num_computed_tokens + num_local
        ext = 0
        if not resumed and data.draw(st.sampled_from([False, False, False, True]), label="external"):
            ext = data.draw(st.integers(0, max(0, p.v.num_tokens - base)), label="num_external")
        load_async = ext > 0 and data.draw(st.booleans(), label="async_load")
        if load_async:
            n = 0
        else:
            n = self._chunk(p, base + ext, data, num_local, ext)
            if n == 0:
                return
        lookahead = 0 if load_async else data.draw(st.sampled_from([0, 0, 0, 1, 3]), label="lookahead")
        enc = p.num_encoder_tokens if not p.encoder_scheduled else 0
        kw = dict(
            num_new_computed_tokens=num_local,
            num_lookahead_tokens=lookahead,
            num_external_computed_tokens=ext,
            delay_cache_blocks=load_async,
            num_encoder_tokens=enc,
            full_sequence_must_fit=data.draw(st.booleans(), label="full_sequence_must_fit"),
            reserved_blocks=data.draw(st.sampled_from([0, 0, 0, 1, 3]), label="reserved"),
            has_scheduled_reqs=bool(self._running()),
        )
        rv, rk, err = self.call(
            "admit.allocate_slots",
            lambda: self.v.allocate_slots(p.v, n, new_computed_blocks=None if hit is None else hit[0][0], **kw),
            lambda: self.k.allocate_slots(p.k, n, new_computed_blocks=None if hit is None else hit[1][0], **kw),
        )
        if err:
            return
        assert _result(rv) == _result(rk), "admit"
        if rv is None:
            COVERAGE["admit: no room"] += 1
            return
        if not resumed:
            for m, r in ((self.v, p.v), (self.k, p.k)):
                m.record_prefix_cache_stats(r, num_local)
        p.encoder_scheduled = p.encoder_scheduled or enc > 0
        if load_async:
            p.phase = "remote"
            p.set(status=RequestStatus.WAITING_FOR_REMOTE_KVS, num_computed_tokens=base + ext)
            return
        p.phase = "running"
        p.set(status=RequestStatus.RUNNING, num_computed_tokens=base + ext)
        done = p.v.num_computed_tokens + n >= p.v.num_tokens
        self._advance(p, n, 1 if done else 0, data.draw(st.sampled_from([False, False, True]), label="async"))

    @precondition(lambda self: self.alive() and any(p.phase == "remote" for p in self.pairs))
    @rule(data=st.data(), failed=st.sampled_from([False, False, True]))
    def remote_kv_done(self, data, failed):
        """An async KV load finished: its blocks are cached (a failed load keeps a prefix, or
        nothing) and the request waits to be scheduled again."""
        p = data.draw(st.sampled_from([p for p in self.pairs if p.phase == "remote"]), label="request")
        if failed:
            keep = data.draw(st.integers(0, p.v.num_computed_tokens), label="valid")
            p.set(num_computed_tokens=keep)
            if keep == 0:
                self.call("remote.free", lambda: self.v.free(p.v), lambda: self.k.free(p.k))
                p.phase = "waiting"
                p.set(status=RequestStatus.WAITING)
                return
        self.call("remote.cache_blocks", lambda: self.v.cache_blocks(p.v, p.v.num_computed_tokens),
                  lambda: self.k.cache_blocks(p.k, p.k.num_computed_tokens))
        p.phase = "waiting"
        p.set(status=RequestStatus.WAITING)

    @precondition(lambda self: self.alive() and self._running())
    @rule(data=st.data())
    def step(self, data):
        """A running request's next step: the rest of its prefill (a chunk), or a decode step
        with drafts (speculative decoding) and lookahead slots."""
        p = data.draw(st.sampled_from(self._running()), label="request")
        if p.v.num_computed_tokens >= self.max_len:
            return
        prefill = p.v.num_computed_tokens < p.v.num_tokens
        if prefill:
            n = self._chunk(p, p.v.num_computed_tokens, data)
            drafts = 0
        else:
            drafts = data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="drafts")
            n = 1 + drafts
        if n == 0:
            return
        lookahead = data.draw(st.sampled_from([0, 0, 1, 3]), label="lookahead")
        rv, rk, err = self.call("step.allocate_slots",
                                lambda: self.v.allocate_slots(p.v, n, num_lookahead_tokens=lookahead),
                                lambda: self.k.allocate_slots(p.k, n, num_lookahead_tokens=lookahead))
        if err:
            return
        assert _result(rv) == _result(rk), "step"
        if rv is None:
            COVERAGE["step: no room"] += 1
            return
        in_flight = data.draw(st.sampled_from([False, False, True]), label="async") and len(p.pending) < 2
        if prefill:
            done = p.v.num_computed_tokens + n >= p.v.num_tokens
            self._advance(p, n, 1 if done else 0, in_flight)
            return
        accepted = data.draw(st.integers(0, drafts), label="accepted")
        p.set(num_computed_tokens=p.v.num_computed_tokens + n - (drafts - accepted))
        if in_flight:
            p.set(num_in_flight_tokens=p.v.num_in_flight_tokens + 1 + accepted,
                  num_output_placeholders=p.v.num_output_placeholders + 1)
            p.pending.append((1 + accepted, 1 + accepted))
            return
        self._output(p, 1 + accepted)
        if drafts:
            self.call("spec.cache_blocks", lambda: self.v.cache_blocks(p.v, p.v.num_computed_tokens),
                      lambda: self.k.cache_blocks(p.k, p.k.num_computed_tokens))

    @precondition(lambda self: self.alive() and any(p.pending for p in self.pairs))
    @rule(data=st.data())
    def output(self, data):
        """The oldest in-flight step of a request completes (async scheduling)."""
        p = data.draw(st.sampled_from([p for p in self.pairs if p.pending]), label="request")
        self._settle_one(p)

    def _settle_one(self, p: Pair) -> None:
        n, outputs = p.pending.pop(0)
        p.set(num_in_flight_tokens=p.v.num_in_flight_tokens - n)
        if outputs:
            p.set(num_output_placeholders=p.v.num_output_placeholders - 1)
            self._output(p, outputs)
            if p.phase == "running":
                self.call("output.cache_blocks",
                          lambda: self.v.cache_blocks(p.v, p.v.num_computed_tokens - p.v.num_in_flight_tokens),
                          lambda: self.k.cache_blocks(p.k, p.k.num_computed_tokens - p.k.num_in_flight_tokens))

    def _settle(self, p: Pair) -> None:
        while p.pending:
            self._settle_one(p)

    @precondition(lambda self: self.alive() and self._running())
    @rule(data=st.data(), deferred=st.sampled_from([False, False, True]))
    def preempt(self, data, deferred):
        p = data.draw(st.sampled_from(self._running()), label="request")
        self._settle(p)
        self._release(p, deferred)
        p.phase = "waiting"
        p.encoder_scheduled = False
        p.set(status=RequestStatus.PREEMPTED, num_computed_tokens=0, num_preemptions=p.v.num_preemptions + 1,
              shared_prefix_boundary=0)

    @precondition(lambda self: self.alive() and self.pairs)
    @rule(data=st.data(), deferred=st.sampled_from([False, False, True]))
    def finish(self, data, deferred):
        """A request finishes (or is aborted, whatever its phase)."""
        p = data.draw(st.sampled_from(self.pairs), label="request")
        self._settle(p)
        self._release(p, deferred)
        p.set(status=RequestStatus.FINISHED_STOPPED)
        self.pairs.remove(p)
        self._check_state()

    def _release(self, p: Pair, deferred: bool) -> None:
        if not deferred:
            self.call("free", lambda: self.v.free(p.v), lambda: self.k.free(p.k))
            return
        rv, rk, err = self.call("pop_blocks_for_free", lambda: self.v.pop_blocks_for_free(p.v),
                                lambda: self.k.pop_blocks_for_free(p.k))
        if not err:
            if NULL_BLOCKS_COUNTED:
                assert [b for b in _ids(rv) if b] == [b for b in _ids(rk) if b], "pop_blocks_for_free"
            else:
                assert _ids(rv) == _ids(rk), "pop_blocks_for_free"
            if rv:
                self.deferred.append((rv, rk))

    @precondition(lambda self: self.alive() and self.deferred)
    @rule()
    def free_deferred(self):
        """The scheduler returns deferred blocks to the pool (tail blocks first)."""
        bv, bk = self.deferred.pop(0)
        self.call("block_pool.free_blocks", lambda: self.v.block_pool.free_blocks(reversed(bv)),
                  lambda: self.k.block_pool.free_blocks(reversed(bk)))

    @precondition(alive)
    @rule(data=st.data(), defer=st.booleans())
    def end_step(self, data, defer):
        """The end of a scheduler step: blocks to zero, copy-on-write copies (whose retained
        blocks are freed once the copy ran), boundary-state hand-offs; then a new step."""
        rv, rk, _ = self.call("take_new_block_ids", self.v.take_new_block_ids, self.k.take_new_block_ids)
        assert rv == rk, "take_new_block_ids"
        rv, rk, _ = self.call("take_boundary_state_offloads", self.v.take_boundary_state_offloads,
                              self.k.take_boundary_state_offloads)
        assert rv == rk, "take_boundary_state_offloads"
        rv, rk, _ = self.call("take_kv_cache_block_copies", self.v.take_kv_cache_block_copies,
                              self.k.take_kv_cache_block_copies)
        assert [tuple(c) for c in rv[0]] == [tuple(c) for c in rk[0]], "copies"
        assert _ids(rv[1]) == _ids(rk[1]), "retained blocks"
        if rv[1]:
            COVERAGE["copy-on-write copies"] += 1
            if defer:
                self.deferred.append((rv[1][::-1], rk[1][::-1]))
            else:
                self.call("cow.free_blocks", lambda: self.v.block_pool.free_blocks(rv[1]),
                          lambda: self.k.block_pool.free_blocks(rk[1]))
        self.call("new_step_starts", self.v.new_step_starts, self.k.new_step_starts)
        if self.v.metrics_collector is not None and data.draw(st.booleans(), label="drain_events"):
            # the scheduler's stats read: vLLM's drain_events() on the collector each side holds
            rv, rk, _ = self.call("drain_events", self.v.metrics_collector.drain_events,
                                  self.k.metrics_collector.drain_events)
            assert [len(e.reuse_gaps_seconds) for e in rv] == [len(e.reuse_gaps_seconds) for e in rk]
            assert all(type(e) is type(rv[0]) for e in rk) if rv else not rk
            COVERAGE["eviction events drained"] += len(rk)

    @precondition(lambda self: self.alive() and self.pairs)
    @rule(data=st.data())
    def remove_skipped(self, data):
        """remove_skipped_blocks as a connector's finish path calls it (processed tokens, with
        or without the prompt length)."""
        p = data.draw(st.sampled_from(self.pairs), label="request")
        processed = data.draw(st.sampled_from([max(0, p.v.num_computed_tokens - p.v.num_in_flight_tokens),
                                               p.v.num_computed_tokens]), label="processed")
        prompt = data.draw(st.sampled_from([p.v.num_prompt_tokens, None]), label="num_prompt_tokens")
        self.call("remove_skipped_blocks", lambda: self.v.remove_skipped_blocks(p.rid, processed, prompt),
                  lambda: self.k.remove_skipped_blocks(p.rid, processed, prompt))

    @precondition(lambda self: self.alive() and self._running())
    @rule(data=st.data())
    def cache_blocks(self, data):
        """cache_blocks up to the request's computed tokens (as the scheduler's output path)."""
        p = data.draw(st.sampled_from(self._running()), label="request")
        n = data.draw(st.integers(0, p.v.num_computed_tokens), label="num_computed_tokens")
        self.call("cache_blocks", lambda: self.v.cache_blocks(p.v, n), lambda: self.k.cache_blocks(p.k, n))

    @precondition(alive)
    @rule(data=st.data())
    def prefix_cache_maintenance(self, data):
        """reset_prefix_cache, or a connector evicting blocks by id (ids past the pool too)."""
        if data.draw(st.booleans(), label="reset"):
            rv, rk, _ = self.call("reset_prefix_cache", self.v.reset_prefix_cache, self.k.reset_prefix_cache)
            assert rv == rk
            if rv:
                COVERAGE["reset_prefix_cache succeeded"] += 1
            return
        n = self.c["num_blocks"]
        if data.draw(st.integers(0, 7), label="bad_id") == 0:
            # one id past the pool: vLLM asserts before evicting anything
            ids = {data.draw(st.integers(n, n + 3), label="block_id")}
        else:
            ids = data.draw(st.sets(st.integers(0, n - 1), max_size=4), label="block_ids")
        self.call("evict_blocks", lambda: self.v.evict_blocks(set(ids)), lambda: self.k.evict_blocks(set(ids)))

    @precondition(alive)
    @rule(data=st.data())
    def queries(self, data):
        """The read-only calls a scheduler and connectors make."""
        v, k = self.v, self.k
        assert v.usage == pytest.approx(k.usage)
        assert v.block_pool.get_num_free_blocks() == k.block_pool.get_num_free_blocks()
        assert v.make_prefix_cache_stats() == k.make_prefix_cache_stats()
        if not self.pairs:
            return
        p = data.draw(st.sampled_from(self.pairs), label="request")
        if hasattr(v, "get_num_common_prefix_blocks"):  # 0.32 / 0.33
            assert v.get_num_common_prefix_blocks(p.rid) == k.get_num_common_prefix_blocks(p.rid)
        if hasattr(v, "get_num_cached_tokens"):  # 0.34: the cache-aware admission probe
            free_before = k.block_pool.get_num_free_blocks()
            rv, rk, _ = self.call("get_num_cached_tokens", lambda: v.get_num_cached_tokens(p.v),
                                  lambda: k.get_num_cached_tokens(p.k))
            assert rv == rk
            assert k.block_pool.get_num_free_blocks() == free_before
        gv, gk = _result(v.get_blocks(p.rid)), _result(k.get_blocks(p.rid))
        if NULL_BLOCKS_COUNTED and gv is not None and gk is not None:
            gv, gk = (tuple([b for b in g if b] for g in r) for r in (gv, gk))
        assert gv == gk
        assert v.get_block_ids(p.rid) == k.get_block_ids(p.rid)
        n = data.draw(st.integers(0, p.v.num_tokens), label="num_computed_tokens")
        rv, rk, _ = self.call("get_block_ids_for_computed_tokens",
                              lambda: v.get_block_ids_for_computed_tokens(p.rid, n),
                              lambda: k.get_block_ids_for_computed_tokens(p.rid, n))
        assert rv == rk
        rv, rk, _ = self.call("estimate_cached_tokens", lambda: v.estimate_cached_tokens(p.v),
                              lambda: k.estimate_cached_tokens(p.k))
        assert rv == rk
        if p.phase == "waiting" and p.v.num_computed_tokens == 0:
            hit = self._lookup(p, data)
            if hit is not None:
                t = data.draw(st.integers(0, hit[0][1]), label="truncate_to")
                rv, rk, _ = self.call("truncate_computed_blocks", lambda: v.truncate_computed_blocks(hit[0][0], t),
                                      lambda: k.truncate_computed_blocks(hit[1][0], t))
                assert _result(rv) == _result(rk)

    @precondition(lambda self: self.alive() and self.pairs)
    @rule(data=st.data())
    def any_allocate(self, data):
        """allocate_slots with argument mixes a scheduler does not send (a hit for a running
        request, counts that disagree with the hit, zero tokens, past max_model_len...): the
        same result or the same error."""
        p = data.draw(st.sampled_from(self.pairs), label="request")
        hit = self._lookup(p, data) if data.draw(st.booleans(), label="use_hit") else None
        fn = hit[0][1] if hit else 0
        kw = dict(
            num_new_computed_tokens=data.draw(st.sampled_from([fn, fn, 0, fn + 1]), label="num_new_computed"),
            num_lookahead_tokens=data.draw(st.integers(0, 3), label="lookahead"),
            num_external_computed_tokens=data.draw(st.sampled_from([0, 0, 1, 5, self.max_len]), label="ext"),
            delay_cache_blocks=data.draw(st.booleans(), label="delay"),
            full_sequence_must_fit=data.draw(st.booleans(), label="fit"),
            reserved_blocks=data.draw(st.integers(0, 3), label="reserved"),
            has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled"),
        )
        n = data.draw(st.one_of(st.integers(0, 6), st.sampled_from([self.max_len, 100])), label="num_new_tokens")
        rv, rk, err = self.call(
            "any.allocate_slots",
            lambda: self.v.allocate_slots(p.v, n, new_computed_blocks=None if hit is None else hit[0][0], **kw),
            lambda: self.k.allocate_slots(p.k, n, new_computed_blocks=None if hit is None else hit[1][0], **kw),
        )
        if not err:
            assert _result(rv) == _result(rk), "any_allocate"
            if rv is not None and p.phase == "waiting":
                # it holds blocks now: the scheduler would not look it up again
                p.phase = "running"
                p.set(status=RequestStatus.RUNNING)

    @precondition(lambda self: not self.alive())
    @rule()
    def stopped(self):
        """The example stopped (the constructors raised alike, or vLLM corrupted its own
        state before raising): nothing more to compare."""
        assert self.dead is not None

    # -- the invariant -----------------------------------------------------------------------
    def _check_state(self):
        sv, sk = self._state(self.v, True), self._state(self.k, False)
        if sv != sk:
            names = ["groups", "free queue", "free count", "blocks", "hash map", "further keys", "events", "stats",
                     "residency metrics"]
            diff = [n for n, a, b in zip(names, sv, sk) if a != b]
            detail = "\n".join(f"  {n}:\n    vLLM    {a}\n    kvblock {b}" for n, a, b in zip(names, sv, sk) if a != b)
            raise AssertionError(f"state differs in {diff}\n{detail}")
        if sk[8] is not None:
            # coverage: the eviction events compared since the last check (the list only grows
            # between drains and resets)
            gaps = [g for g in sk[8][1]]
            seen, seen_gaps = getattr(self, "events_seen", (0, 0))
            now_gaps = sum(1 for g in gaps if g)
            if len(gaps) >= seen:
                COVERAGE["eviction events compared"] += len(gaps) - seen
                COVERAGE["eviction events with reuse gaps"] += max(0, now_gaps - seen_gaps)
            self.events_seen = (len(gaps), now_gaps)
            COVERAGE["sampled block accesses compared"] += sum(len(blk[3]) for blk in sk[8][0])
        further = self._seen_further(self.v.block_pool, True)
        assert events_as_vllm_defines(self.v.take_events(), further) == events_as_vllm_defines(
            self.k.take_events(), further)

    @invariant()
    def same_state(self):
        if getattr(self, "v", None) is None or not self.alive():
            return
        self._check_state()


#: CI: a fixed sequence of examples sized to take a few minutes on two cores.
CI_EXAMPLES = 700

SETTINGS = settings(
    max_examples=int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES") or CI_EXAMPLES),
    stateful_step_count=40,
    deadline=None,
    # CI replays a fixed sequence of examples, so that it passes or fails on the code alone
    derandomize=IN_CI,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

#: Group kinds (Mamba with its mode) every run must have compared against vLLM.
KINDS = ["full", "mla", "rswa", "sw", "swmla", "chunked", "mamba/none", "mamba/align", "circ", "cross"]


def test_event_order_vllm_leaves_to_chance_is_a_multiset_and_only_there() -> None:
    """The normalisation the lockstep compares events with (issue 32): a run of removals of
    further keys in any order, everything else in order."""

    def rm(h):
        return BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)

    st_ = BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1], block_size=1, lora_id=None,
                      medium="GPU", lora_name=None)
    further = {(2, 0), (3, 0), (4, 0)}
    a = [st_, rm(1), rm(2), rm(3), rm(4), rm(5)]
    b = [st_, rm(1), rm(4), rm(2), rm(3), rm(5)]
    assert events_as_vllm_defines(a, further) == events_as_vllm_defines(b, further)
    # outside a run of further keys the order is compared
    assert events_as_vllm_defines([st_, rm(5), rm(1)], further) != events_as_vllm_defines([st_, rm(1), rm(5)], further)
    assert events_as_vllm_defines([rm(2), st_, rm(3)], further) != events_as_vllm_defines([rm(3), st_, rm(2)], further)
    # a multiset, not a set: a key removed twice is not one removal
    assert events_as_vllm_defines([rm(2), rm(2), rm(3)], further) != events_as_vllm_defines([rm(2), rm(3), rm(3)], further)


#: ``KVBLOCK_LOCKSTEP_SEED=N``: explore a random sequence of examples from seed N (not CI's
#: derandomized one, nor the example database) in :func:`test_vllm_lockstep_seeded`.
SEED = os.environ.get("KVBLOCK_LOCKSTEP_SEED")

#: CI's random-seed runs: (hypothesis seed, PYTHONHASHSEED) pairs, each a short run in its own
#: interpreter (the hash seed is vLLM's NONE_HASH root and the order it pops sets in).
SEEDED_RUNS = [(1, 0), (2, 1), (3, 4242)]
SEEDED_EXAMPLES = 40


@pytest.mark.skipif(SEED is None, reason="set KVBLOCK_LOCKSTEP_SEED (test_vllm_lockstep_random_seeds does)")
def test_vllm_lockstep_seeded() -> None:
    """The state machine from a random seed: no coverage floor (a short run need not reach
    every kind), the same comparisons after every step."""
    seeded = hypothesis.seed(int(SEED or 0))(type("VllmLockstepSeeded", (VllmLockstep,), {}))
    COVERAGE.clear()
    VLLM_CORRUPTED.clear()
    run_state_machine_as_test(seeded, settings=settings(SETTINGS, derandomize=False, database=None))
    calls = sum(n for k, n in COVERAGE.items() if "allocate_slots" in k)
    print(f"\nseeded lockstep: seed {SEED}, PYTHONHASHSEED {os.environ.get('PYTHONHASHSEED')}: "
          f"{COVERAGE['configurations']} configurations, {calls} allocate_slots calls, "
          f"{sum(n for k, n in COVERAGE.items() if ' raised ' in k and not k.endswith('same change'))} refused calls "
          f"compared, stopped where vLLM corrupted itself: {sum(VLLM_CORRUPTED.values())}")
    assert COVERAGE["configurations"] > 0


@pytest.mark.parametrize("seed,hash_seed", SEEDED_RUNS, ids=[f"seed{a}-hash{b}" for a, b in SEEDED_RUNS])
def test_vllm_lockstep_random_seeds(seed: int, hash_seed: int) -> None:
    """Next to CI's derandomized run: short runs from fixed random seeds and hash seeds, each in
    a fresh interpreter, so kinds of divergence that only other seeds reach surface in CI
    (issue 32: a refused allocate_slots that left an empty Mamba table was found by 3 of 15
    random runs, never by the derandomized one). Reproducible: the seeds are fixed."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), KVBLOCK_LOCKSTEP_SEED=str(seed),
               KVBLOCK_LOCKSTEP_EXAMPLES=os.environ.get("KVBLOCK_SEEDED_EXAMPLES", str(SEEDED_EXAMPLES)))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         f"{__file__}::test_vllm_lockstep_seeded"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    summary = [line for line in out.stdout.splitlines() if "seeded lockstep" in line]
    print("\n".join(summary))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert summary, out.stdout[-2000:]


def test_vllm_lockstep() -> None:
    """The state machine, then what it covered: every group kind, hybrid configurations,
    caching off, EAGLE, tiny pools, errors raised alike, and examples run to their end."""
    COVERAGE.clear()
    VLLM_CORRUPTED.clear()
    run_state_machine_as_test(VllmLockstep, settings=SETTINGS)
    print("\nlockstep coverage:", dict(sorted(COVERAGE.items())))
    print("examples stopped where vLLM corrupted itself:", dict(VLLM_CORRUPTED))
    missing = [k for k in KINDS if not COVERAGE[f"kind={k}"]]
    assert not missing, f"group kinds never compared with vLLM: {missing}"
    for key in ("groups=1", "groups=2", "groups=3", "groups=4", "caching off", "eagle", "tiny pool",
                "mixed block sizes", "window < block", "window >= block",
                "admit.allocate_slots", "step.allocate_slots", "free", "residency metrics",
                "eviction events compared"):
        assert COVERAGE[key], f"never covered: {key}"
    # (sampled blocks hit again and reuse gaps are rare here, where resets and connector
    # evictions are frequent: tests/test_vllm_metrics.py's shared-prefix lockstep covers them)
    assert any(k.endswith(" raised AssertionError") for k in COVERAGE), "no error path compared"
    assert COVERAGE["configurations"] > SETTINGS.max_examples // 2
