"""A missing optional dependency is named with what to pip-install, in a fresh interpreter
where the dependency's import is blocked (``sys.modules[name] = None``). kvblock is not on
PyPI: ``pip install 'kvblock[extra]'`` fails, so the hint names the package itself (issue 34)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    "vllm": ("vllm", "import kvblock.vllm", "kvblock.vllm needs vLLM (0.32.x-0.34.x)", "pip install 'vllm>=0.32,<0.35'"),
    "zmq": ("zmq", "from kvblock.cluster import KVEventSubscriber\nKVEventSubscriber(None)",
            "KVEventSubscriber needs pyzmq", "pip install pyzmq (kvblock's 'cluster' extra)"),
    "redis": ("redis", "from kvblock.cluster import RedisPrefixIndex\nRedisPrefixIndex('redis://127.0.0.1:1')",
              "RedisPrefixIndex needs redis", "pip install redis (kvblock's 'cluster' extra)"),
    "torch": ("torch", "import kvblock.worker.demo", "kvblock demo (kvblock.worker.demo) needs torch", "pip install torch (kvblock's 'torch' extra)"),
    "matplotlib": ("matplotlib", "from kvblock.replay.plot import plot_sweep\nplot_sweep({}, 'x.png')",
                   "--plot needs matplotlib", "pip install matplotlib (kvblock's 'plot' extra)"),
    "matplotlib-fleet": ("matplotlib", "from kvblock.replay.fleet import plot_fleet_sweep\nplot_fleet_sweep({}, 'x.png')",
                         "--plot needs matplotlib", "pip install matplotlib (kvblock's 'plot' extra)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_missing_optional_dependency_names_its_extra(case):
    module, code, what, hint = CASES[case]
    script = f"import sys\nsys.modules[{module!r}] = None\n{code}\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.split(":")[0] in ("ModuleNotFoundError", "kvblock.errors.MissingExtraError", "ImportError",
                                   "kvblock.replay.errors.ReplayError"), r.stderr
    assert what in last and hint in last and "kvblock[" not in last, last


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
    with pytest.raises(ModuleNotFoundError, match=r"needs x, which is not installed: pip install kvblock_test_absent_dep \(kvblock's 'x' extra\)"):
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
    assert f"pip install {'pyzmq' if module == 'zmq' else 'redis'} (kvblock's 'cluster' extra)" in lines[0], lines[0]


def test_demo_help_and_usage_errors_need_no_torch():
    """``kvblock demo --help`` used to fail without torch; the demo itself says what to install."""
    script = (
        "import sys\nsys.modules['torch'] = None\nfrom kvblock.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)

    r = run("demo", "--help")
    assert r.returncode == 0 and "--conversations" in r.stdout, r.stderr
    assert "Needs torch (pip install torch)" in " ".join(r.stdout.split())
    r = run("demo", "--turns", "x")
    assert r.returncode == 2 and "invalid int value" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("demo")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "kvblock: error: kvblock demo (kvblock.worker.demo) needs torch: pip install torch (kvblock's 'torch' extra)"
    ], r.stderr


def test_index_serve_names_every_missing_package_at_once():
    """``kvblock index serve`` without two of the ``cluster`` extra's packages: one line naming
    both and one ``pip install`` of both, exit status 2 (a fresh user was told of aiohttp
    alone, then would have met the next)."""
    script = (
        "import sys\nsys.modules['aiohttp'] = None\nsys.modules['zmq'] = None\nfrom kvblock.cli import main\n"
        "sys.exit(main(['index', 'serve', '--model', 'm', '--port', '0']))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblock: error: "), r.stderr
    assert "kvblock index serve needs aiohttp and pyzmq, which are not installed" in lines[0], lines[0]
    assert "pip install aiohttp pyzmq (kvblock's 'cluster' extra)" in lines[0], lines[0]
