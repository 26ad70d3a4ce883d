"""``make test`` ends with one summary line of every stage (issue 34: the pass / skip counts
sat 60 lines above the end), runs every stage when one fails, and fails when any does. Real
``make`` and the real driver (scripts/make_test.py) on a Makefile whose stages print what
cargo, pytest, scripts/typecheck.py and scripts/smoke_pythons.sh print."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parent.parent / "scripts" / "make_test.py"

STAGES = {
    "rust-test": [
        "== cargo test --release: the Rust core's own tests",
        "test result: ok. 120 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.20s",
        "test result: ok. 30 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.10s",
    ],
    "py-test": [
        "== pytest: the whole Python suite on Python 3.11.9",
        "1700 passed, 6 skipped, 14 warnings in 181.52s (0:03:01)",
    ],
    "py-test-no-fast-paths": [
        "== no fast paths: pytest with KVBLOCK_NO_FAST_PATHS=1 (manager, pool, ...)",
        "338 passed, 5 skipped, 163 deselected, 14 warnings in 156.81s (0:02:36)",
    ],
    "typecheck": [
        "== type checks: mypy --strict on the README's examples and tests/typing/, stubtest of kvblock._core",
        "== mypy --strict on 6 README examples and 2 tests/typing snippets: mypy --strict x.py",
        "Success: no issues found in 8 source files",
        "== stubtest: mypy.stubtest kvblock._core",
        "Success: no issues found in 1 module",
    ],
    "smoke": [
        "== smoke tests on the other CPythons found: 3.10 3.11 3.12 3.13",
        "== smoke CPython 3.10: skipped: no CPython 3.10 found (python3.10 on PATH or under pyenv)",
        "== smoke CPython 3.11: skipped (the full suite runs on it)",
        "== smoke CPython 3.12: passed in 95 s",
        "== smoke CPython 3.13: skipped: no CPython 3.13 found (python3.13 on PATH or under pyenv)",
    ],
    "docs": [
        "== docs: mkdocs build --strict into site/ (requirements/docs.txt in .venv)",
        "INFO    -  Building documentation to directory: site",
        "INFO    -  Documentation built in 4.92 seconds",
    ],
}


def makefile(tmp_path: Path, stages: dict[str, list[str]], fail: str | None = None) -> Path:
    lines = [".PHONY: " + " ".join(stages)]
    for target, out in stages.items():
        lines.append(f"{target}:")
        lines += ["\t@echo '" + ln.replace("'", "'\\''") + "'" for ln in out]
        if target == fail:
            lines.append("\t@exit 1")
    lines.append("test:\n\t@" + sys.executable + f" {DRIVER}")
    (tmp_path / "Makefile").write_text("\n".join(lines) + "\n")
    return tmp_path


def make_test(directory: Path) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    return subprocess.run(["make", "--no-print-directory", "test"], cwd=directory, capture_output=True, text=True,
                          timeout=120)


def test_the_last_line_sums_up_every_stage(tmp_path):
    r = make_test(makefile(tmp_path, STAGES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == (
        "== make test passed: cargo test 150 passed, 0 failed, 2 ignored; "
        "pytest 1,700 passed, 0 failed, 6 skipped; no fast paths 338 passed, 0 failed, 5 skipped; typecheck 2 passed, 0 failed; "
        "smoke 1 passed, 0 failed, 3 skipped; docs 1 passed, 0 failed"
    )
    assert "1700 passed, 6 skipped" in r.stdout  # every stage's own output still shows


def test_a_failed_stage_is_counted_and_the_rest_still_run(tmp_path):
    stages = dict(STAGES)
    stages["py-test"] = ["== pytest: the whole Python suite", "3 failed, 1697 passed, 6 skipped in 180.00s"]
    r = make_test(makefile(tmp_path, stages, fail="py-test"))
    assert r.returncode != 0
    last = r.stdout.splitlines()[-1]
    assert last.startswith("== make test FAILED: ") and "pytest 1,697 passed, 3 failed, 6 skipped" in last, last
    assert "smoke 1 passed" in last and "(make exit status 2)" in last


def test_a_stage_that_never_started_is_named(tmp_path):
    stages = {k: v for k, v in STAGES.items() if k != "typecheck"}
    stages["typecheck"] = ["no header: the install it needs failed"]
    r = make_test(makefile(tmp_path, stages, fail="typecheck"))
    last = r.stdout.splitlines()[-1]
    assert r.returncode != 0 and "typecheck not run" in last, last


def test_a_strict_docs_build_that_warned_fails(tmp_path):
    stages = dict(STAGES)
    stages["docs"] = ["== docs: mkdocs build --strict into site/",
                      "WARNING -  Doc file 'index.md' contains a link 'nowhere.md', but the target is not found",
                      "Aborted with 1 warnings in strict mode!"]
    r = make_test(makefile(tmp_path, stages, fail="docs"))
    last = r.stdout.splitlines()[-1]
    assert r.returncode != 0 and last.startswith("== make test FAILED: ") and "docs 0 passed, 1 failed" in last, last


def test_docs_skipped_on_an_old_cpython_is_counted_as_skipped(tmp_path):
    stages = dict(STAGES)
    stages["docs"] = ["== docs: mkdocs build --strict into site/",
                      "== docs skipped: mkdocs-material 9.8 and mkdocstrings-python 2 need CPython 3.11+"]
    r = make_test(makefile(tmp_path, stages))
    last = r.stdout.splitlines()[-1]
    assert r.returncode == 0 and "docs 0 passed, 0 failed, 1 skipped" in last, last
