"""pytest plugin that runs vLLM tests with kvblock swapped in.

``python -m pytest -p kvblock.vllm.testing path/to/vllm/tests`` calls
:func:`kvblock.vllm.patch` before any test module is imported, so every vLLM test builds
kvblock's KV cache manager, block pool and request hasher where it would build vLLM's.

Options:

* ``--kvblock-exclusions FILE``: tests expected to fail with kvblock, one per line as
  ``<node id suffix>  # <reason>``; they run as strict xfails (an excluded test that passes
  fails the run, so the file cannot go stale).
* ``--kvblock-report FILE``: write a JSON summary: ``counts`` (tests by the manager they
  built), ``outcomes`` (passed / failed / xfailed / ... counts) and ``tests`` (per test: which
  manager it built).

At the end the run reports how many tests built kvblock's manager, how many fell back to
vLLM's own (and why), and how many built no manager.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from . import patch
from .manager import fallback_counter, kvblock_counter

patch()

_results: dict[str, str] = {}
_outcomes: dict[str, str] = {}
_exclusions: dict[str, str] = {}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kvblock")
    group.addoption("--kvblock-exclusions", default=None, help="file of tests expected to fail on kvblock, with reasons")
    group.addoption("--kvblock-report", default=None, help="write a JSON summary of which manager each test built")


def _load_exclusions(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            test, sep, reason = line.partition("#")
            test, reason = test.strip(), reason.strip()
            if not sep or not reason:
                raise pytest.UsageError(f"{path}:{n}: every excluded test needs a reason after '#'")
            out[test] = reason
    return out


def pytest_configure(config: Any) -> None:
    path = config.getoption("--kvblock-exclusions")
    if path:
        _exclusions.update(_load_exclusions(path))
    for marker in ("cpu_test", "skip_global_cleanup", "core_model", "slow_test"):
        config.addinivalue_line("markers", f"{marker}: vLLM test marker")


def _excluded(nodeid: str) -> str | None:
    for test, reason in _exclusions.items():
        if nodeid == test or nodeid.endswith(test) or nodeid.endswith("/" + test):
            return reason
    return None


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        reason = _excluded(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"kvblock: {reason}", strict=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    before = (kvblock_counter[0], fallback_counter[0])
    yield
    built, fell = kvblock_counter[0] - before[0], fallback_counter[0] - before[1]
    _results[item.nodeid] = "fallback" if fell else ("kvblock" if built else "no manager")


def pytest_runtest_logreport(report: Any) -> None:
    # one outcome per test: a failed setup or teardown counts as an error
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when != "call" and report.failed:
            outcome = "error"
        else:
            outcome = report.outcome
        if report.nodeid not in _outcomes or outcome in ("failed", "error", "xpassed"):
            _outcomes[report.nodeid] = outcome


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    counts = Counter(_results.values())
    terminalreporter.write_sep("=", "kvblock")
    terminalreporter.write_line(
        f"tests that built kvblock's KV cache manager: {counts['kvblock']}; "
        f"fell back to vLLM's own: {counts['fallback']}; built no manager: {counts['no manager']}"
    )
    if _exclusions:
        terminalreporter.write_line(f"excluded (strict xfail, reasons in the exclusions file): {len(_exclusions)}")
    path = config.getoption("--kvblock-report")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(
                {"counts": dict(counts), "outcomes": dict(Counter(_outcomes.values())), "tests": _results},
                f,
                indent=1,
                sort_keys=True,
            )
