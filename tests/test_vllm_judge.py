"""Each supported vLLM release's own tests judge kvblock: every test of
``shared/vllm/tests-0.3X.0`` that passes on that stock release runs with kvblock swapped in
(``-p kvblock.vllm.testing``) against that release (``.venv`` holds 0.33, ``.venv-vllm/0.32``
and ``.venv-vllm/0.34`` the others: ``scripts/vllm_envs.sh``), and passes, except those listed
with reasons in ``tests/vllm_judge/exclusions-0.3X.txt`` (strict xfails, so the lists cannot
go stale). Strict: a configuration kvblock's manager would not hold fails the test instead of
falling back."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, require_module, shared_path

sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
import judge  # noqa: E402

pytestmark = pytest.mark.slow

#: Tests that build kvblock's manager, per release (the rest build no manager: hashing,
#: utilities, events). The judge runs strict (``KVBLOCK_VLLM_STRICT=1``): none falls back to
#: vLLM's own manager, HiSparse included. 0.32's Mamba prefix caching runs on kvblock (its
#: release rules).
ON_KVBLOCK = {"0.32": 157, "0.33": 197, "0.34": 206}


def _exclusions(release: str) -> list[str]:
    lines = judge.exclusions(release).read_text().splitlines()
    return [ln for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("release", judge.RELEASES)
def test_exclusions_have_reasons(release):
    entries = _exclusions(release)
    assert entries, "the exclusions file lists nothing"
    for ln in entries:
        test, sep, reason = ln.partition("#")
        assert "::" in test and sep and len(reason.strip()) > 20, ln


@pytest.mark.parametrize("release", judge.RELEASES)
def test_vllm_own_tests_pass_with_kvblock(tmp_path, release):
    require_module("vllm")
    shared_path("vllm", f"tests-{release}.0", "tests")
    python = judge.python_with_release(release)
    report = tmp_path / "report.json"
    rc = judge.run_judge(report, python=python, release=release)
    summary = json.loads(report.read_text())
    outcomes, counts = summary["outcomes"], summary["counts"]
    assert rc == 0, outcomes
    excluded = len(_exclusions(release))
    stock = judge.STOCK_PASSES[release]
    assert outcomes == {"passed": stock - excluded, "xfailed": excluded}
    assert sum(counts.values()) == stock
    assert counts["kvblock"] == ON_KVBLOCK[release], counts
    assert counts.get("fallback", 0) == 0, counts
