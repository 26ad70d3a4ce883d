"""Fleet replays and sweeps honour or refuse every option they are given (issue 34, items 2
and 4): ``--retention`` reaches every engine, a fleet sweep takes byte capacities with
``--model`` and refuses ``--warmup`` and curve-only policies in one line, and a fleet option
without ``--instances`` is validated and runs (and says it runs) a fleet of one."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli


def _fleet_rate(capsys, *extra):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "150", "--instances", "2",
                          "--num-blocks", "300", "--json", "--no-progress", *extra)
    assert code == 0, err
    d = json.loads(out)
    return d["hits"], d["config"].get("retention")


def test_fleet_replay_honours_retention(capsys):
    lru, name = _fleet_rate(capsys)
    assert name is None
    pinned, name = _fleet_rate(capsys, "--retention", "pin-system-prompts")
    assert name == "pin-system-prompts"
    assert pinned != lru


def test_fleet_sweep_honours_retention_and_names_it(capsys):
    docs = {}
    for pol in ("lru", "pin-system-prompts"):
        code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "150", "--instances", "2",
                              "--routers", "cache-aware", "--capacities", "300", "--retention", pol,
                              "--json", "--no-progress")
        assert code == 0, err
        docs[pol] = json.loads(out)
    assert docs["pin-system-prompts"]["retention"] == "pin-system-prompts"
    hits = {p: d["routers"]["cache-aware"][0]["hits"] for p, d in docs.items()}
    assert hits["lru"] != hits["pin-system-prompts"]


def test_fleet_sweep_takes_bytes_with_model(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "50", "--instances", "2",
                          "--routers", "round-robin", "--model", "Llama-3.1-8B", "--capacities", "1GiB",
                          "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["routers"]["round-robin"][0]["config"]["num_blocks"] == 512


@pytest.mark.parametrize("extra, words", [
    (["--retention", "optimal", "--capacities", "10k"], "one --retention policy"),
    (["--retention", "lru,priority", "--capacities", "10k"], "one --retention policy"),
    (["--capacities", "10k", "--warmup", "0.5"], "--warmup"),
    (["--retention", "optimal"], "one --retention policy"),
    ([], "give one --capacities value"),
    (["--capacities", "1k,2k"], "one --capacities value"),
])
def test_fleet_sweep_refuses_what_it_cannot_run(capsys, extra, words):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--instances", "2", "--no-progress", *extra)
    assert code == 2 and out == ""
    assert words in err and len(err.strip().splitlines()) == 1


def test_fleet_option_without_instances_runs_a_fleet_of_one_and_says_so(capsys):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "30", "--num-blocks", "500",
                          "--transport", "zmq", "--json", "--no-progress")
    assert code == 0, err
    d = json.loads(out)
    assert d["fleet"]["instances"] == 1 and d["fleet"]["transport"] == "zmq"
    assert "--transport runs a fleet replay: 1 instance" in err


@pytest.mark.parametrize("extra, words", [
    (["--load-weight", "-1"], "--load-weight must be a finite number >= 0"),
    (["--speculative-ttl-ms", "100", "--router", "round-robin"], "cache-aware router"),
])
def test_fleet_options_validated_without_instances(capsys, extra, words):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "30", "--no-progress", *extra)
    assert code == 2 and out == "" and words in err


def test_sweep_refuses_fleet_options_without_instances(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--capacities", "1k", "--load-weight", "1",
                          "--no-progress")
    assert code == 2 and out == "" and "--instances" in err


def test_a_zero_index_cap_is_refused(capsys):
    from kvblock.replay import ReplayError
    from kvblock.replay.fleet import FleetConfig

    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--limit", "20", "--instances", "2",
                             "--index-max-pairs", "0", "--no-progress")
    assert code == 2 and "--index-max-pairs" in err and out == ""
    with pytest.raises(ReplayError, match="--index-max-pairs must be an int >= 1"):
        FleetConfig(index_max_pairs=0).validate()
