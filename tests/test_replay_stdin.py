"""A trace from standard input (``-``) or a pipe (``cat tok.jsonl | kvblock replay
/dev/stdin``) is read once, into memory: format detection no longer eats its first lines
(issue 34, item 3)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

import kvblock

TRACE = b"".join(json.dumps(list(range(1, 20 + i))).encode() + b"\n" for i in range(6))


def _run(argv, *, stdin=None, shell=None):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(kvblock.__file__))}
    cmd = shell if shell is not None else [sys.executable, "-m", "kvblock", *argv]
    return subprocess.run(cmd, input=stdin, capture_output=True, env=env, shell=shell is not None, timeout=120)


def _requests(p):
    assert p.returncode == 0, p.stderr.decode()
    assert b"Traceback" not in p.stderr
    d = json.loads(p.stdout)
    return d["requests"], d["workload"]


@pytest.mark.parametrize("path", ["-", "/dev/stdin"])
def test_replay_from_a_pipe(path):
    p = _run(["replay", path, "--json", "--no-progress"], stdin=TRACE)
    assert _requests(p)[0] == 6


def test_replay_from_gzip_on_stdin():
    p = _run(["replay", "-", "--json", "--no-progress"], stdin=gzip.compress(TRACE))
    assert _requests(p) == (6, "stdin")


def test_replay_cat_into_dev_stdin(tmp_path):
    f = tmp_path / "tok.jsonl"
    f.write_bytes(TRACE)
    p = _run(None, shell=f"cat {f} | {sys.executable} -m kvblock replay /dev/stdin --json --no-progress")
    assert _requests(p)[0] == 6


def test_sweep_from_stdin():
    p = _run(["sweep", "-", "--capacities", "10,inf", "--json", "--no-progress"], stdin=TRACE)
    assert p.returncode == 0, p.stderr.decode()
    assert json.loads(p.stdout)["series"][0]["points"][-1]["queries"] > 0


def test_empty_stdin_is_one_line():
    p = _run(["replay", "-", "--no-progress"], stdin=b"")
    assert p.returncode == 2 and b"Traceback" not in p.stderr
    assert b"no requests" in p.stderr and len(p.stderr.strip().splitlines()) == 1
