"""kvblock's own tests of ``kvblock.vllm`` on every supported vLLM release, not just the one in
``.venv``: the signature drift test, the plugin and scheduler tests, the lockstep state
machine against vLLM's own manager, the residency metrics, the bad-input comparison, the kept lockstep cases and the
request-field reads each run under the other releases' venvs (``.venv-vllm/0.32``,
``.venv-vllm/0.34``: ``scripts/vllm_envs.sh``), so what vLLM changed between releases is
judged by the same checks as the release they were written on.

0.34 runs with ``shared/vllm/cpu-harness/triton_shim.py`` (its ``VllmConfig`` refuses to build on
an x86 CPU without triton-cpu; the harness restores 0.33's warning, for stock and kvblock alike).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, shared_path

sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
import judge  # noqa: E402

pytestmark = pytest.mark.slow

#: kvblock's own kvblock.vllm test files, run under each release.
FILES = [
    "tests/test_vllm_plugin.py",
    "tests/test_vllm_lockstep.py",
    "tests/test_vllm_metrics.py",
    "tests/test_vllm_lockstep_cases.py",
    "tests/test_vllm_bad_input.py",
    "tests/test_vllm_request_reads.py",
    "tests/test_vllm_unpin_lockstep.py",
    "tests/test_vllm_hisparse_lockstep.py",
    "tests/test_vllm_hisparse_manager.py",
    "tests/test_vllm_manager_views.py",
    "tests/test_vllm_hisparse_views.py",
]
#: Not ported to vLLM 0.32 yet: the kept cases, the bad-input comparison and the request-read
#: tests build vLLM's hasher and manager with 0.33's arguments (a hash lookahead). The others
#: (drift, plugin, lockstep, residency metrics, HiSparse, per-type views) run under 0.32 (the
#: views' partial hit cases need a hash lookahead and skip there).
NOT_PORTED_032 = {
    "tests/test_vllm_lockstep_cases.py",
    "tests/test_vllm_bad_input.py",
    "tests/test_vllm_request_reads.py",
}
FILES_032 = [f for f in FILES if f not in NOT_PORTED_032]


def _here() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return ".".join(vllm.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("release", [r for r in judge.RELEASES if r != _here()])
def test_kvblock_vllm_tests_pass_on_release(release):
    python = judge.python_with_release(release)
    env = dict(os.environ)
    for k in ("KVBLOCK_VLLM", "KVBLOCK_VLLM_STRICT"):
        env.pop(k, None)
    with tempfile.TemporaryDirectory(prefix=f"kvblock-vllm-{release}-") as tmp:
        env.update(judge.offline_env(judge.lay_hf_cache(Path(tmp) / "hf")))
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "-x"]
        if release == "0.34":
            harness = shared_path("vllm", "cpu-harness")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness), env.get("PYTHONPATH", "")) if p)
            cmd += ["-p", "triton_shim"]
        files = FILES_032 if release == "0.32" else FILES
        out = subprocess.run(cmd + files, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    tail = "\n".join((out.stdout + out.stderr).splitlines()[-40:])
    assert out.returncode == 0, f"kvblock's vLLM tests on vLLM {release}:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
