"""A replay whose engines' block pools cannot fit in this machine's memory is refused before
anything is built, in one line (issue 34, a fresh user's find: ``--instances 100000`` ran
until the kernel killed it, after taking 22 GB). The sizes asked for here (10^5 engines of
2^31 - 1 blocks, about 10 PB) exceed any machine's memory, so the refusal is real."""

from __future__ import annotations

import pytest

from cli_helpers import run_cli
from kvblock.replay import ReplayError
from kvblock.replay.config import ENGINE_BYTES_PER_BLOCK, MAX_NUM_BLOCKS, available_memory, check_engine_memory


def test_available_memory_is_read():
    avail = available_memory()
    assert avail is None or avail > 0


def test_too_many_engines_are_refused_in_one_line(capsys):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "10", "--instances", "100000",
                             "--num-blocks", str(MAX_NUM_BLOCKS), "--no-progress")
    assert code == 2 and out == ""
    assert err.startswith("kvblock: error: 100,000 engine(s) of 2,147,483,647 blocks need about") and \
        err.count("\n") == 1, err


def test_one_engine_too_large_is_refused_too(capsys):
    if available_memory() is None or available_memory() > MAX_NUM_BLOCKS * ENGINE_BYTES_PER_BLOCK:
        pytest.skip("this machine has memory for the largest pool")
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "10", "--num-blocks", str(MAX_NUM_BLOCKS),
                             "--no-progress")
    assert code == 2 and "1 engine(s) of 2,147,483,647 blocks need about" in err


def test_the_check():
    check_engine_memory(4, 1000)  # a few MB
    check_engine_memory(10**9, None)  # unlimited pools grow as used: not checked
    if available_memory() is not None:
        with pytest.raises(ReplayError, match="use fewer --instances or fewer --num-blocks"):
            check_engine_memory(100_000, MAX_NUM_BLOCKS)


def test_a_scale_or_step_must_be_finite(capsys):
    for opt in ("--time-scale", "--step-ms"):
        code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "10", opt, "inf", "--no-progress")
        assert code == 2 and f"{opt} must be a finite number > 0, got inf" in err
