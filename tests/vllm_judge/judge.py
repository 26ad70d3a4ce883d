"""Offline test setup for vLLM 0.33.0 on CPU, as ``../shared/vllm/README.md`` describes.

* :func:`lay_hf_cache` builds a Hugging Face hub cache (``hub/models--ORG--NAME/refs/main`` and
  ``snapshots/<sha>/<files>``) from ``shared/vllm/hf-configs/ORG/NAME/*.json``, so that tests
  building a ``ModelConfig`` find their model's config without the network.
* :func:`offline_env` gives the environment those tests need (``VLLM_TARGET_DEVICE=cpu``,
  ``HF_HOME`` on that cache, ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``).
* :func:`run_judge` copies vLLM's own tests out of ``shared`` (read-only in CI, and importing
  themselves as the package ``tests``) into a temporary folder and runs them with kvblock
  swapped in (``-p kvblock.vllm.testing``) and the checked-in exclusions file.

Run as a script it runs the judge and exits with pytest's status:
``python tests/vllm_judge/judge.py [--report FILE] [pytest args...]``; paths or node ids under
``tests/`` among the arguments (``tests/v1/core/test_prefix_caching.py``) narrow the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
EXCLUSIONS = HERE / "exclusions.txt"
SNAPSHOT = "0" * 40


def shared_dir() -> Path:
    return Path(os.environ.get("KVBLOCK_SHARED", REPO.parent / "shared"))


def lay_hf_cache(dest: Path, configs: Path | None = None) -> Path:
    """Lay an offline hub cache under ``dest`` (used as ``HF_HOME``) from ``configs``
    (default ``shared/vllm/hf-configs``). Idempotent. Returns ``dest``. Raises
    FileNotFoundError when ``configs`` holds no model folder."""
    configs = configs or shared_dir() / "vllm" / "hf-configs"
    models = sorted(p for p in configs.glob("*/*") if p.is_dir())
    if not models:
        raise FileNotFoundError(f"no model configs under {configs}")
    for model in models:
        org, name = model.parent.name, model.name
        root = dest / "hub" / f"models--{org}--{name}"
        snap = root / "snapshots" / SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(SNAPSHOT)
        for f in model.iterdir():
            if f.is_file():
                shutil.copyfile(f, snap / f.name)
    return dest


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment variables vLLM's CPU tests need, offline, over ``hf_home``."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def run_judge(report: Path | None = None, extra_args: list[str] | None = None, python: str = sys.executable) -> int:
    """Run vLLM 0.33.0's own tests (``shared/vllm/tests-0.33.0/tests``) with kvblock swapped in.
    Returns pytest's exit status; ``report`` receives kvblock's JSON summary (which manager
    each test built)."""
    src = shared_dir() / "vllm" / "tests-0.33.0" / "tests"
    if not src.is_dir():
        raise FileNotFoundError(f"vLLM's tests are missing: {src} (set KVBLOCK_SHARED)")
    with tempfile.TemporaryDirectory(prefix="kvblock-vllm-judge-") as tmp:
        work = Path(tmp)
        shutil.copytree(src, work / "tests", copy_function=shutil.copyfile)
        for d, _dirs, files in os.walk(work):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        env = dict(os.environ)
        env.update(offline_env(lay_hf_cache(work / "hf")))
        env.pop("KVBLOCK_VLLM_STRICT", None)
        cmd = [python, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-p", "kvblock.vllm.testing",
               f"--rootdir={work}", f"--kvblock-exclusions={EXCLUSIONS}", "-q", "-rfEX"]
        if report is not None:
            cmd.append(f"--kvblock-report={report}")
        extra = list(extra_args or [])
        # paths or node ids under tests/ (tests/v1/core/test_prefix_caching.py::...) narrow the
        # run; without any, all of vLLM's tests run
        cmd += extra if any(a.startswith("tests/") for a in extra) else extra + ["tests"]
        return subprocess.call(cmd, cwd=work, env=env)


if __name__ == "__main__":
    args = sys.argv[1:]
    report = None
    if args[:1] == ["--report"]:
        report, args = Path(args[1]), args[2:]
    sys.exit(run_judge(report, args))
