"""Benchmarks: kvblock against the pure-Python reference, same inputs, one run.

Each pair of benchmarks shares a ``group``; at the end a table of reference/kvblock ratios
(by min and by median time) is printed. Run with ``make bench`` or
``pytest benches --benchmark-columns=min,median,rounds``.
"""

from __future__ import annotations

import os

# numpy's OpenBLAS worker threads busy-wait after a call and steal one of the two cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Pin the benchmark thread to one CPU (KVBLOCK_BENCH_CPU, default 0; "none" to leave it free).
# On the shared 2-vCPU VMs these numbers come from, one vCPU ran the pure-Python reference
# about 1.75x slower than the other while Rust code ran at the same speed on both, so an
# unpinned run could inflate the ratios by chance. Pinned, both sides run on the same CPU;
# kvblock's hashing worker threads are started first, so they may still use the other CPU
# (the batch step API hashes new prompts on several threads).
_cpu = os.environ.get("KVBLOCK_BENCH_CPU", "0")
if _cpu != "none" and hasattr(os, "sched_setaffinity"):
    import kvblock._core  # noqa: E402

    kvblock._core.hashing_threads()
    try:
        os.sched_setaffinity(0, {int(_cpu)})  # this thread only (Linux)
    except (OSError, ValueError):
        pass

from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVBLOCK_SHARED", REPO.parent / "shared"))


def pytest_configure(config) -> None:
    """vLLM's scheduler benchmarks build a ``ModelConfig``, which reads a model's
    config.json: as the test suite does, lay an offline Hugging Face cache of
    shared/vllm/hf-configs in a temporary folder and point VLLM_TARGET_DEVICE / HF_HOME /
    HF_HUB_OFFLINE at it (values already set are kept)."""
    import atexit
    import shutil
    import sys
    import tempfile

    configs = SHARED / "vllm" / "hf-configs"
    if not configs.is_dir():
        return
    sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
    import judge

    home = Path(tempfile.mkdtemp(prefix="kvblock-bench-hf-"))
    atexit.register(shutil.rmtree, home, True)
    for key, value in judge.offline_env(judge.lay_hf_cache(home, configs)).items():
        os.environ.setdefault(key, value)

_RESULTS: dict[str, dict[str, tuple[float, float, float]]] = defaultdict(dict)
_LINES: list[str] = []


@pytest.fixture
def report_line():
    """``report_line(text)``: a line for the summary (a measured size, not a time)."""
    return _LINES.append


@pytest.fixture
def record(benchmark):
    """``record(group, impl, fn, *args, per=N)``: benchmark ``fn`` and keep its time per unit."""

    def run(group: str, impl: str, fn, *args, per: int = 1, rounds: int | None = None):
        benchmark.group = group
        benchmark.extra_info["impl"] = impl
        if rounds is None:
            benchmark(fn, *args)
        else:
            benchmark.pedantic(fn, args=args, rounds=rounds, iterations=1, warmup_rounds=1)
        st = benchmark.stats.stats
        _RESULTS[group][impl] = (st.min / per, st.median / per, float(per))

    return run


@pytest.fixture
def record_measured():
    """``record_measured(group, impl, samples)``: keep times measured inside a run (e.g. the
    manager time of a workload replay), in seconds per unit, one sample per repetition."""

    def run(group: str, impl: str, samples: list[float]):
        s = sorted(samples)
        _RESULTS[group][impl] = (s[0], s[len(s) // 2], 1.0)

    return run


#: where the run's measurements are written for ``benches/summary.py`` (the README table)
SUMMARY_JSON = Path(os.environ.get("KVBLOCK_BENCH_SUMMARY", REPO / ".benchmarks" / "kvblock-summary.json"))


def _vllm_version() -> str:
    """The vLLM the vLLM benches ran (the summary's baseline), "0.33.0" where none is loaded."""
    import sys

    vllm = sys.modules.get("vllm")
    return str(getattr(vllm, "__version__", "0.33.0"))


def _write_summary() -> None:
    import json
    import platform

    SUMMARY_JSON.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "vllm": _vllm_version(),
        "results": {g: {impl: {"min_s": v[0], "median_s": v[1]} for impl, v in r.items()} for g, r in _RESULTS.items()},
        "lines": _LINES,
    }
    SUMMARY_JSON.write_text(json.dumps(data, indent=1))


def pytest_terminal_summary(terminalreporter):
    if _RESULTS or _LINES:
        _write_summary()
    if _LINES:
        terminalreporter.section("kvblock measurements")
        for line in _LINES:
            terminalreporter.write_line(line)
    if not _RESULTS:
        return
    tr = terminalreporter
    tr.section("kvblock vs reference (time per unit; ratio = reference / kvblock)")
    tr.write_line(f"{'group':58s} {'kvblock min':>14s} {'reference min':>14s} {'ratio(min)':>10s} {'ratio(median)':>13s}")
    for group in sorted(_RESULTS):
        r = _RESULTS[group]
        if "kvblock" not in r or "reference" not in r:
            continue
        (kmin, kmed, _), (rmin, rmed, _) = r["kvblock"], r["reference"]
        tr.write_line(
            f"{group:58s} {kmin * 1e9:12.0f}ns {rmin * 1e9:12.0f}ns {rmin / kmin:9.1f}x {rmed / kmed:12.1f}x"
        )
    vllm_groups = [g for g in sorted(_RESULTS) if "vllm" in _RESULTS[g] and "kvblock" in _RESULTS[g]]
    if vllm_groups:
        # test_bench_vllm.py ran vLLM itself (when installed) on the same workload
        tr.section(f"kvblock vs vLLM {_vllm_version()} itself (ratio = vLLM / kvblock)")
        tr.write_line(f"{'group':58s} {'kvblock min':>14s} {'vLLM min':>14s} {'ratio(min)':>10s} {'ratio(median)':>13s}")
        for group in vllm_groups:
            (kmin, kmed, _), (vmin, vmed, _) = _RESULTS[group]["kvblock"], _RESULTS[group]["vllm"]
            tr.write_line(
                f"{group:58s} {kmin * 1e9:12.0f}ns {vmin * 1e9:12.0f}ns {vmin / kmin:9.1f}x {vmed / kmed:12.1f}x"
            )
