"""The fleet replay: N simulated engines (kvblock KVCacheManagers) behind the router, their
KV events feeding the index. One engine reproduces the single-engine simulator exactly; the
index never claims a block an engine does not hold (checked against every engine's pool at
every routing decision); Redis and ZMQ paths give the in-process answers; Redis killed and
restarted mid-replay; the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import shared_path
from kvblock.cli import main
from kvblock.replay import Replayer, SimConfig, builtin_workload, load_trace
from kvblock.replay.errors import ReplayError
from kvblock.replay.fleet import FleetConfig, replay_fleet

CFG = SimConfig(num_blocks=1500, block_size=64, token_budget=4096, max_running=16)


@pytest.fixture(scope="module")
def conv():
    path = shared_path("traces", "mooncake_fast25_conversation_trace.jsonl")
    return load_trace(str(path), limit=160)


def test_one_engine_is_the_single_engine_simulator(conv):
    single = Replayer("kvblock", CFG.block_size, CFG.hash_algo).run(conv, CFG)
    for router in ("round-robin", "least-loaded", "cache-aware"):
        r = replay_fleet(conv, CFG, FleetConfig(instances=1, router=router))
        assert (r.hits, r.queries, r.served) == (single.hits, single.queries, single.served)
        s = r.per_instance[0]
        assert (s.evictions, s.preemptions) == (single.evictions, single.preemptions)
        assert r.steps == single.steps and r.over_reports == 0


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "cache-aware"])
def test_index_never_over_reports(conv, router):
    r = replay_fleet(conv, CFG, FleetConfig(instances=3, router=router, check_all=True))
    assert r.served + r.unservable == len(conv.requests)
    assert r.over_reports == 0
    # under-reports only come from duplicate copies vLLM caches and then evicts one of
    checked = 3 * len(conv.requests)
    assert r.under_reports <= 0.05 * checked
    assert sum(s.requests for s in r.per_instance) == len(conv.requests)
    assert r.hits == sum(s.hits for s in r.per_instance)
    assert r.block_events > 0 and r.index_pairs > 0


def test_cache_aware_beats_round_robin():
    # multi-turn chats: a conversation's turns share their history
    chat = builtin_workload("chat").head(400)
    cfg = SimConfig(num_blocks=1024, block_size=16)
    rr = replay_fleet(chat, cfg, FleetConfig(instances=4, router="round-robin"))
    ca = replay_fleet(chat, cfg, FleetConfig(instances=4, router="cache-aware"))
    assert ca.hit_rate > rr.hit_rate + 0.05
    assert ca.routed_cached_tokens > 0 and ca.over_reports == 0


def test_capped_index_under_reports_only_and_counts_evictions(conv):
    full = replay_fleet(conv, CFG, FleetConfig(instances=3, router="cache-aware", check_all=True))
    cap = full.index_pairs // 4
    r = replay_fleet(conv, CFG, FleetConfig(instances=3, router="cache-aware", check_all=True, index_max_pairs=cap))
    assert r.over_reports == 0 and full.over_reports == 0
    assert r.index_pairs <= cap < full.index_pairs
    assert r.index_evicted_pairs > 0 and full.index_evicted_pairs == 0
    assert r.to_dict()["index"]["evicted_pairs"] == r.index_evicted_pairs
    assert r.served + r.unservable == len(conv.requests)
    with pytest.raises(ReplayError, match="index-max-pairs"):
        replay_fleet(conv, CFG, FleetConfig(index_max_pairs=-1))
    with pytest.raises(ReplayError, match="in-process"):
        replay_fleet(conv, CFG, FleetConfig(index="redis://127.0.0.1:1", index_max_pairs=10))


def test_zmq_transport_gives_the_same_replay(conv):
    f = FleetConfig(instances=2, router="cache-aware")
    a = replay_fleet(conv, CFG, f)
    b = replay_fleet(conv, CFG, replace(f, transport="zmq"))
    assert (a.hits, a.queries, a.routed_cached_tokens) == (b.hits, b.queries, b.routed_cached_tokens)
    assert [s.requests for s in a.per_instance] == [s.requests for s in b.per_instance]
    assert b.over_reports == 0


def test_bad_fleet_settings(conv):
    with pytest.raises(ReplayError):
        replay_fleet(conv, CFG, FleetConfig(instances=0))
    with pytest.raises(ReplayError):
        replay_fleet(conv, CFG, FleetConfig(router="random"))
    with pytest.raises(ReplayError):
        replay_fleet(conv, replace(CFG, ideal=True), FleetConfig())
    with pytest.raises(ReplayError):
        replay_fleet(conv, CFG, FleetConfig(index="http://x"))


def test_cli_fleet_replay_and_sweep(conv, tmp_path, capsys):
    path = str(shared_path("traces", "mooncake_fast25_conversation_trace.jsonl"))
    common = ["--limit", "60", "--block-size", "64", "--no-progress"]
    assert main(["replay", path, "--instances", "2", "--router", "least-loaded", "--num-blocks", "1500",
                 "--json", *common]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fleet"]["instances"] == 2 and d["over_reports"] == 0 and len(d["per_instance"]) == 2
    assert main(["replay", path, "--instances", "2", *common]) == 0
    assert "per instance" in capsys.readouterr().out
    png = tmp_path / "fleet.png"
    assert main(["sweep", path, "--instances", "1,2", "--routers", "round-robin,cache-aware", "--capacities", "1500",
                 "--plot", str(png), *common]) == 0
    assert png.stat().st_size > 10_000
    assert "fleet hit rate" in capsys.readouterr().out
    assert main(["replay", path, "--instances", "2", "--compare", *common]) == 2
    with pytest.raises(SystemExit) as e:
        main(["replay", path, "--router", "best", *common])
    assert e.value.code == 2
    assert main(["sweep", path, "--instances", "0", *common]) == 2
    capsys.readouterr()


def test_cli_fleet_tables_cut_no_router_name_and_unservable_is_a_count(conv, tmp_path, capsys):
    """At 80 columns (output not a terminal) the fleet sweep table cut router names to
    'round-…'; a fleet's JSON ``unservable`` was a count where a replay's was a list, and a fleet
    replay with unservable requests exited 0, not 3 (issue 34)."""
    path = str(shared_path("traces", "mooncake_fast25_conversation_trace.jsonl"))
    common = ["--limit", "30", "--block-size", "64", "--no-progress"]
    assert main(["sweep", path, "--instances", "1,2", "--routers", "round-robin,least-loaded,cache-aware",
                 "--capacities", "1500", *common]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for router in ("round-robin", "least-loaded", "cache-aware"):
        assert out.count(f" {router} ") == 2, out
    assert main(["replay", path, "--instances", "2", "--num-blocks", "1500", *common]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "router cache-aware," in " ".join(out.split())
    lines = [
        {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0]},
        {"timestamp": 1, "input_length": 5000, "output_length": 5, "hash_ids": list(range(1, 11))},
    ]
    t = tmp_path / "t.jsonl"
    t.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["replay", str(t), "--instances", "2", "--num-blocks", "100", "--json", "--no-progress"])
    d = json.loads(capsys.readouterr().out)
    assert code == 3 and d["unservable"] == 1 and d["served"] == 1
    [u] = d["unservable_requests"]
    assert u["request_id"] == "req-1" and u["line"] == 2 and u["instance"] in ("engine-0", "engine-1")
