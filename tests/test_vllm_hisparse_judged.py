"""vLLM's own HiSparse tests on kvblock's manager (``KVBLOCK_VLLM_HISPARSE=1``, strict): the
ones that pass today, so the progress of the HiSparse views (``kvblock.vllm.hisparse``) is
guarded until every HiSparse test passes and the switch goes (``docs/hisparse.md``).

``tests/vllm_judge/hisparse_passing.json`` lists, per vLLM release series, the tests of the
handed-over ``tests/v1/core/test_prefix_caching.py`` / ``test_kv_cache_utils.py`` that pass
with the switch on; this file runs them, for the installed release, as the judge runs vLLM's
tests (``-p kvblock.vllm.testing``, offline), and checks that every one passed and none fell back
to vLLM's manager (the layout tests build no manager). ``tests/test_vllm_releases.py`` runs it under the other releases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, require_module, shared_path

require_module("vllm")

sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
import judge  # noqa: E402

from kvblock.vllm.releases import current  # noqa: E402

SERIES = current().series
PASSING = json.loads((REPO / "tests" / "vllm_judge" / "hisparse_passing.json").read_text())


def test_vllm_hisparse_tests_pass_on_kvblock():
    tests = PASSING.get(SERIES)
    if not tests:
        pytest.skip(f"no HiSparse tests listed for vLLM {SERIES}")
    root = shared_path("vllm", f"tests-{SERIES}.0")
    env = dict(os.environ)
    env.pop("KVBLOCK_VLLM", None)
    env.update(KVBLOCK_VLLM_HISPARSE="1", KVBLOCK_VLLM_STRICT="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "-p", "kvblock.vllm.testing"]
    if SERIES == "0.34":
        cmd += ["-p", "triton_shim"]
    with tempfile.TemporaryDirectory(prefix="kvblock-hisparse-") as tmp:
        env.update(judge.offline_env(judge.lay_hf_cache(Path(tmp) / "hf")))
        report = Path(tmp) / "report.json"
        cmd += ["--kvblock-report", str(report)]
        out = subprocess.run(
            cmd + [f"tests/v1/core/{t}" for t in tests], cwd=root, env=env, capture_output=True, text=True, timeout=900
        )
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-40:])
        assert out.returncode == 0, f"vLLM {SERIES}'s HiSparse tests on kvblock:\n{tail}"
        summary = json.loads(report.read_text())
    assert summary["outcomes"].get("passed") == len(tests), summary["outcomes"]
    # the layout tests of test_kv_cache_utils.py build no manager; every other one is kvblock's
    counts = summary["counts"]
    assert not counts.get("fallback"), counts
    assert counts.get("kvblock", 0) >= len(tests) - counts.get("no manager", 0) > 0, counts
