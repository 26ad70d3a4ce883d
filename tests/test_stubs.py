"""``python/kvblock/_core.pyi`` describes exactly what the compiled ``kvblock._core`` exports."""

from __future__ import annotations

import ast
from pathlib import Path

import kvblock._core as core

STUB = Path(__file__).resolve().parent.parent / "python" / "kvblock" / "_core.pyi"
#: In the binary only when it is built with a cargo feature (``BENCH_TIMERS``: ``bench-timers``).
FEATURE_GATED = {"CallClock", "TimedCall"}
DUNDERS = {"__new__", "__call__", "__len__", "__getitem__", "__iter__", "__contains__", "__name__"}


def _stub_surface() -> dict[str, set[str] | None]:
    tree = ast.parse(STUB.read_text())
    out: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_") or node.target.id == "__version__":
                out[node.target.id] = None
    return out


def test_stub_matches_binary():
    stub = _stub_surface()
    binary = {n for n in dir(core) if not n.startswith("__") or n == "__version__"}
    assert FEATURE_GATED & binary == (FEATURE_GATED if core.BENCH_TIMERS else set())
    assert set(stub) == binary - FEATURE_GATED
    for name, members in stub.items():
        obj = getattr(core, name)
        if members is None:
            continue
        actual = {m for m in vars(obj) if not m.startswith("__") or m in DUNDERS}
        assert members == actual, name


def test_pyclasses_name_their_module():
    for name in ("HashFunction", "RequestBlockHasher", "BlockIds", "BlockPoolCore", "KVCacheManagerCore",
                 "PrefixIndexCore"):
        assert getattr(core, name).__module__ == "kvblock._core"
