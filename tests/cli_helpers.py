"""Running the ``kvblock`` command in-process from a test."""

from __future__ import annotations

from typing import Any


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``kvblock ARGV...`` through :func:`kvblock.cli.main`: its exit code (a usage error's
    ``SystemExit`` included), stdout and stderr; fails the test if stderr holds a traceback."""
    from kvblock.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code) if e.code is not None else 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err
