"""``kvblock replay`` and ``kvblock sweep`` from the command line: outputs, exit codes, and a
clear message (never a traceback) for every kind of bad input."""

from __future__ import annotations

import io
import json

import pytest
from conftest import shared_path
from rich.console import Console

from kvblock.cli import main
from kvblock.replay import ReplayError
from kvblock.replay.progress import replay_progress
from kvblock.replay.sweep import parse_capacities


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse errors
        code = int(e.code)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def write(tmp_path, name: str, lines: list) -> str:
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def mc(ts, n_in, n_out, ids) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


GOOD = [mc(0, 1500, 20, [0, 1, 2]), mc(100, 1600, 20, [0, 1, 2, 3]), mc(150, 700, 10, [0, 9])]


# -- the main job ---------------------------------------------------------------------------------

def test_replay_with_no_arguments_is_the_builtin_workload(capsys):
    code, out, err = run_cli(capsys, "replay", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["workload"] == "shared-prompt" and d["mode"] == "scheduled" and d["impl"] == "kvblock"
    assert (d["prefix_cache"]["hits"], d["prefix_cache"]["queries"]) == (1_150_464, 2_048_000)
    assert d["config"]["num_blocks"] == 16384 and d["config"]["max_running"] == 64
    assert d["preemptions"] == 0 and d["steps"] == 2048
    assert d["manager"]["us_per_step"] > 0 and d["hashing"]["ns_per_block"] > 0
    assert 0 < len(d["blocks_in_use"]["series"]) <= 240


def test_replay_table_output(capsys):
    code, out, _ = run_cli(capsys, "replay", "--limit", "64", "--fingerprint")
    assert code == 0
    for text in ("token hit rate", "block hit rate", "evictions", "preemptions", "blocks in use",
                 "µs/step", "ns/block", "fingerprint"):
        assert text in out


def test_replay_trace_file_options_override_defaults(tmp_path, capsys):
    path = write(tmp_path, "t.jsonl", GOOD)
    code, out, _ = run_cli(capsys, "replay", path, "--num-blocks", "500", "--max-running", "2",
                           "--token-budget", "0", "--no-chunked-prefill", "--asap", "--json")
    assert code == 0
    d = json.loads(out)
    c = d["config"]
    assert (c["num_blocks"], c["max_running"], c["token_budget"], c["chunked_prefill"], c["asap"]) == (500, 2, None, False, True)
    assert d["workload"] == "t" and d["served"] == 3 and d["prefix_cache"]["hits"] > 0


def test_replay_ideal_unlimited_and_reference(tmp_path, capsys):
    path = write(tmp_path, "t.jsonl", GOOD)
    code, out, _ = run_cli(capsys, "replay", path, "--ideal", "--num-blocks", "unlimited", "--impl", "reference", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["mode"] == "ideal" and d["impl"] == "reference" and d["config"]["num_blocks_unlimited"]
    # 2nd request: 93 full blocks of the first; 3rd: 32 blocks of trace block 0
    assert d["prefix_cache"]["hits"] == 93 * 16 + 32 * 16 and d["evictions"] == 0


def test_compare(tmp_path, capsys):
    path = write(tmp_path, "t.jsonl", GOOD)
    code, out, _ = run_cli(capsys, "replay", path, "--compare", "--num-blocks", "300", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["identical"] and d["mismatches"] == []
    assert d["kvblock"]["prefix_cache"] == d["reference"]["prefix_cache"]
    assert set(d["speedup"]) == {"manager", "hashing_per_block", "wall"}
    code, out, _ = run_cli(capsys, "replay", path, "--compare", "--num-blocks", "300")
    assert code == 0 and "kvblock vs reference" in out and "speedup" in out and "identical" in out


def test_builtin_chat_workload(capsys):
    code, out, _ = run_cli(capsys, "replay", "--workload", "chat", "--limit", "40", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["workload"] == "chat" and d["requests"] == 40 and d["served"] == 40


def test_mooncake_trace_slice(capsys):
    path = shared_path("traces", "mooncake_fast25_synthetic_trace.jsonl")
    code, out, _ = run_cli(capsys, "replay", str(path), "--limit", "150", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["requests"] == 150 and d["served"] == 150 and d["config"]["block_size"] == 16


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["replay", "/no/such/trace.jsonl"], "trace file not found: /no/such/trace.jsonl"),
    (["replay", "builtin:nope"], "unknown workload 'nope'"),
    (["replay", "--num-blocks", "1"], "capacity 1 is too small"),
    (["replay", "--block-size", "0"], "--block-size must be > 0"),
    (["replay", "--token-budget", "-5"], "--token-budget must be >= 1"),
    (["replay", "--limit", "0"], "--limit must be > 0"),
    (["sweep", "builtin:shared-prompt", "--capacities", "1k,1"], "capacity 1 is too small"),
    (["sweep", "builtin:shared-prompt", "--capacities", "ten"], "bad capacity 'ten'"),
    # issue 34: these named the core's num_gpu_blocks / block_size, or ran and printed inf ns/block
    (["replay", "--num-blocks", "99999999999"],
     "argument --num-blocks: capacity 99999999999 is too large: at most 2,147,483,647 blocks"),
    (["replay", "--num-blocks", "2147483648"], "argument --num-blocks: capacity 2147483648 is too large"),
    (["replay", "--instances", "2", "--num-blocks", "99999999999"], "argument --num-blocks: capacity"),
    (["sweep", "builtin:shared-prompt", "--capacities", "1k,99999999999"], "capacity 99999999999 is too large"),
    (["replay", "--block-size", "99999999999"], "--block-size must be <= 2,147,483,647 tokens"),
    (["info", "--repeat", "0"], "argument --repeat: must be >= 1, got 0"),
    (["info", "--repeat", "-3"], "argument --repeat: must be >= 1, got -3"),
    # a new user's notes: an unknown option named the top-level help; replay's capacity hint
    # named sweep's --model; an infinite load weight ran
    (["replay", "--bogus"], "unrecognized arguments: --bogus"),
    (["sweep", "builtin:shared-prompt", "--capacities", "1k", "--bogus"], "unrecognized arguments: --bogus"),
    (["replay", "--num-blocks", "8GiB"], "expected a block count such as 1000, 10k or inf ("),
    (["replay", "--instances", "2", "--load-weight", "inf"], "--load-weight must be a finite number >= 0"),
    # a guessed --trace (the trace is positional) was read as an abbreviation of
    # --trace-block-size; options are not abbreviated
    (["replay", "--trace", "t.jsonl"], "unrecognized arguments: --trace ("),
    (["replay", "--num", "1k"], "unrecognized arguments: --num ("),
])
def test_user_errors_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and err.startswith("kvblock: error: ")
    # every refused command line, argparse's or a setting's, ends by naming its help
    assert err.endswith(f" (see kvblock {argv[0]} --help)\n"), err
    assert "num_gpu_blocks" not in err and "ValueError" not in err and out == ""


def test_version_names_kvblock_and_its_rust_core(capsys):
    from kvblock import _core

    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and err == ""
    assert out.startswith("kvblock ") and out.count("\n") == 1
    assert f"Rust core {_core.__version__} ({_core.BUILD_PROFILE} build, {_core.__file__})" in out


def test_simconfig_refuses_more_blocks_than_int32_block_ids():
    from kvblock.cli import hashing_table
    from kvblock.replay import SimConfig

    with pytest.raises(ReplayError, match="^num_blocks must be <= 2,147,483,647"):
        SimConfig(num_blocks=2**31)
    assert SimConfig(num_blocks=2**31 - 1).validate()
    with pytest.raises(ValueError, match="repeat: must be >= 1"):
        hashing_table(repeat=0)


@pytest.mark.parametrize("argv,message", [
    (["replay", "--impl", "vllm"], "argument --impl: invalid choice: 'vllm'"),
    (["replay", "--num-blocks", "lots"], "bad capacity 'lots': expected a block count such as 1000, 10k or inf"),
    (["replay", "--hash-algo", "md5"], "argument --hash-algo: invalid choice"),
    (["sweep", "x.jsonl", "--impl", "nope"], "argument --impl: invalid choice"),
])
def test_option_errors_exit_2(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize("bad,message", [
    ('{"timestamp": 0, "input_length": 5', "malformed JSON"),
    ('{"timestamp": 0, "input_length": -700, "output_length": 1, "hash_ids": [0, 1]}', "input_length must be > 0, got -700"),
    ('{"timestamp": 0, "input_length": 700, "output_length": -1, "hash_ids": [0, 1]}', "output_length must be >= 0, got -1"),
    ('{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1]}', "hash_ids has 2 ids but input_length 1500 needs ceil(1500/512) = 3"),
    # was accepted: "scheduler steps" printed ~300 digits and the table grew hundreds of columns
    ('{"timestamp": 1e300, "input_length": 700, "output_length": 1, "hash_ids": [0, 1]}',
     "timestamp must be at most 31,622,400,000 ms (366 days after the trace start), got 1e+300"),
])
def test_bad_lines_name_their_line_and_can_be_skipped(tmp_path, capsys, bad, message):
    path = write(tmp_path, "t.jsonl", [GOOD[0], bad, GOOD[1]])
    code, out, err = run_cli(capsys, "replay", path, "--json")
    assert code == 2 and f"{path}:2: " in err and message in err and "--skip-bad-lines" in err
    assert out == ""
    code, out, err = run_cli(capsys, "replay", path, "--skip-bad-lines", "--json")
    assert code == 0 and "skipped 1 bad line(s); first, line 2" in err
    d = json.loads(out)
    assert d["served"] == 2 and d["skipped_lines"] == 1


def test_absurd_timestamp_is_one_error_line_from_the_command(tmp_path):
    """The user's case, as a real ``kvblock replay`` process printing its table: a line with
    ``"timestamp": 1e300`` is refused in one ``kvblock: error:`` line naming it, exit 2, no
    table (it printed a ~300-digit "scheduler steps" row, hundreds of columns wide)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import kvblock

    path = write(tmp_path, "t.jsonl", [GOOD[0], {"timestamp": 1e300, "input_length": 700, "output_length": 1,
                                                 "hash_ids": [0, 1]}])
    env = {**os.environ, "PYTHONPATH": str(Path(kvblock.__file__).resolve().parent.parent)}
    p = subprocess.run([sys.executable, "-m", "kvblock", "replay", path, "--no-progress"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [
        f"kvblock: error: {path}:2: timestamp must be at most 31,622,400,000 ms (366 days after the trace start), "
        "got 1e+300 (pass --skip-bad-lines to skip such lines) (see kvblock replay --help)"]


def test_unservable_requests_exit_3_after_the_report(tmp_path, capsys):
    path = write(tmp_path, "t.jsonl", [mc(0, 100, 5, [0]), mc(1, 5000, 5, list(range(1, 11))), mc(2, 100, 5, [0])])
    code, out, err = run_cli(capsys, "replay", path, "--num-blocks", "100", "--json")
    assert code == 3
    d = json.loads(out)
    assert d["served"] == 2 and [u["request_id"] for u in d["unservable_requests"]] == ["req-1"]
    assert d["unservable"] == 1 and d["unservable_requests"][0]["line"] == 2
    assert "1 request(s) can never fit" in err and "req-1 (line 2)" in err
    assert "needs 313 blocks for 5,004 tokens" in err and "raise --num-blocks to at least 314" in err
    code, out, err = run_cli(capsys, "replay", path, "--num-blocks", "100")
    assert code == 3 and "1 unservable" in out
    code, _, err = run_cli(capsys, "replay", path, "--token-budget", "1000", "--no-chunked-prefill")
    assert code == 3 and "raise --token-budget or enable chunked prefill" in err


def test_trace_and_workload_together(tmp_path, capsys):
    path = write(tmp_path, "t.jsonl", GOOD)
    code, _, err = run_cli(capsys, "replay", path, "--workload", "chat")
    assert code == 2 and "either a TRACE file or --workload" in err


# -- sweep ----------------------------------------------------------------------------------------

def test_sweep_writes_a_png_and_misses_never_grow_with_capacity(tmp_path, capsys):
    traces = [str(shared_path("traces", n)) for n in
              ("mooncake_fast25_conversation_trace.jsonl", "mooncake_fast25_synthetic_trace.jsonl")]
    png = tmp_path / "hit_rate.png"
    code, out, err = run_cli(capsys, "sweep", *traces, "--limit", "150", "--capacities", "500,2k", "5k,20k,inf",
                             "--plot", str(png), "--json")
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    d = json.loads(out)
    assert d["plot"] == str(png) and len(d["series"]) == 2
    for series in d["series"]:
        points = series["points"]
        assert [p["capacity"] for p in points] == [500, 2000, 5000, 20000, None]
        misses = [p["misses"] for p in points]
        assert all(a >= b for a, b in zip(misses, misses[1:])), (series["name"], misses)
        assert misses[0] > misses[-1]
        assert points[-1]["evictions"] == 0 and points[0]["unservable"] > 0
        for p in points:
            assert p["misses"] == p["prompt_tokens"] - p["hits"]
    code, out, _ = run_cli(capsys, "sweep", traces[1], "--limit", "50", "--capacities", "1k,inf")
    assert code == 0 and "hit rate vs capacity" in out and "unlimited" in out and "1,000" in out


@pytest.mark.parametrize("fails_with", [KeyboardInterrupt, OSError])
def test_sweep_plot_is_whole_or_not_written(tmp_path, capsys, monkeypatch, fails_with):
    """Ctrl-C (or a full disk) while the plot is drawn: exit 130 (2), the old file as it was,
    no partial file left beside it."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def half_written(self, fname, *a, **k):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise fails_with("interrupted while drawing")

    monkeypatch.setattr(Figure, "savefig", half_written)
    png = tmp_path / "hit_rate.png"
    png.write_bytes(b"the previous plot")
    code, _, err = run_cli(capsys, "sweep", "builtin:shared-prompt", "--limit", "8", "--capacities", "10k",
                           "--plot", str(png))
    assert code == (130 if fails_with is KeyboardInterrupt else 2), err
    assert png.read_bytes() == b"the previous plot"
    assert [p.name for p in tmp_path.iterdir()] == ["hit_rate.png"]


def test_sweep_plot_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, "sweep", "builtin:shared-prompt", "--limit", "8", "--capacities", "10k",
                           "--plot", str(tmp_path / "missing-dir" / "x.png"))
    assert code == 2 and "cannot write plot" in err


@pytest.mark.parametrize("target, message", [
    ("missing-dir/x.png", "no such directory"),
    ("x.xyz", "unknown format 'xyz'"),
    ("x", "unknown format '(no extension)'"),
    (".", "it is a directory"),
])
def test_sweep_checks_the_plot_target_before_the_sweep(tmp_path, capsys, target, message):
    """The plot target is checked first: the trace named here does not exist, and the error
    is the plot's (it used to come after the whole sweep, with no table printed)."""
    code, out, err = run_cli(capsys, "sweep", str(tmp_path / "no-such-trace.jsonl"), "--capacities", "10k",
                             "--plot", str(tmp_path / target))
    assert code == 2 and "cannot write plot" in err and message in err and out == ""
    assert [p.name for p in tmp_path.iterdir()] == []  # the probe file is gone


def test_sweep_without_matplotlib_says_what_to_install_first(tmp_path, capsys, monkeypatch):
    """matplotlib missing is found before the sweep, and the hint is the README's: matplotlib
    alone (pip install '.[plot]' rebuilt the Rust core for minutes to add it)."""
    import sys
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code, out, err = run_cli(capsys, "sweep", str(tmp_path / "no-such-trace.jsonl"), "--capacities", "10k",
                             "--plot", str(tmp_path / "x.png"))
    hint = "pip install matplotlib"
    assert code == 2 and hint in err and out == ""
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert f"`--plot` needs `{hint}`" in readme


def test_parse_capacities():
    assert parse_capacities(["inf,1k", "10k", "1000", "2.5k"]) == [1000, 2500, 10000, None]
    assert parse_capacities(["1m"]) == [1_000_000]
    with pytest.raises(ReplayError, match="no capacities"):
        parse_capacities([" , "])
    with pytest.raises(ReplayError, match="not a whole number"):
        parse_capacities(["1.2345k"])


# -- progress --------------------------------------------------------------------------------------

def test_progress_bar_on_a_terminal_only():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with replay_progress(10, "replay", console) as update:
        assert update is not None
        update(5)
        update(10)
    assert "requests" in buf.getvalue() and "ETA" in buf.getvalue()
    with replay_progress(10, "replay", Console(file=io.StringIO())) as update:
        assert update is None
    with replay_progress(10, "replay", console, enabled=False) as update:
        assert update is None


def test_a_fleets_first_unservable_request_is_the_first_in_the_trace(tmp_path, capsys):
    # round-robin: req-1 goes to engine-1, req-2 to engine-0; both can never fit
    path = write(tmp_path, "t.jsonl", [mc(0, 100, 5, [0]), mc(1, 5000, 5, list(range(1, 11))),
                                       mc(2, 9000, 5, list(range(20, 38))), mc(3, 100, 5, [0])])
    code, out, err = run_cli(capsys, "replay", path, "--num-blocks", "100", "--instances", "2",
                             "--router", "round-robin", "--no-progress")
    assert code == 3
    assert "2 request(s) can never fit" in err and "first req-1 (line 2)" in err
    assert "raise --num-blocks to at least 564 for all of them (the largest needs 563 blocks" in " ".join(err.split())
