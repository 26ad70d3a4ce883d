"""``make test``: run every stage (cargo test, pytest, pytest with the CPython fast paths off,
type checks, smoke, docs) with ``make -k``,
showing its output, going on after a failed one, and end with one line: passed / failed /
skipped per stage.

Usage: ``python scripts/make_test.py [MAKE]`` (default ``make``; the Makefile does not pass
``$(MAKE)``, which would make ``make -n test`` run the stages). Command-line variables such
as ``SMOKE_PYTHONS=`` reach the stages through ``MAKEFLAGS``. Exit status 1 if any stage
failed.
"""

from __future__ import annotations

import re
import subprocess
import sys

#: (name in the summary, make target, the line that target prints first)
STAGES = [
    ("cargo test", "rust-test", "== cargo test"),
    ("pytest", "py-test", "== pytest:"),
    ("no fast paths", "py-test-no-fast-paths", "== no fast paths:"),
    ("typecheck", "typecheck", "== type checks:"),
    ("smoke", "smoke", "== smoke tests"),
    ("docs", "docs", "== docs:"),
]


def count_cargo(log: str) -> dict[str, int]:
    """Sum cargo's ``test result: ok. 3 passed; 0 failed; 1 ignored`` lines (one per test binary)."""
    out = {"passed": 0, "failed": 0, "ignored": 0}
    for m in re.finditer(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", log):
        out["passed"] += int(m[1])
        out["failed"] += int(m[2])
        out["ignored"] += int(m[3])
    return out


def count_pytest(log: str) -> dict[str, int]:
    """pytest's last summary line: ``1234 passed, 6 skipped, 14 warnings in 180.1s``."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    lines = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", ln)]
    if lines:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", lines[-1]):
            key = "failed" if what.startswith("error") else what
            out[key] += int(n)
    return out


def count_typecheck(log: str) -> dict[str, int]:
    """scripts/typecheck.py announces each check (``== mypy ...``, ``== stubtest: ...``); a
    check passes with mypy's ``Success: ...`` line."""
    checks = len(re.findall(r"^== (mypy|stubtest)", log, re.M))
    passed = len(re.findall(r"^Success: no issues found", log, re.M))
    return {"passed": passed, "failed": max(checks - passed, 0)}


def count_smoke(log: str) -> dict[str, int]:
    """scripts/smoke_pythons.sh: one ``== smoke CPython X: passed / FAILED / skipped`` per Python."""
    return {
        "passed": len(re.findall(r"^== smoke CPython [\d.]+: passed", log, re.M)),
        "failed": len(re.findall(r"^== smoke CPython [\d.]+: FAILED", log, re.M)),
        "skipped": len(re.findall(r"^== smoke CPython [\d.]+: skipped", log, re.M)),
    }


def count_docs(log: str) -> dict[str, int]:
    """mkdocs ends a build with ``Documentation built in 4.9 seconds``; a strict build that
    warned ends with ``Aborted with N warnings in strict mode!`` instead. The Makefile prints
    ``== docs skipped: ...`` on a CPython the doc tools do not support."""
    if re.search(r"^== docs skipped:", log, re.M):
        return {"passed": 0, "failed": 0, "skipped": 1}
    built = re.search(r"Documentation built in [\d.]+ seconds", log) is not None
    return {"passed": int(built), "failed": int(not built)}


COUNTERS = {"rust-test": count_cargo, "py-test": count_pytest, "py-test-no-fast-paths": count_pytest,
            "typecheck": count_typecheck, "smoke": count_smoke, "docs": count_docs}


def run(make: str) -> tuple[int, str]:
    """``make -k`` every stage in one run (``install`` runs once), echoing the output as it
    comes; the exit status and the output."""
    targets = [target for _, target, _ in STAGES]
    proc = subprocess.Popen([make, "--no-print-directory", "-k", *targets], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    chunks = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            chunks.append(line)
    except KeyboardInterrupt:
        proc.terminate()  # make has the Ctrl-C too (one process group); this covers a kill of this script alone
        proc.wait()
        raise
    return proc.wait(), "".join(chunks)


def split_stages(log: str) -> dict[str, str]:
    """Each stage's part of the log, from its first line to the next stage's (absent: it
    never started, e.g. after a failed install)."""
    starts = sorted((i, target) for _, target, head in STAGES if (i := log.find(head)) >= 0)
    return {target: log[i : starts[k + 1][0] if k + 1 < len(starts) else len(log)]
            for k, (i, target) in enumerate(starts)}


def summary(rc: int, log: str) -> tuple[bool, str]:
    """``(failed, the summary line)``."""
    parts = split_stages(log)
    failed = rc != 0
    texts = []
    for name, target, _ in STAGES:
        if target not in parts:
            texts.append(f"{name} not run")
            failed = True
            continue
        counts = COUNTERS[target](parts[target])
        failed = failed or counts.get("failed", 0) > 0
        texts.append(f"{name} " + ", ".join(f"{n:,} {what}" for what, n in counts.items()))
    tail = f" (make exit status {rc})" if rc else ""
    return failed, f"== make test {'FAILED' if failed else 'passed'}: " + "; ".join(texts) + tail


def main(argv: list[str]) -> int:
    try:
        rc, log = run(argv[1] if len(argv) > 1 else "make")
    except KeyboardInterrupt:  # make got the Ctrl-C too (one process group) and stops its stages
        print("\n== make test: interrupted", file=sys.stderr, flush=True)
        return 130
    failed, line = summary(rc, log)
    print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
