"""The ``tests/typing/`` snippets, which ``scripts/typecheck.py`` type-checks with mypy
--strict, also run: the API they type is the one that works."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from conftest import require_module

SNIPPETS = sorted((Path(__file__).resolve().parent / "typing").glob("*.py"))


@pytest.mark.parametrize("path", SNIPPETS, ids=[p.name for p in SNIPPETS])
def test_snippet_runs(path):
    require_module("typing_extensions")  # installed with mypy (the test extra)
    runpy.run_path(str(path), run_name="__main__")


def test_there_are_snippets():
    assert len(SNIPPETS) >= 2
