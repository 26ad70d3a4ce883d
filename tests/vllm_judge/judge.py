"""Offline test setup for vLLM 0.32.0, 0.33.0 and 0.34.0 on CPU, as ``../shared/vllm/README.md``
describes.

* :func:`lay_hf_cache` builds a Hugging Face hub cache (``hub/models--ORG--NAME/refs/main`` and
  ``snapshots/<sha>/<files>``) from ``shared/vllm/hf-configs/ORG/NAME/*.json``, so that tests
  building a ``ModelConfig`` find their model's config without the network.
* :func:`offline_env` gives the environment those tests need (``VLLM_TARGET_DEVICE=cpu``,
  ``HF_HOME`` on that cache, ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``).
* :func:`run_judge` copies one release's own tests out of ``shared`` (read-only in CI, and
  importing themselves as the package ``tests``) into a temporary folder and runs them, with
  that release's vLLM (:func:`release_python`), with kvblock swapped in
  (``-p kvblock.vllm.testing``) and that release's checked-in exclusions file
  (``exclusions-0.3X.txt``). 0.34.0 runs with ``shared/vllm/cpu-harness/triton_shim.py``, the
  harness that lets its ``VllmConfig`` build on an x86 CPU without triton-cpu (applied the same
  way to stock runs).

Run as a script it runs the judge and exits with pytest's status:
``python tests/vllm_judge/judge.py [--release 0.34] [--stock] [--report FILE] [pytest args...]``;
paths or node ids under ``tests/`` among the arguments (``tests/v1/core/test_prefix_caching.py``)
narrow the run; ``--stock`` runs the same tests on stock vLLM (no kvblock).
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
SNAPSHOT = "0" * 40
#: The vLLM releases kvblock.vllm is judged against (kvblock.vllm.releases.WINDOW).
RELEASES = ("0.32", "0.33", "0.34")

#: Tests that pass on each stock release (shared/vllm/README.md), the number every judge run
#: must reach: passed plus the excluded (strict xfails).
STOCK_PASSES = {"0.32": 393, "0.33": 394, "0.34": 420}

#: Tests of a release's set that do not pass on stock vLLM either, left out of its judge run:
#: 0.32's eight that need vLLM's root-conftest fixture ``caplog_vllm`` (``--noconftest``
#: leaves it out; shared/vllm/README.md counts them as errors, not stock passes).
NOT_STOCK_PASSES = {
    "0.32": [
        "tests/v1/core/test_kv_cache_utils.py::" + name
        for name in (
            "test_mla_with_incompatible_swa_uses_one_full_allocation_group",
            "test_unidentifiable_draft_with_mamba_warns",
            "test_unidentifiable_draft_without_mamba_does_not_warn",
            "test_no_warning_when_draft_group_is_identified",
            "test_qwen3_5_mtp_draft_group_annotated_on_hybrid_path",
            "test_non_mtp_eagle_hybrid_still_warns",
        )
    ],
}


def exclusions(release: str) -> Path:
    """The checked-in exclusions file of ``release`` (``"0.33"``)."""
    return HERE / f"exclusions-{release}.txt"


def release_python(release: str) -> Path:
    """The Python of the venv holding ``release``: ``.venv-vllm/<release>/bin/python``
    (``scripts/vllm_envs.sh``), or this interpreter for the release installed here (0.33 in
    ``.venv``). ``KVBLOCK_VLLM_<major>_<minor>_PYTHON`` overrides it."""
    override = os.environ.get("KVBLOCK_VLLM_" + release.replace(".", "_") + "_PYTHON")
    if override:
        return Path(override)
    venv = REPO / ".venv-vllm" / release / "bin" / "python"
    if venv.exists():
        return venv
    return Path(sys.executable)


def python_with_release(release: str) -> Path:
    """:func:`release_python` of ``release`` for a pytest test: skips when that Python does not
    hold vLLM ``release`` (``scripts/vllm_envs.sh`` makes it), and fails instead under
    ``CI=true``."""
    import pytest

    python = release_python(release)
    installed = installed_release(python)
    if installed != release:
        msg = f"vLLM {release} is not installed ({python} has {installed}); run scripts/vllm_envs.sh"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return python


def installed_release(python: Path) -> str | None:
    """The vLLM series (``"0.34"``) ``python`` imports, or None without vLLM."""
    out = subprocess.run(
        [str(python), "-c", "import vllm; print(\"vllm-version:\", vllm.__version__)"],
        capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    versions = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("vllm-version: ")]
    if out.returncode != 0 or not versions:
        return None
    return ".".join(versions[-1].split("+")[0].split(".")[:2])


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


def run_judge(
    report: Path | None = None,
    extra_args: list[str] | None = None,
    python: str | Path | None = None,
    release: str = "0.33",
    stock: bool = False,
) -> int:
    """Run vLLM ``release``'s own tests (``shared/vllm/tests-<release>.0``) with kvblock swapped
    in (``stock``: without it), on ``python`` (default :func:`release_python`). Returns
    pytest's exit status; ``report`` receives kvblock's JSON summary (which manager each test
    built)."""
    root = shared_dir() / "vllm" / f"tests-{release}.0"
    src = root / "tests"
    if not src.is_dir():
        raise FileNotFoundError(f"vLLM's tests are missing: {src} (set KVBLOCK_SHARED)")
    python = python or release_python(release)
    with tempfile.TemporaryDirectory(prefix=f"kvblock-vllm-judge-{release}-") as tmp:
        work = Path(tmp)
        # 0.34's prompt-hash vectors test reads a data file under rust/ beside tests/
        for sub in ("tests", "rust"):
            if (root / sub).is_dir():
                shutil.copytree(root / sub, work / sub, copy_function=shutil.copyfile)
        for d, _dirs, files in os.walk(work):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        env = dict(os.environ)
        env.update(offline_env(lay_hf_cache(work / "hf")))
        env.pop("KVBLOCK_VLLM", None)
        env.pop("KVBLOCK_VLLM_STRICT", None)
        cmd = [str(python), "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", f"--rootdir={work}", "-q", "-rfEX"]
        if release == "0.34":
            harness = shared_dir() / "vllm" / "cpu-harness"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness), env.get("PYTHONPATH", "")) if p)
            cmd += ["-p", "triton_shim"]
        for node in NOT_STOCK_PASSES.get(release, []):
            cmd += ["--deselect", node]
        if not stock:
            # strict: a configuration kvblock's manager does not hold fails instead of falling back
            env["KVBLOCK_VLLM_STRICT"] = "1"
            cmd += ["-p", "kvblock.vllm.testing", f"--kvblock-exclusions={exclusions(release)}"]
            if report is not None:
                cmd.append(f"--kvblock-report={report}")
        extra = list(extra_args or [])
        # paths or node ids under tests/ (tests/v1/core/test_prefix_caching.py::...) narrow the
        # run; without any, all of vLLM's tests run
        cmd += extra if any(a.startswith("tests/") for a in extra) else extra + ["tests"]
        return subprocess.call(cmd, cwd=work, env=env)


if __name__ == "__main__":
    args = sys.argv[1:]
    report, release, stock = None, "0.33", False
    while args[:1] and args[0] in ("--report", "--release", "--stock"):
        if args[0] == "--stock":
            stock, args = True, args[1:]
        elif args[0] == "--report":
            report, args = Path(args[1]), args[2:]
        else:
            release, args = args[1], args[2:]
    sys.exit(run_judge(report, args, release=release, stock=stock))
