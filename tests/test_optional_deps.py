"""A missing optional dependency is named with the pip extra that installs it, in a fresh
interpreter where the dependency's import is blocked (``sys.modules[name] = None``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    "vllm": ("import kvblock.vllm", "kvblock.vllm needs vLLM (0.32.x-0.34.x)", "kvblock[vllm]"),
    "zmq": ("from kvblock.cluster import KVEventSubscriber\nKVEventSubscriber(None)",
            "KVEventSubscriber needs pyzmq", "kvblock[cluster]"),
    "redis": ("from kvblock.cluster import RedisPrefixIndex\nRedisPrefixIndex('redis://127.0.0.1:1')",
              "RedisPrefixIndex needs redis", "kvblock[cluster]"),
}


@pytest.mark.parametrize("module", list(CASES))
def test_missing_optional_dependency_names_its_extra(module):
    code, what, extra = CASES[module]
    script = f"import sys\nsys.modules[{module!r}] = None\n{code}\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: "), r.stderr
    assert what in last and f"pip install '{extra}'" in last, last


def test_an_import_error_inside_an_installed_dependency_passes_through(tmp_path, monkeypatch):
    """Only the dependency's own absence is reworded: a module the installed dependency
    fails to import keeps its own error."""
    from kvblock._optional import require

    (tmp_path / "kvblock_test_dep").mkdir()
    (tmp_path / "kvblock_test_dep" / "__init__.py").write_text("import kvblock_test_missing_inner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("kvblock_test_dep", package="x", extra="x", what="x")
    assert info.value.name == "kvblock_test_missing_inner"
    assert "pip install" not in str(info.value)
    with pytest.raises(ModuleNotFoundError, match=r"needs x, which is not installed: pip install 'kvblock\[x\]'"):
        require("kvblock_test_absent_dep", package="x", extra="x", what="x")


@pytest.mark.parametrize("module, option", [("zmq", ["--transport", "zmq"]), ("redis", ["--index", "redis://127.0.0.1:1"])])
def test_the_cli_names_the_extra_in_one_line_and_exits_2(module, option):
    """A fleet replay with an option whose dependency is missing: one ``kvblock: error:`` line
    naming the extra, exit status 2, no traceback (a fresh user's find)."""
    script = (
        f"import sys\nsys.modules[{module!r}] = None\nfrom kvblock.cli import main\n"
        f"sys.exit(main(['replay', '--instances', '2', '--limit', '4', '--no-progress', *{option!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblock: error: "), r.stderr
    assert "pip install 'kvblock[cluster]'" in lines[0], lines[0]
