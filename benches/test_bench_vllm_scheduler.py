"""vLLM's real ``AsyncScheduler`` without a model, stock vs kvblock, in one run (issue 16 item
5, issue 31 item 5): ``schedule()`` + ``update_from_output()`` CPU time per step, the KV cache
manager's share of a step, and the engine core's request hashing per request, at block size 16
and at 64 (0.34's default), on whichever of vLLM 0.33.x and 0.34.x runs this interpreter
(``make bench`` runs them under both).

The scheduler runs are interleaved (stock, kvblock, kvblock, stock, ...) so that a noisy
neighbour on the shared cores hits both alike; each sample is one whole run's mean step
time. Every run of both must hand the model runner the same block ids step by step (the
fingerprint of ``vllm_sched._feed``), and it is also pinned to its recorded value, so a change
of behaviour on either side fails here before any number is reported.

The manager's share comes from separate passes of each (``vllm_sched.ManagerTimer``: every
public manager method and the pool methods the scheduler calls wrapped in a
``kvblock._core.TimedCall``, which makes the scheduler's own vectorcall between two clock
reads; the clock reads, calibrated, are subtracted), ``REPS`` of each interleaved, reported as
the median; the step-time runs carry no wrapper.

Both halves run with the startup heap frozen (``gc.freeze()``), as vLLM's engine core runs once
started (``freeze_gc_heap``): the collections between runs and rounds then walk only this
bench's own objects instead of flushing the CPU caches with the whole vLLM + torch heap.

Runs only where vLLM 0.33.x or 0.34.x is installed and the shared data is present.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import pytest

import vllm_sched as S
from kvblock.replay import peer_workload as W

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

REPS = int(os.environ.get("KVBLOCK_BENCH_SCHED_REPS", "5"))

#: fingerprint, steps, finished requests, prefix-cache hits / queries (tokens) of each
#: workload, by (vLLM series, workload, block size); None: not pinned
EXPECTED: dict[tuple[str, str, int], tuple[str | None, int | None, int, int | None, int | None]] = {
    ("0.33", "shared", 16): ("740dba4dba4250bf", 2048, 1000, 1_150_464, 2_048_000),
    ("0.33", "chat", 16): (None, None, 384, None, None),
    ("0.33", "shared", 64): (None, None, 1000, None, None),
    ("0.33", "chat", 64): (None, None, 384, None, None),
    ("0.34", "shared", 16): ("740dba4dba4250bf", 2048, 1000, 1_150_464, 2_048_000),
    ("0.34", "chat", 16): ("2fec43bc74c9eae7", 2088, 384, 800_992, 915_722),
    ("0.34", "shared", 64): ("c4a73d5c5177dea3", 2048, 1000, 1_150_464, 2_048_000),
    ("0.34", "chat", 64): ("ffa669266923ddb6", 2088, 384, 793_664, 915_722),
}
FACTORIES = {"shared": S.shared_workload, "chat": S.chat_workload}
BLOCK_SIZES = (16, 64)
WORKLOAD_NAMES = {"shared": "shared workload", "chat": "multi-turn chat"}
_SHARES: dict[str, dict[str, tuple[float, float]]] = {}


def _group(name: str, block_size: int) -> str:
    return (f"vLLM {SERIES} AsyncScheduler step: schedule()+update_from_output() "
            f"[{WORKLOAD_NAMES[name]}, block size {block_size}]")


SERIES = S.vllm_series()


def _check_version() -> None:
    if SERIES not in S.SERIES:
        pytest.skip(f"needs vLLM {' or '.join(s + '.x' for s in S.SERIES)}, found {vllm.__version__}")


def _check(name: str, block_size: int, runs: list[S.SchedRun]) -> None:
    fps = {r.fingerprint for r in runs}
    assert len(fps) == 1, f"{name}: stock vLLM and kvblock scheduled different block ids: {fps}"
    fp, steps, finished, hits, queries = EXPECTED[(SERIES, name, block_size)]
    r = runs[0]
    if fp is not None:
        assert r.fingerprint.startswith(fp), r.fingerprint
    if steps is not None:
        assert r.steps == steps
    assert {x.finished for x in runs} == {finished}
    assert len({(x.steps, x.hits, x.queries) for x in runs}) == 1
    if hits is not None:
        assert (r.hits, r.queries) == (hits, queries)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_vllm_scheduler_step(record_measured, report_line, name, block_size):
    _check_version()

    def factory() -> S.Workload:
        return FACTORIES[name](block_size=block_size)

    for impl in ("vllm", "kvblock"):  # warm-up: the first scheduler of a process pays for lazy imports
        S.run(impl, lambda: S.shared_workload(64, block_size))
    samples: dict[str, list[float]] = {"vllm": [], "kvblock": []}
    runs: list[S.SchedRun] = []
    for rep in range(REPS):
        order = ("vllm", "kvblock") if rep % 2 == 0 else ("kvblock", "vllm")
        for impl in order:
            gc.collect()
            r = S.run(impl, factory)
            assert r.kind == ("kvblock.vllm.manager" if impl == "kvblock" else "vllm.v1.core.kv_cache_manager")
            runs.append(r)
            samples[impl].append(r.mean_step_s)
    # the manager-time passes: REPS of each, interleaved; the median share is reported
    timed_runs: dict[str, list[S.SchedRun]] = {"vllm": [], "kvblock": []}
    for rep in range(REPS if S.TIMERS else 0):
        for impl in (("vllm", "kvblock") if rep % 2 == 0 else ("kvblock", "vllm")):
            gc.collect()
            timed_runs[impl].append(S.run(impl, factory, time_manager=True))
    _check(name, block_size, runs + timed_runs["vllm"] + timed_runs["kvblock"])
    for impl, s in samples.items():
        record_measured(_group(name, block_size), impl, s)
    ratio = statistics.median(samples["vllm"]) / statistics.median(samples["kvblock"])
    name = f"{name}, block size {block_size}, vLLM {SERIES}"
    r0 = runs[0]
    report_line(f"scheduler [{name}]: step {statistics.median(samples['vllm']) * 1e6:.0f} µs stock, "
                f"{statistics.median(samples['kvblock']) * 1e6:.0f} µs kvblock (medians of {REPS}): {ratio:.2f}x; "
                f"target >= 2x: {'met' if ratio >= 2 else 'NOT met'}")
    report_line(f"scheduler [{name}]: {r0.steps} steps, {r0.finished} requests, prefix hits {r0.hits}/{r0.queries} "
                f"tokens, fingerprint {r0.fingerprint[:16]} (identical in all {len(runs) + sum(map(len, timed_runs.values()))} runs)")
    if not S.TIMERS:
        report_line(f"  KV manager share of a step [{name}]: not measured: {S.NO_TIMERS}")
        return
    for impl, ts in timed_runs.items():
        shares = sorted(t.manager_ns / sum(t.step_ns) for t in ts)
        share = statistics.median(shares)
        t = min(ts, key=lambda x: abs(x.manager_ns / sum(x.step_ns) - share))  # the median pass
        step = sum(t.step_ns) / t.steps
        _SHARES.setdefault(name, {})[impl] = (share, t.manager_ns / t.steps)
        top = sorted(((v[0], k, v[1]) for k, v in t.manager_by_name.items() if v[1]), reverse=True)[:4]
        detail = ", ".join(f"{k} {ns / n / 1e3:.2f} µs x{n / t.steps:.1f}/step" for ns, k, n in top)
        report_line(f"  KV manager share of a step [{name}, {'stock vLLM' if impl == 'vllm' else 'kvblock'}]: "
                    f"{share:.1%} median of {len(ts)} timed passes ({', '.join(f'{x:.1%}' for x in shares)}); "
                    f"median pass: {t.manager_ns / t.steps / 1e3:.1f} of {step / 1e3:.1f} µs per step, "
                    f"{t.manager_calls / t.steps:.0f} calls a step, the clock's {t.manager_overhead_ns} ns a call "
                    f"subtracted; biggest (with the clock): "
                    f"{detail}")
    kv_share = _SHARES[name]["kvblock"][0]
    report_line(f"  target: kvblock's manager share <= 5%: {'met' if kv_share <= 0.05 else 'NOT met'} ({kv_share:.1%})")
    # what the step ratio could be if kvblock's manager took no time at all: each side's step
    # time (the untimed medians) split by its median manager share; what is left of a step is
    # vLLM's scheduler code around the manager (and, on kvblock's side, what it does with
    # kvblock's results: KVCacheBlocks.get_block_ids, ...)
    stock_rest = statistics.median(samples["vllm"]) * (1 - _SHARES[name]["vllm"][0])
    kv_rest = statistics.median(samples["kvblock"]) * (1 - kv_share)
    report_line(f"  bound [{name}]: rest of a step (step less its manager share) {stock_rest * 1e6:.0f} µs stock, "
                f"{kv_rest * 1e6:.0f} µs kvblock; step ratio with a manager that took no time: "
                f"{statistics.median(samples['vllm']) / kv_rest:.2f}x (with stock's own rest: "
                f"{1 / (1 - _SHARES[name]['vllm'][0]):.2f}x)")


# -- the engine core's request hashing -----------------------------------------------------------

HASH_GROUP = f"engine core {SERIES}: Request(...) with block hasher, 2,048-token request"
HASH_ROUNDS = 20
HASH_BATCH = 16


def _prompts(kind: str, round_: int) -> list[list[int]]:
    """``HASH_BATCH`` 2,048-token prompts: "unique" ones (streams no other round uses, so no
    memo can serve them) or the shared workload's requests (75% behind its system prompt)."""
    if kind == "unique":
        return [W.tokens(900_000 + round_ * HASH_BATCH + j, 0, W.PROMPT_LEN) for j in range(HASH_BATCH)]
    return [W.e2e_request_tokens(round_ * HASH_BATCH + j)[0] for j in range(HASH_BATCH)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", ["unique", "shared"])
def test_request_hashing(record_measured, report_line, kind, block_size):
    """What the engine core does per new request: ``Request(..., block_hasher=
    get_request_block_hasher(block_size, sha256))``, which hashes its 128 (32) full blocks
    (on 0.34 from the ``TokenBuffer`` the ``Request`` makes of the prompt); stock vLLM's
    hasher vs kvblock's (swapped in by ``kvblock.vllm.patch()``), in interleaved rounds (stock,
    kvblock, kvblock, stock, ...) so that a noisy neighbour hits both alike. Each side gets its
    own fresh copy of the round's prompts. The same prompts give the same block hashes on both
    (checked on every round).

    Two times per request: the whole ``Request(...)`` (the engine core's cost; on 0.34 it
    includes about 40 µs of ``Request`` set-up, the ``TokenBuffer`` copy of the prompt among
    it, that neither hasher changes) and the hasher's own call on a request built without one
    (``hasher(request)``: the request hashing, which the >= 8x target is about), on other
    prompts of the same kind so that no memo has seen them."""
    _check_version()
    hashers = {}
    for impl in ("vllm", "kvblock"):
        with S.engine(impl, block_size) as eng:  # each hasher keeps its hash function and NONE_HASH
            hashers[impl] = eng["hasher"]
            Request, SamplingParams = eng["Request"], eng["SamplingParams"]
    assert type(hashers["kvblock"]).__module__.startswith("kvblock"), hashers
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    params.update_from_generation_config({}, S.EOS_TOKEN_ID)
    clock = time.perf_counter_ns
    samples: dict[str, list[float]] = {"vllm": [], "kvblock": []}
    calls: dict[str, list[float]] = {"vllm": [], "kvblock": []}
    reqs: list = []
    # as vLLM's engine core does once started (freeze_gc_heap): the startup heap is frozen, so
    # the collection before each round walks only this bench's own objects (a full collection
    # of the vLLM + torch heap would flush the CPU caches before every round, which the engine
    # core never does between requests)
    gc.collect()
    gc.freeze()
    try:
        for rnd in range(HASH_ROUNDS + 1):  # round 0 warms up
            last: list[bytes] = []
            for impl in (("vllm", "kvblock") if rnd % 2 == 0 else ("kvblock", "vllm")):
                prompts = _prompts(kind, rnd)
                reqs = []  # the last requests are freed here, not inside the timed region
                gc.collect()
                hasher = hashers[impl]
                t0 = clock()
                reqs = [Request(f"h-{rnd}-{j}", p, params, None, block_hasher=hasher) for j, p in enumerate(prompts)]
                dt = clock() - t0
                if rnd:
                    samples[impl].append(dt / len(prompts) / 1e9)
                assert all(len(r.block_hashes) == W.PROMPT_LEN // block_size for r in reqs)
                digests = [bytes(h) for r in reqs for h in r.block_hashes]
                if last:
                    assert digests == last, "kvblock's request hashes differ from vLLM's"
                last = digests
                bare = [Request(f"b-{rnd}-{j}", p, params, None) for j, p in enumerate(_prompts(kind, 500 + rnd))]
                gc.collect()
                t0 = clock()
                for r in bare:
                    hasher(r)
                dt = clock() - t0
                if rnd:
                    calls[impl].append(dt / len(bare) / 1e9)
    finally:
        gc.unfreeze()
    for impl, s in samples.items():
        record_measured(f"{HASH_GROUP} [{kind} prompts, block size {block_size}]", impl, s)
        record_measured(f"request hasher call {SERIES}, 2,048-token request [{kind} prompts, block size {block_size}]",
                        impl, calls[impl])
    med = {impl: (statistics.median(samples[impl]), statistics.median(calls[impl])) for impl in samples}
    ratio = med["vllm"][1] / med["kvblock"][1]
    report_line(f"request hashing [{kind} prompts, block size {block_size}, vLLM {SERIES}]: hasher call "
                f"{med['vllm'][1] * 1e6:.1f} µs stock, {med['kvblock'][1] * 1e6:.1f} µs kvblock per request "
                f"(medians): {ratio:.1f}x, target >= 8x: {'met' if ratio >= 8 else 'NOT met'}; whole Request(...) "
                f"{med['vllm'][0] * 1e6:.1f} vs {med['kvblock'][0] * 1e6:.1f} µs: "
                f"{med['vllm'][0] / med['kvblock'][0]:.1f}x")
