"""A HiSparse configuration (vLLM's host-tier KV cache): stock vLLM's ``KVCacheManager`` bound to
its ``HiSparseCoordinator`` against kvblock's manager and its coordinator view (issue "No
fallbacks", build item 6): the manager + coordinator time per scheduler step.

The layout is vLLM's HiSparse test layout (as ``tests/test_vllm_hisparse_manager.py``): a source
group on the host pool, an indexer, a resident group and a hot group of two blocks per request,
at block size 16. vLLM's side is ``vllm.v1.core.kv_cache_manager.KVCacheManager`` +
``get_hisparse_coordinator(manager)``; kvblock's is ``kvblock.vllm.KVCacheManager`` (which takes
HiSparse configurations itself) + the same call, which returns kvblock's coordinator view.

The workload (:func:`workload`) is seeded: 320 requests, each behind one of 8 shared system
prompts of 256 tokens, with a unique 64-448-token user part and 16-96 outputs; at most 32
running, a 2,048-token step budget (chunked prefill), arrivals spread over the first steps. Each
step is driven as vLLM's scheduler and HiSparse connector drive the manager (no model, no
scheduler object): running requests first, each ``allocate_slots(request, n)`` (a request the
manager refuses waits a step), then waiting requests with ``get_computed_blocks`` and
``allocate_slots`` with their prefix hit; then the connector's scheduler side
(``HiSparseConnectorScheduler.build_connector_meta``): ``advance_scheduled``,
``build_offload_command``, ``take_host_block_copies``, ``build_row_mirrors`` per scheduled
request, ``all_context_pages_resident``, ``take_residency_updates``; then the "model" (a
prefill chunk samples nothing, a decode step one token), ``free`` for the requests that
finished, and the connector's ``update_connector_output``: ``release_completed_host_copies``
and ``update_spills`` with every spill of the step enqueued and completed by the one worker.

Only the manager and coordinator calls are timed (``perf_counter_ns`` around each, the
calibrated cost of the two clock reads subtracted per call); the same calls, the same
arguments, on both sides. The fingerprint is a SHA-256 over every step's block ids per group
(the new blocks ``allocate_slots`` returns, the hits of ``get_computed_blocks``), the offload
commands' page transfers, the host block copies, the row mirrors, the residency updates and
``all_context_pages_resident``: stock and kvblock must give the same one in every run.

Runs are interleaved (stock, kvblock, kvblock, stock, ...), ``REPS`` of each
(``KVBLOCK_BENCH_HISPARSE_REPS``, default 3), medians reported. The target (kvblock >= 10x
less manager time per step) is reported, not asserted.
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
hisparse = pytest.importorskip("vllm.v1.hisparse.coordinator", reason="this vLLM has no HiSparse")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as _vkm  # noqa: E402
from vllm.v1.core import kv_cache_utils as _vku  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvblock.vllm.manager import KVCacheManager as KvblockManager  # noqa: E402
from kvblock.vllm.originals import original  # noqa: E402

# stock vLLM's, also where kvblock.vllm.patch() replaced them
VllmManager = original(_vkm, "KVCacheManager")
get_request_block_hasher = original(_vku, "get_request_block_hasher")
init_none_hash = original(_vku, "init_none_hash")

REPS = int(os.environ.get("KVBLOCK_BENCH_HISPARSE_REPS", "3"))
TARGET = 10.0
SEED = 20261205
BS = 16
NUM_BLOCKS = 4096  # device blocks (16 tokens each)
HOST_NUM_BLOCKS = 8192
MAX_MODEL_LEN = 4096
MAX_RUNNING = 16
STEP_BUDGET = 1024
#: vLLM's ``VllmConfig.max_in_flight_tokens`` for one batch in flight: the resident groups'
#: admission window (64 pages), shorter than most contexts here, so requests read from the host
MAX_IN_FLIGHT_TOKENS = STEP_BUDGET
NUM_REQUESTS = 256
WARM_STEPS = 4  # the steps before the requests that share a system prompt arrive


def _series() -> str:
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


def _config() -> KVCacheConfig:
    source = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["source"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(["indexer"], source, role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS, page_size=BS * 4)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(block_size=BS, page_size=BS * 4, blocks_per_request=2)),
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, hisparse_host_num_blocks=HOST_NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )


@dataclass
class Spec:
    req_id: str
    arrival: int  # the step it is sent at
    prompt: list[int]
    outputs: list[int]


def workload(num_requests: int = NUM_REQUESTS) -> list[Spec]:
    """The seeded requests (see the module docstring), in arrival order."""
    rng = random.Random(SEED)
    systems = [[100_000 + s * 10_000 + t for t in range(1024)] for s in range(8)]
    specs = []
    for i in range(num_requests):
        user = [rng.randrange(1, 50_000) for _ in range(rng.randint(128, 1536))]
        outputs = [rng.randrange(1, 50_000) for _ in range(rng.randint(16, 96))]
        # the first request of each system prompt comes alone, the others once its pages are
        # on the host: vLLM records the GPU copy of a host block that two requests complete in
        # one step in the order of a set of request ids (str hashes: PYTHONHASHSEED decides)
        system = i if i < len(systems) else rng.randrange(len(systems))
        arrival = 0 if i < len(systems) else WARM_STEPS + (i - len(systems)) // 4
        specs.append(Spec(f"req-{i}", arrival, systems[system] + user, outputs))
    return specs


@dataclass
class Run:
    fingerprint: str
    steps: int
    manager_ns: int
    calls: int
    by_name: dict[str, list[int]] = field(default_factory=dict)  # name -> [ns (net), calls]
    spills: int = 0
    hits: int = 0
    hot: int = 0  # allocations that gave a request its hot region
    not_resident: int = 0  # steps whose context pages were not all resident
    kind: str = ""


def _clock_overhead_ns() -> int:
    clock = time.perf_counter_ns
    best = None
    for _ in range(7):
        t0 = clock()
        for _ in range(2000):
            clock()
        per = (clock() - t0) / 2000
        best = per if best is None else min(best, per)
    return int(best)  # one read between two timed reads: the pair's cost


def _ids(blocks) -> str:
    return "|".join(",".join(map(str, g)) for g in blocks.get_block_ids())


def run(impl: str, specs: list[Spec], trace: list[str] | None = None) -> Run:
    """Drive one fresh manager (``impl`` "vllm" or "kvblock") and its coordinator through the
    workload to the end; with ``trace``, each step's fingerprinted text is appended to it (to
    find the first step where two runs differ)."""
    cls = KvblockManager if impl == "kvblock" else VllmManager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    manager = cls(_config(), max_model_len=MAX_MODEL_LEN, scheduler_block_size=BS, hash_block_size=BS,
                  enable_caching=True, max_in_flight_tokens=MAX_IN_FLIGHT_TOKENS)
    coord = hisparse.get_hisparse_coordinator(manager)
    kind = type(manager).__module__
    clock = time.perf_counter_ns
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def timed(name: str, fn, *args, **kwargs):
        t0 = clock()
        out = fn(*args, **kwargs)
        t1 = clock()
        acc = totals[name]
        acc[0] += t1 - t0
        acc[1] += 1
        return out

    fp = hashlib.sha256()
    pending = list(specs)
    pending.reverse()
    waiting: list[Request] = []
    running: list[Request] = []
    outputs: dict[str, list[int]] = {}
    steps = spills = hits = hot = not_resident = 0
    gc.collect()
    gc.freeze()
    try:
        while pending or waiting or running:
            while pending and pending[-1].arrival <= steps:
                s = pending.pop()
                params = SamplingParams(max_tokens=len(s.outputs), ignore_eos=True)
                waiting.append(Request(s.req_id, s.prompt, params, None, block_hasher=hasher))
                outputs[s.req_id] = s.outputs
            budget = STEP_BUDGET
            scheduled: dict[str, tuple[int, int]] = {}  # request -> (start, count)
            parts: list[str] = []
            for req in running:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if n <= 0:
                    continue
                new = timed("allocate_slots", manager.allocate_slots, req, n)
                if new is None:
                    parts.append(f"R{req.request_id}")
                    continue  # refused: it waits a step
                parts.append(f"C{req.request_id}:{_ids(new)}")
                hot += bool(new.get_block_ids()[3])
                scheduled[req.request_id] = (req.num_computed_tokens, n)
                budget -= n
            while waiting and len(running) < MAX_RUNNING and budget > 0:
                req = waiting[0]
                computed, num_hit = timed("get_computed_blocks", manager.get_computed_blocks, req)[:2]
                n = min(req.num_tokens - num_hit, budget)
                new = timed("allocate_slots", manager.allocate_slots, req, n, num_hit,
                            computed if num_hit else None)
                if new is None:
                    parts.append(f"W{req.request_id}")
                    break
                waiting.pop(0)
                running.append(req)
                hits += num_hit
                req.num_computed_tokens = num_hit
                parts.append(f"N{req.request_id}@{num_hit}:{_ids(computed)}/{_ids(new)}")
                scheduled[req.request_id] = (num_hit, n)
                budget -= n
            # the connector's scheduler side (HiSparseConnectorScheduler.build_connector_meta)
            by_id = {r.request_id: r for r in running}
            rows = tuple((rid, start, count) for rid, (start, count) in scheduled.items())
            timed("advance_scheduled", coord.advance_scheduled,
                  [(rid, min(start + count, by_id[rid].num_tokens)) for rid, start, count in rows])
            command = timed("build_offload_command", coord.build_offload_command)
            transfers = list(command.page_transfers) if command is not None else []
            copies = timed("take_host_block_copies", coord.take_host_block_copies)
            parts.append("T" + ";".join(f"{t.transfer_id},{t.host_block_id},{t.resident_block_ids},"
                                        f"{getattr(t, 'after_forward', '-')},{t.restore}" for t in transfers))
            parts.append("H" + ";".join(repr(c) for c in copies))
            for row in rows:
                mirrors = timed("build_row_mirrors", coord.build_row_mirrors, (row,))
                parts.append(f"M{row[0]}:" + ";".join(
                    f"{m.source_starts},{m.destination_start},{m.num_rows}" for m in mirrors))
            resident = timed("all_context_pages_resident", coord.all_context_pages_resident, rows)
            updates = timed("take_residency_updates", coord.take_residency_updates,
                            {rid: count for rid, _, count in rows})
            not_resident += not resident
            parts.append(f"A{resident}U" + ";".join(
                f"{r}:{u.pages}:{[list(g) for g in u.block_ids]}" for r, u in sorted(updates.items())))
            # the model: a prefill chunk samples nothing, a complete one or a decode step a token
            done = []
            for rid, (start, count) in scheduled.items():
                req = by_id[rid]
                req.num_computed_tokens = start + count
                if req.num_computed_tokens >= req.num_tokens:
                    req.append_output_token_ids(outputs[rid][len(req.output_token_ids)])
                    if len(req.output_token_ids) >= len(outputs[rid]):
                        done.append(req)
            for req in done:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                timed("free", manager.free, req)
                running.remove(req)
            parts.append("F" + ",".join(r.request_id for r in done))
            # the connector's update_connector_output: every spill enqueued and completed by the worker
            timed("release_completed_host_copies", coord.release_completed_host_copies,
                  tuple(c.dst_block_id for c in copies) if copies else ())
            counts = {t.transfer_id: 1 for t in transfers}
            spills += len(counts)
            timed("update_spills", coord.update_spills, counts, counts)
            fp.update("\n".join(parts).encode())
            if trace is not None:
                trace.append("\n".join(parts))
            steps += 1
            assert steps < 100_000, "the workload does not finish"
    finally:
        gc.unfreeze()
    overhead = _clock_overhead_ns()
    by_name = {k: [max(ns - n * overhead, 0), n] for k, (ns, n) in totals.items()}
    return Run(fp.hexdigest(), steps, sum(v[0] for v in by_name.values()), sum(v[1] for v in by_name.values()),
               by_name, spills, hits, hot, not_resident, kind)


def test_vllm_hisparse_manager(record_measured, report_line):
    series = _series()
    specs = workload()
    for impl in ("vllm", "kvblock"):  # warm-up: lazy imports
        run(impl, workload(24))
    runs: dict[str, list[Run]] = {"vllm": [], "kvblock": []}
    for rep in range(REPS):
        for impl in (("vllm", "kvblock") if rep % 2 == 0 else ("kvblock", "vllm")):
            gc.collect()
            r = run(impl, specs)
            assert r.kind == ("kvblock.vllm.manager" if impl == "kvblock" else "vllm.v1.core.kv_cache_manager")
            runs[impl].append(r)
    every = runs["vllm"] + runs["kvblock"]
    assert len({r.fingerprint for r in every}) == 1, "stock vLLM and kvblock handed out different blocks"
    r0 = every[0]
    # the workload spills, hits on the host pool, gives requests hot regions and reads from the host
    assert r0.spills and r0.hits and r0.hot and r0.not_resident, (r0.spills, r0.hits, r0.hot, r0.not_resident)
    per_step = {impl: [r.manager_ns / r.steps / 1e9 for r in rs] for impl, rs in runs.items()}
    group = f"vLLM {series} HiSparse KV cache manager + coordinator time per step [{NUM_REQUESTS} requests, block size 16]"
    for impl, s in per_step.items():
        record_measured(group, impl, s)
    med = {impl: statistics.median(s) for impl, s in per_step.items()}
    ratio = med["vllm"] / med["kvblock"]
    report_line(f"HiSparse [vLLM {series}, {NUM_REQUESTS} requests, block size 16]: manager + coordinator "
                f"{med['vllm'] * 1e6:.0f} µs/step stock, {med['kvblock'] * 1e6:.0f} µs/step kvblock (medians of "
                f"{REPS}): {ratio:.1f}x, target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'NOT met'}; "
                f"{r0.steps} steps, {r0.calls} calls, {r0.spills} spills, {r0.hits} hit tokens, "
                f"{r0.hot} hot regions, {r0.not_resident} steps reading from the host, "
                f"fingerprint {r0.fingerprint[:16]} in all {len(every)} runs")
    # where the time goes, per call (the last run of each)
    k, v = runs["kvblock"][-1].by_name, runs["vllm"][-1].by_name
    for name in sorted(v, key=lambda n: -v[n][0]):
        kn = k.get(name, [0, 0])
        report_line(f"  {name:32s} {v[name][1]:7d} calls: stock {v[name][0] / v[name][1] / 1e3:8.2f} µs/call, "
                    f"kvblock {kn[0] / max(kn[1], 1) / 1e3:8.2f} µs/call ({v[name][0] / max(kn[0], 1):.1f}x)")
