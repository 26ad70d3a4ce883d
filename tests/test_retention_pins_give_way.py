"""``--retention pin-system-prompts`` at sizes where the pins (up to a quarter of the pool)
would starve it: the pins give way, oldest first, so an idle pool serves every request that
fits it (issue 34, item 1: these runs used to stop with "scheduler stalled" or
"allocate_slots failed ... in an idle pool")."""

from __future__ import annotations

import json

from cli_helpers import run_cli


def test_scheduled_replay_serves_every_request(capsys):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--retention", "pin-system-prompts",
                          "--num-blocks", "500", "--json", "--no-progress")
    assert code == 0, err
    d = json.loads(out)
    assert d["requests"] == 939 and d["unservable"] == 0


def test_scheduled_replay_kvblock_and_reference_agree_when_pins_give_way(capsys):
    code, out, err = run_cli(capsys, "replay", "builtin:chat", "--retention", "pin-system-prompts",
                          "--num-blocks", "300", "--limit", "200", "--compare", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["identical"] is True


def test_sweep_small_capacities(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--retention", "lru,pin-system-prompts",
                          "--capacities", "300,500,1k", "--json", "--no-progress")
    assert code == 0, err
    series = json.loads(out)["series"]
    assert [s["name"] for s in series] == ["chat", "chat (pin-system-prompts)"]
    lru, pinned = ([p["unservable"] for p in s["points"]] for s in series)
    assert pinned == lru  # pins never make a request unservable that LRU serves
