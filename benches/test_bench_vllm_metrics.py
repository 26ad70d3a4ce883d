"""vLLM's real ``AsyncScheduler`` with KV-cache residency metrics on (``--kv-cache-metrics``),
stock vLLM's manager and collector against kvblock's (issue 33, build item 2): the KV cache
manager's time per step.

Stock vLLM calls its collector's Python hooks for every block it hands out, touches or evicts;
kvblock's Rust pool records the same state itself (``rust/src/pool/residency.rs``). The manager
time is measured as in ``test_bench_vllm_scheduler.py`` (``vllm_sched.ManagerTimer``: every
public manager method and the pool methods the scheduler calls, each in a
``kvblock._core.TimedCall``, the calibrated clock reads subtracted), plus the collector's
``drain_events()`` that the scheduler calls for its stats (vLLM builds its events inside the
manager's calls, kvblock when they are drained, so both are counted). The collector is the one
vLLM's scheduler builds from ``ObservabilityConfig(kv_cache_metrics=True,
kv_cache_metrics_sample=rate)``.

Runs are interleaved (stock, kvblock, kvblock, stock, ...), ``REPS`` of each, medians reported.
Every run of both must hand the model runner the same block ids step by step (the
fingerprint); at sample rate 1.0, where sampling is exact, both report the same number of
eviction events and reuse gaps; at vLLM's default rate 0.01 the counts are samples of the same
distribution.
"""

from __future__ import annotations

import gc
import os
import statistics

import pytest

import vllm_sched as S

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

REPS = int(os.environ.get("KVBLOCK_BENCH_METRICS_REPS", "3"))
SERIES = S.vllm_series()
#: the shared workload's fingerprint at block size 16 (as test_bench_vllm_scheduler.py's)
FINGERPRINT = "740dba4dba4250bf"
TARGET = 10.0


def _run(impl: str, rate: float) -> S.SchedRun:
    return S.run(impl, lambda: S.shared_workload(block_size=16), time_manager=True, kv_cache_metrics_sample=rate)


@pytest.mark.parametrize("rate", [1.0, 0.01], ids=["rate-1.0", "rate-0.01"])
def test_vllm_scheduler_with_residency_metrics(record_measured, report_line, rate):
    if SERIES not in S.SERIES:
        pytest.skip(f"needs vLLM {' or '.join(s + '.x' for s in S.SERIES)}, found {vllm.__version__}")
    if not S.TIMERS:
        pytest.skip(S.NO_TIMERS)
    for impl in ("vllm", "kvblock"):  # warm-up: lazy imports
        S.run(impl, lambda: S.shared_workload(64, 16), kv_cache_metrics_sample=rate)
    runs: dict[str, list[S.SchedRun]] = {"vllm": [], "kvblock": []}
    for rep in range(REPS):
        for impl in (("vllm", "kvblock") if rep % 2 == 0 else ("kvblock", "vllm")):
            gc.collect()
            r = _run(impl, rate)
            assert r.kind == ("kvblock.vllm.manager" if impl == "kvblock" else "vllm.v1.core.kv_cache_manager")
            runs[impl].append(r)
    every = runs["vllm"] + runs["kvblock"]
    assert {r.fingerprint[:16] for r in every} == {FINGERPRINT}, "stock vLLM and kvblock scheduled differently"
    assert all(r.eviction_events > 0 for r in every), "no eviction event reached the scheduler's stats"
    if rate == 1.0:
        assert len({(r.eviction_events, r.eviction_gaps) for r in every}) == 1, [
            (r.eviction_events, r.eviction_gaps) for r in every]
    per_step = {impl: [r.manager_ns / r.steps / 1e9 for r in rs] for impl, rs in runs.items()}
    group = f"vLLM {SERIES} KV cache manager time per step, residency metrics at {rate} [shared workload, block size 16]"
    for impl, s in per_step.items():
        record_measured(group, impl, s)
    med = {impl: statistics.median(s) for impl, s in per_step.items()}
    ratio = med["vllm"] / med["kvblock"]
    r0, k0 = runs["vllm"][0], runs["kvblock"][0]
    report_line(f"residency metrics at {rate} [vLLM {SERIES}, shared, block size 16]: manager "
                f"{med['vllm'] * 1e6:.0f} µs/step stock, {med['kvblock'] * 1e6:.0f} µs/step kvblock (medians of "
                f"{REPS}): {ratio:.1f}x, target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'NOT met'}; "
                f"{r0.steps} steps, fingerprint {r0.fingerprint[:16]} in all {len(every)} runs; eviction events "
                f"{r0.eviction_events} stock / {k0.eviction_events} kvblock ({r0.eviction_gaps} / "
                f"{k0.eviction_gaps} reuse gaps)")
