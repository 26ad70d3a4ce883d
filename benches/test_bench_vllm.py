"""vLLM 0.33.0 itself on the end-to-end workload, in the same run as kvblock and the
reference (``test_bench_manager.py``): the summary then adds vLLM / kvblock ratios.

Runs only where vLLM 0.33.0 is installed (it is not a dependency of kvblock; see the README's
"Benchmarks" section for a CPU-only install). vLLM's run must give the workload's fingerprint
and hit count, as kvblock's does.
"""

from __future__ import annotations

import gc

import pytest

from vllm_baseline import VLLM_VERSION, run_vllm_e2e

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
FINGERPRINT = "e1adc1cd1c42a40f37d245eccd477680bf3e4bffd3257b00fe1db5613e488fb4"


def test_e2e_workload_vllm(record_measured):
    if vllm.__version__ != VLLM_VERSION:
        pytest.skip(f"needs vLLM {VLLM_VERSION}, found {vllm.__version__}")
    step_us, hashing_ms = [], []
    for _ in range(3):  # as many repetitions as kvblock and the reference get
        gc.collect()
        gc.freeze()
        r = run_vllm_e2e()
        gc.unfreeze()
        assert r.fingerprint == FINGERPRINT and r.hits == 1_150_464
        step_us.append(r.manager_ns / r.steps / 1e9)
        hashing_ms.append(r.hashing_ns / 1e9)
    for api in (" [per-request API]", " [batch step API]"):
        record_measured(f"manager time per scheduler step{api}", "vllm", step_us)
        record_measured(f"block hashing, whole run{api}", "vllm", hashing_ms)
