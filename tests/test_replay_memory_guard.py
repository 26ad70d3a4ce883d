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


@pytest.mark.parametrize(
    "opts, msg",
    [
        (["--time-scale", "1e290"], "--time-scale must be <= 31,622,400,000 (a 1 ms trace scaled past 366 days), got 1e+290"),
        (["--step-ms", "1e300"], "--step-ms must be <= 31,622,400,000 (366 days), got 1e+300"),
        (["--retention", "ttl", "--ttl-s", "inf"], "--ttl-s must be at most 366 days (31,622,400 s), got inf"),
        (["--retention", "ttl", "--ttl-s", "1e300"], "--ttl-s must be at most 366 days (31,622,400 s), got 1e+300"),
        (["--instances", "2", "--speculative-ttl-ms", "inf"], "--speculative-ttl-ms must be >= 0 and at most 366 days"),
        (["--instances", "2", "--speculative-ttl-ms", "nan"], "--speculative-ttl-ms must be >= 0 and at most 366 days"),
        (["--instances", "2", "--load-weight", "nan"], "--load-weight must be a finite number >= 0, got nan"),
    ],
    ids=["time-scale", "step-ms", "ttl-inf", "ttl-huge", "spec-ttl-inf", "spec-ttl-nan", "load-weight-nan"],
)
def test_an_absurd_simulated_time_is_refused(capsys, opts, msg):
    """``--time-scale 1e290`` printed a ~300-digit scheduler-step count: a simulated time past
    the 366 days a trace's timestamps may span is a usage error (exit 2) naming the option."""
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "10", *opts, "--no-progress")
    assert code == 2 and msg in err and out == "", (code, err)
    assert err.startswith("kvblock: error: ") and len(err.strip().splitlines()) == 1


def test_a_scale_past_366_days_of_the_trace_is_refused(tmp_path):
    """Within the factor bound, the trace's last arrival scaled must stay within 366 days."""
    from kvblock.replay import SimConfig
    from kvblock.replay.config import check_time_span
    from kvblock.replay.errors import SettingError
    from kvblock.replay.trace import Trace, TraceRequest

    reqs = [TraceRequest(i, f"r{i}", t, 16, 1) for i, t in enumerate((0.0, 1000.0))]
    trace = Trace(name="t", source="t", requests=reqs)
    check_time_span(trace, SimConfig(time_scale=3e7))  # 1 s -> about 347 days
    with pytest.raises(SettingError, match=r"^time_scale 4e\+07 puts the trace's last arrival \(1000 ms\) past 366 days"):
        check_time_span(trace, SimConfig(time_scale=4e7))
    check_time_span(trace, SimConfig(time_scale=4e7, asap=True))  # arrival times ignored
