"""Ctrl-C ends every command the same way: one ``...: interrupted`` line on stderr, exit
status 130, no traceback; also while the command's modules are still importing, while
``kvblock index serve`` starts up or serves, and in ``make test`` (issue 34, a fresh user's
find). The interrupt is raised deterministically: by an import hook at a chosen module, or
by a fake ``make`` that sends SIGINT to its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}


def _interrupt_at_import(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m kvblock ARGV`` with Ctrl-C arriving as ``module`` is imported."""
    script = textwrap.dedent(f"""
        import runpy, sys
        class Hook:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    raise KeyboardInterrupt
                return None
        sys.meta_path.insert(0, Hook())
        sys.argv = ["kvblock", *{argv!r}]
        runpy.run_module("kvblock", run_name="__main__", alter_sys=True)
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())


@pytest.mark.parametrize("module, argv", [
    ("kvblock._core", ["info"]),                     # `import kvblock` itself, before cli exists
    ("kvblock.manager", ["info"]),                   # the package's own imports
    ("kvblock.cli", ["info"]),                       # before main() runs
    ("kvblock.replay.errors", ["info"]),             # main()'s first import
    ("aiohttp", ["index", "serve", "--port", "0"]),  # index serve starting up
])
def test_ctrl_c_while_importing_is_one_line_and_130(module, argv):
    pytest.importorskip("aiohttp")
    r = _interrupt_at_import(module, argv)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == ["kvblock: interrupted"], r.stderr


@pytest.mark.parametrize("module", ["kvblock._core", "kvblock.manager"])
def test_ctrl_c_while_the_console_script_imports_kvblock(module, tmp_path):
    """The installed ``kvblock`` script runs ``from kvblock.cli import main``: Ctrl-C while that
    imports the package ends it with one line and 130 too."""
    script = tmp_path / "kvblock"
    script.write_text(textwrap.dedent(f"""
        import sys
        class Hook:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    raise KeyboardInterrupt
                return None
        sys.meta_path.insert(0, Hook())
        from kvblock.cli import main
        sys.exit(main())
    """))
    r = subprocess.run([sys.executable, str(script), "info"], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == ["kvblock: interrupted"], r.stderr


def test_ctrl_c_while_a_program_imports_kvblock_stays_a_keyboard_interrupt():
    """Only the kvblock command exits quietly: a program importing the library gets its
    KeyboardInterrupt, as from any other import."""
    script = textwrap.dedent("""
        import sys
        class Hook:
            def find_spec(self, name, path=None, target=None):
                if name == "kvblock._core":
                    raise KeyboardInterrupt
                return None
        sys.meta_path.insert(0, Hook())
        try:
            import kvblock
        except KeyboardInterrupt:
            print("caught")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0 and r.stdout.strip() == "caught", (r.stdout, r.stderr)


def test_ctrl_c_in_make_test_is_one_line_and_130(tmp_path):
    """scripts/make_test.py used to print a traceback from its output loop."""
    fake = tmp_path / "make"
    fake.write_text(f"#!{sys.executable}\nimport os, signal, sys, time\nprint('== cargo test', flush=True)\n"
                    "os.kill(os.getppid(), signal.SIGINT)\ntime.sleep(60)\n")
    fake.chmod(0o755)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_test.py"), str(fake)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["== make test: interrupted"], r.stderr
