"""vLLM's real ``AsyncScheduler`` driven without a model, stock or with kvblock (whichever of
vLLM 0.33.x and 0.34.x this interpreter has: :data:`SERIES`).

The engine core's loop, minus the model: requests are built as the engine core builds them
(``Request`` with the request block hasher attached, so their prompt blocks are hashed at
construction) and added with ``add_request``; each step calls ``schedule()``, builds a fake
``ModelRunnerOutput`` as vLLM's scheduler tests do (one sampled token for every scheduled
request whose prefill is complete, none for a partial prefill chunk), and calls
``update_from_output()``. Only ``schedule()`` + ``update_from_output()`` are timed.

``impl="vllm"`` is stock vLLM (its ``KVCacheManager``, ``BlockPool`` and request hasher);
``impl="kvblock"`` runs :func:`kvblock.vllm.patch` first, so vLLM's own ``AsyncScheduler``
builds kvblock's manager and pool and the engine core's hasher is kvblock's, exactly as a
user turning kvblock on gets it (undone with :func:`kvblock.vllm.unpatch` afterwards).

Every step feeds a SHA-256 fingerprint with what the scheduler handed to the model runner:
each new request's id, computed (prefix-hit) tokens and block ids per group, each running
request's new block ids, the scheduled token counts and the finished request ids. Stock vLLM
and kvblock must give the same fingerprint.

Workloads: :func:`shared_workload` (``../shared/workload``: 1,000 requests of 2,048 tokens,
75 % behind a 1,536-token system prompt, 128 outputs each, 64 running) and
:func:`chat_workload` (seeded multi-turn chat: each turn's prompt is the whole conversation so
far, earlier outputs included, plus a new user message).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvblock import _core
from kvblock.replay import peer_workload as W

#: the vLLM release series this bench drives (0.34's ``Request`` holds its token ids in a
#: ``TokenBuffer``, its ``ModelRunnerOutput`` has no ``req_id_to_index``, and its
#: ``VllmConfig`` needs ``shared/vllm/cpu-harness/triton_shim.py`` on a CPU without triton-cpu)
SERIES = ("0.33", "0.34")

#: The manager-time passes (``run(..., time_manager=True)``) time calls with
#: ``kvblock._core.CallClock``, built only with the bench-timers cargo feature.
TIMERS = _core.BENCH_TIMERS
NO_TIMERS = ("the KV manager's share needs kvblock._core built with the bench-timers cargo feature "
             "(make bench builds it so; the wheel and make install leave the timers out)")
#: the release the hybrid bench (test_bench_hybrid.py) drives
VLLM_VERSION = "0.33.0"
EOS_TOKEN_ID = 2


def vllm_series() -> str:
    """The installed vLLM's release series ("0.33"), or "" when it is not installed."""
    try:
        import vllm
    except ImportError:
        return ""
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


@dataclass
class RequestSpec:
    req_id: str
    prompt: list[int]
    outputs: list[int]  # the tokens the fake model samples, in order; len = max_tokens


@dataclass
class Workload:
    """Scheduler limits and the requests: ``initial`` are added before the first step;
    ``follow_up(req_id)`` gives the requests a client sends once ``req_id`` finishes."""

    name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    initial: list[RequestSpec]
    follow_up: Callable[[str], list[RequestSpec]] = field(default=lambda rid: [])


def shared_workload(num_requests: int = W.NUM_REQUESTS, block_size: int = W.BLOCK_SIZE) -> Workload:
    """The shared workload's requests (README §1) under vLLM's scheduler: 64 running, a token
    budget that admits a whole wave of 64 prefills in one step, as the workload's loop does
    (its first ``num_requests`` requests); blocks of ``block_size`` tokens, as many tokens of
    KV cache at any block size."""
    specs = []
    for i in range(num_requests):
        prompt, outputs = W.e2e_request_tokens(i)
        specs.append(RequestSpec(f"req-{i}", prompt, outputs))
    return Workload("shared", W.NUM_BLOCKS * W.BLOCK_SIZE // block_size, block_size, W.MAX_MODEL_LEN, W.MAX_RUNNING,
                    W.MAX_RUNNING * W.PROMPT_LEN, specs)


CHAT_SEED = 20261202


def chat_workload(conversations: int = 64, concurrent: int = 32, turns: int = 6, block_size: int = 16) -> Workload:
    """Seeded multi-turn chat: ``concurrent`` conversations at a time (a finished one is
    replaced by the next), ``turns`` turns each. Every conversation starts with the same
    1,024-token system prompt; turn ``t``'s prompt is turn ``t-1``'s prompt + its outputs + a
    new user message of 64-512 tokens; 32-256 outputs per turn. The next turn is sent as soon
    as the previous one finishes. 8,192-token chunked-prefill budget, 131,072 tokens of KV
    cache (8,192 blocks of 16 tokens, 2,048 of 64: less than the conversations' total
    footprint, so cached blocks get evicted)."""
    rng = random.Random(CHAT_SEED)
    plan = [[(rng.randint(64, 512), rng.randint(32, 256)) for _ in range(turns)] for _ in range(conversations)]
    system = W.tokens(600_000, 0, 1024)
    history: dict[int, list[int]] = {}

    def turn(c: int, t: int) -> RequestSpec:
        user_len, out_len = plan[c][t]
        stream = 700_000 + c * 16 + t
        prompt = history.get(c, system) + W.tokens(stream, 0, user_len)
        outputs = W.tokens(stream, user_len, user_len + out_len)
        history[c] = prompt + outputs
        return RequestSpec(f"chat-{c}-turn-{t}", prompt, outputs)

    next_conv = [concurrent]

    def follow_up(req_id: str) -> list[RequestSpec]:
        _, c, _, t = req_id.split("-")
        c, t = int(c), int(t)
        if t + 1 < turns:
            return [turn(c, t + 1)]
        history.pop(c, None)
        if next_conv[0] < conversations:
            next_conv[0] += 1
            return [turn(next_conv[0] - 1, 0)]
        return []

    return Workload("chat", 8192 * 16 // block_size, block_size, 8192, 64, 8192,
                    [turn(c, 0) for c in range(concurrent)], follow_up)


@contextmanager
def engine(impl: str, block_size: int = W.BLOCK_SIZE) -> Iterator[dict[str, Any]]:
    """The engine core's pieces for ``impl`` ("vllm" or "kvblock"): ``scheduler_cls``,
    ``hasher`` (``get_request_block_hasher(block_size, sha256)`` with ``NONE_HASH`` initialised under
    ``PYTHONHASHSEED=0``), ``Request``, ``SamplingParams`` and ``ModelRunnerOutput``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing as vhash
    from vllm.v1.core import kv_cache_utils as vku
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    import kvblock.vllm as kv

    assert impl in ("vllm", "kvblock")
    assert not kv.is_patched()
    if impl == "kvblock":
        kv.patch()
    try:
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = W.PYTHONHASHSEED
        try:
            vku.init_none_hash(vhash.sha256)
        finally:
            if saved is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = saved
        hasher = vku.get_request_block_hasher(block_size, vhash.sha256)
        yield {"scheduler_cls": AsyncScheduler, "hasher": hasher, "Request": Request,
               "SamplingParams": SamplingParams, "ModelRunnerOutput": ModelRunnerOutput}
    finally:
        if impl == "kvblock":
            kv.unpatch()


def make_scheduler(eng: dict[str, Any], wl: Workload, kv_cache_metrics_sample: float | None = None) -> Any:
    """vLLM's ``AsyncScheduler`` (async scheduling is vLLM's default) with prefix caching on,
    chunked prefill on, one full-attention group, ``wl``'s limits; with
    ``kv_cache_metrics_sample``, KV-cache residency metrics on at that sample rate
    (``--kv-cache-metrics --kv-cache-metrics-sample RATE``)."""
    import torch

    _cpu_harness()
    from vllm.config import CacheConfig, ModelConfig, ObservabilityConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model="Qwen/Qwen3-0.6B", dtype="float16", seed=42, skip_tokenizer_init=True,
                               max_model_len=wl.max_model_len)
    scheduler_config = SchedulerConfig(max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
                                       max_model_len=wl.max_model_len, enable_chunked_prefill=True,
                                       async_scheduling=True, is_encoder_decoder=False, watermark=0.0)
    cache_config = CacheConfig(block_size=wl.block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True)
    observability = (ObservabilityConfig() if kv_cache_metrics_sample is None else
                     ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=kv_cache_metrics_sample))
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                             observability_config=observability)
    spec = FullAttentionSpec(block_size=wl.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=wl.num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    cache_config.num_gpu_blocks = wl.num_blocks
    register_all_kvcache_specs(vllm_config)
    return eng["scheduler_cls"](vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=wl.block_size,
                                log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config))


def _cpu_harness() -> None:
    """On vLLM 0.34 without triton-cpu, ``VllmConfig`` refuses an x86 CPU: import the shared
    test harness that lets it build (``shared/vllm/cpu-harness/triton_shim.py``, as the vLLM
    judge runs 0.34's own tests), once."""
    import sys

    import vllm.triton_utils as tu

    if vllm_series() != "0.34" or tu.HAS_TRITON or "triton_shim" in sys.modules:
        return
    harness = os.path.join(os.environ.get("KVBLOCK_SHARED", os.path.join(os.path.dirname(__file__), "..", "..",
                                                                          "shared")), "vllm", "cpu-harness")
    sys.path.insert(0, harness)
    import triton_shim  # noqa: F401


def make_request(eng: dict[str, Any], spec: RequestSpec) -> Any:
    """What the engine core does for a new request: ``Request`` with the block hasher."""
    params = eng["SamplingParams"](max_tokens=len(spec.outputs), ignore_eos=True)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return eng["Request"](request_id=spec.req_id, prompt_token_ids=spec.prompt, sampling_params=params,
                          pooling_params=None, block_hasher=eng["hasher"])


@dataclass
class SchedRun:
    fingerprint: str
    steps: int
    step_ns: list[int]  # schedule() + update_from_output() per step
    manager_ns: int  # time inside the KV cache manager's methods (timed runs: 0)
    manager_calls: int
    manager_by_name: dict[str, list[int]]  # name -> [ns with the clock reads, calls]
    finished: int
    hits: int
    queries: int
    kind: str = ""
    manager_overhead_ns: int = 0  # the timer's own cost per call (subtracted in manager_ns)
    eviction_events: int = 0  # residency metrics: KVCacheEvictionEvents in the scheduler's stats
    eviction_gaps: int = 0  # ... and the reuse gaps they carry

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_ns) / len(self.step_ns) / 1e9


# -- the manager-time pass ---------------------------------------------------------------------


class ManagerTimer:
    """Wraps every public method of one KV cache manager instance (and the block pool methods
    the scheduler calls directly) in a ``kvblock._core.TimedCall`` on one ``CallClock``: the
    arguments are unpacked before the clock is read, and the call made is the vectorcall the
    scheduler would have made (and, with residency metrics on, the collector's
    ``drain_events``), so a timed interval holds the call and two clock reads (a
    Python wrapper's own frame and bookkeeping cost as much as a manager call, and varied from
    pass to pass more than the share measured). Calls made from inside a timed call are not
    timed twice. The two clock reads, the least of several calibrations, are subtracted per
    call."""

    POOL_METHODS = ("free_blocks", "get_num_free_blocks", "get_usage")

    def __init__(self, manager: Any) -> None:
        if not TIMERS:
            raise RuntimeError(NO_TIMERS)
        self.clock = _core.CallClock()
        self.overhead_ns = min(self.clock.overhead_ns() for _ in range(7))
        self._timed: dict[str, Any] = {}
        empty = manager.empty_kv_cache_blocks
        for name in dir(type(manager)):
            if name.startswith("_"):
                continue
            if isinstance(getattr(type(manager), name, None), property):
                continue
            attr = getattr(manager, name, None)
            if callable(attr) and not isinstance(attr, type):
                setattr(manager, name, self._wrap(attr, name, empty))
        pool = manager.block_pool
        for name in self.POOL_METHODS:
            if callable(getattr(pool, name, None)):
                setattr(pool, name, self._wrap(getattr(pool, name), "block_pool." + name, None))
        collector = getattr(manager, "metrics_collector", None)
        if collector is not None:
            # residency metrics: the scheduler's stats call drains the collector (vLLM builds its
            # events inside the manager's calls, kvblock when they are drained: both counted)
            collector.drain_events = self._wrap(collector.drain_events, "metrics_collector.drain_events", None)

    def _wrap(self, fn: Callable[..., Any], name: str, empty: Any) -> Any:
        timed = self.clock.wrap(fn, empty)
        self._timed[name] = timed
        return timed

    @property
    def ns(self) -> int:
        return self.clock.ns

    @property
    def calls(self) -> int:
        return self.clock.calls

    @property
    def by_name(self) -> dict[str, list[int]]:
        """name -> [ns, calls] (with the clock reads); allocate_slots is also split into the
        calls that allocated nothing and ``allocate_slots [new blocks]``."""
        out: dict[str, list[int]] = {}
        for name, timed in self._timed.items():
            (ns0, n0), (ns1, n1) = timed.totals()
            out[name] = [ns0 + ns1, n0 + n1]
            if name == "allocate_slots":
                out[name] = [ns0, n0]
                out[name + " [new blocks]"] = [ns1, n1]
        return out

    @property
    def net_ns(self) -> int:
        return max(self.ns - self.calls * self.overhead_ns, 0)


def run(impl: str, wl_factory: Callable[[], Workload], time_manager: bool = False,
        kv_cache_metrics_sample: float | None = None) -> SchedRun:
    """Drive one fresh scheduler through a fresh copy of the workload to the end (with
    residency metrics at ``kv_cache_metrics_sample``, if given)."""
    wl = wl_factory()
    with engine(impl, wl.block_size) as eng:
        sched = make_scheduler(eng, wl, kv_cache_metrics_sample)
        kind = type(sched.kv_cache_manager).__module__
        outputs = {s.req_id: s.outputs for s in wl.initial}
        for spec in wl.initial:
            sched.add_request(make_request(eng, spec))
        timer = ManagerTimer(sched.kv_cache_manager) if time_manager else None
        mro_cls = eng["ModelRunnerOutput"]
        with_index = "req_id_to_index" in {f.name for f in dataclasses.fields(mro_cls)}
        requests = sched.requests
        fp = hashlib.sha256()
        step_ns: list[int] = []
        finished = hits = queries = events = gaps = 0
        clock = time.perf_counter_ns
        gc.collect()
        gc.freeze()
        try:
            while sched.has_unfinished_requests():
                t0 = clock()
                out = sched.schedule()
                t1 = clock()
                ids = list(out.num_scheduled_tokens)
                sampled = []
                for rid in ids:
                    req = requests[rid]
                    if req.num_computed_tokens < req.num_prompt_tokens:
                        sampled.append([])  # a prefill chunk samples nothing
                    else:
                        sampled.append([outputs[rid][len(req.output_token_ids)]])
                if with_index:  # 0.33; 0.34's ModelRunnerOutput has no req_id_to_index
                    mro = mro_cls(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                                  sampled_token_ids=sampled)
                else:
                    mro = mro_cls(req_ids=ids, sampled_token_ids=sampled)
                t2 = clock()
                eco = sched.update_from_output(out, mro)
                t3 = clock()
                step_ns.append(t1 - t0 + t3 - t2)
                _feed(fp, out)
                done = []
                for e in eco.values():
                    done += [o.request_id for o in e.outputs if o.finish_reason is not None]
                    if e.scheduler_stats is not None:
                        hits += e.scheduler_stats.prefix_cache_stats.hits
                        queries += e.scheduler_stats.prefix_cache_stats.queries
                        events += len(e.scheduler_stats.kv_cache_eviction_events)
                        gaps += sum(len(x.reuse_gaps_seconds) for x in e.scheduler_stats.kv_cache_eviction_events)
                fp.update(("f" + ",".join(done)).encode())
                finished += len(done)
                for rid in done:
                    outputs.pop(rid, None)
                    for spec in wl.follow_up(rid):
                        outputs[spec.req_id] = spec.outputs
                        sched.add_request(make_request(eng, spec))
        finally:
            gc.unfreeze()
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == wl.num_blocks - 1, f"{free} free blocks at the end, expected {wl.num_blocks - 1}"
        return SchedRun(fp.hexdigest(), len(step_ns), step_ns, timer.net_ns if timer else 0,
                        timer.calls if timer else 0, dict(timer.by_name) if timer else {}, finished, hits,
                        queries, kind, timer.overhead_ns if timer else 0, events, gaps)


def _ids(group_ids: Any) -> str:
    if group_ids is None:
        return "-"
    return "|".join(",".join(map(str, g)) for g in group_ids)


def _feed(fp: Any, out: Any) -> None:
    """One step's message: what the model runner gets from ``out``."""
    parts = []
    for r in out.scheduled_new_reqs:
        parts.append(f"N{r.req_id}@{r.num_computed_tokens}:{_ids(r.block_ids)}")
    c = out.scheduled_cached_reqs
    for j, rid in enumerate(c.req_ids):
        parts.append(f"C{rid}@{c.num_computed_tokens[j]}:{_ids(c.new_block_ids[j])}")
    parts.append("T" + ",".join(f"{k}={v}" for k, v in out.num_scheduled_tokens.items()))
    parts.append("F" + ",".join(sorted(out.finished_req_ids)))
    fp.update(";".join(parts).encode())
