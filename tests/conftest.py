"""Shared fixtures: the reference material in ../shared and NONE_HASH hygiene."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVBLOCK_SHARED", REPO.parent / "shared"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def shared_path(*parts: str) -> Path:
    """A file under ../shared. Missing data fails in CI and skips elsewhere."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        msg = f"test data {p} is missing (set KVBLOCK_SHARED to the shared/ folder)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return p


def require_module(name: str):
    """Import an optional test dependency (torch, triton): a missing one fails in CI, where
    `make test` installs it, and skips the module's tests elsewhere."""
    if IN_CI:
        import importlib

        return importlib.import_module(name)
    return pytest.importorskip(name)


def pytest_sessionstart(session) -> None:
    """Ctrl-C reaches the processes tests start. A suite started with SIGINT ignored (under
    ``nohup``, or ``cmd &`` in a shell without job control) passes that to every child, and a
    Python started so installs no KeyboardInterrupt handler: the tests that stop a server or
    the CLI with SIGINT would wait for a Ctrl-C it never sees. A Python handler here is reset to
    the default in each child at exec, so the children get Python's usual handler."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config) -> None:
    """vLLM's CPU tests run offline (shared/vllm/README.md): before any test module imports
    vLLM, lay a Hugging Face cache of shared/vllm/hf-configs in a temporary folder and point
    VLLM_TARGET_DEVICE / HF_HOME / HF_HUB_OFFLINE at it (values already set are kept)."""
    import atexit
    import shutil
    import sys
    import tempfile

    configs = SHARED / "vllm" / "hf-configs"
    if not configs.is_dir():
        return
    sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
    import judge

    home = Path(tempfile.mkdtemp(prefix="kvblock-hf-"))
    atexit.register(shutil.rmtree, home, True)
    for key, value in judge.offline_env(judge.lay_hf_cache(home, configs)).items():
        os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def golden() -> dict:
    with open(shared_path("spec", "golden_vectors.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def workload_module():
    """The shared workload generator module (apc_workload.py)."""
    import importlib.util

    path = shared_path("workload", "apc_workload.py")
    spec = importlib.util.spec_from_file_location("apc_workload", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    import sys

    sys.modules["apc_workload"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def vllm_trace() -> list[dict]:
    with gzip.open(shared_path("workload", "e2e_trace_vllm_0.33.0.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def seed_env(monkeypatch):
    """Set PYTHONHASHSEED (or unset it with None) and re-initialise both roots on exit."""
    import kvblock.hashing as kh
    import kvblock.reference.hashing as rh

    saved = (kh._root_state(), rh._root_state())

    def set_seed(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", value)

    yield set_seed
    kh._restore_root_state(saved[0])
    rh._restore_root_state(saved[1])


from impls import IMPLS  # noqa: E402  (tests/ is on sys.path while conftest loads)


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    """Each KV cache manager implementation of ``tests/impls.py`` in turn."""
    return IMPLS[request.param]


@pytest.fixture
def apc(impl, monkeypatch):
    """Factory of :class:`apc_helpers.Harness` objects over ``impl``.

    The implementation's root hash is initialised as CASES.md assumes (``PYTHONHASHSEED``
    unset, so sha256 uses the seed ``"vllm-none-hash"``) and restored afterwards.
    """
    from apc_helpers import Harness

    hashing = impl.hashing
    saved = (hashing.NONE_HASH, hashing._NONE_HASH_SEED)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    def make(num_blocks: int, block_size: int, **kwargs) -> Harness:
        algo = kwargs.get("hash_algo", "sha256")
        hashing.init_none_hash(hashing.get_hash_fn_by_name(algo))
        return Harness(impl, num_blocks, block_size, **kwargs)

    yield make
    hashing.NONE_HASH, hashing._NONE_HASH_SEED = saved
