"""``kvblock sweep`` usage (issue 34, items 5 and 6): no capacity is a usage error, a policy
list that no one method computes is refused with how to split it, and ``--json`` gives the
capacities as numbers (null for unlimited) beside their display labels."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli


@pytest.mark.parametrize("extra", [[], ["--instances", "2"]])
@pytest.mark.parametrize("spec", ["", " , "])
def test_no_capacity_is_a_usage_error(capsys, spec, extra):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--capacities", spec, "--no-progress", *extra)
    assert code == 2 and out == ""
    assert "no capacity" in err


@pytest.mark.parametrize("method", ["auto", "curve", "replay"])
def test_mixed_policies_name_the_split(capsys, method):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--retention", "lru,priority,ttl,fifo,optimal",
                          "--method", method, "--no-progress")
    assert code == 2 and out == ""
    assert "cannot run in one sweep" in err
    assert "--retention lru,fifo,optimal and --retention lru,priority,ttl" in err


def test_json_capacities_are_numbers(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "50", "--capacities", "1k,inf", "--json",
                          "--no-progress")
    assert code == 0, err
    d = json.loads(out)
    assert d["capacities"] == [1000, None]
    assert d["capacity_labels"] == ["1,000", "unlimited"]


def test_json_byte_budgets_keep_their_labels(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "50", "--model", "Llama-3.1-8B",
                          "--capacities", "1GiB", "--json", "--no-progress")
    assert code == 0, err
    d = json.loads(out)
    assert d["capacities"] == [512] and d["capacity_labels"] == ["1GiB"]


def test_standard_input_twice_is_refused_by_name(capsys):
    code, out, err = run_cli(capsys, "sweep", "-", "-", "--capacities", "1k", "--no-progress")
    assert code == 2 and out == ""
    assert "standard input ('-') can be read once" in err


@pytest.mark.parametrize("spec", ["8G", "1PiBB", "ten"])
def test_a_bad_capacity_lists_the_units(capsys, spec):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "10", "--capacities", spec, "--no-progress")
    assert code == 2 and out == ""
    assert f"bad capacity {spec!r}" in err and "GiB" in err and "PiB" in err


def test_petabytes_are_a_unit():
    from kvblock.replay.memory import parse_bytes

    assert parse_bytes("1PiB") == 2**50 and parse_bytes("2pb") == 2 * 10**15
