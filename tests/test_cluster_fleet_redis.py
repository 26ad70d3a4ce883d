"""The fleet replay with the index in Redis: the same replay as in-process, and a Redis
server killed and restarted mid-replay (the router routes by load meanwhile, resumes after,
and never claims a block an engine does not hold)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

from conftest import require_module, shared_path
from kvblock.replay import SimConfig, load_trace
from kvblock.replay.fleet import FleetConfig, replay_fleet
from redis_fixtures import redis_cluster, redis_node  # noqa: F401  (fixtures)

require_module("redis")  # fails under CI=true, skips elsewhere

CFG = SimConfig(num_blocks=1500, block_size=64, token_budget=4096, max_running=16)


@pytest.fixture(scope="module")
def conv():
    return load_trace(str(shared_path("traces", "mooncake_fast25_conversation_trace.jsonl")), limit=120)


def test_redis_fleet_equals_in_process(conv, redis_node):
    f = FleetConfig(instances=3, router="cache-aware", check_all=True)
    a = replay_fleet(conv, CFG, f)
    b = replay_fleet(conv, CFG, replace(f, index=redis_node.url))
    assert (a.hits, a.queries, a.routed_cached_tokens) == (b.hits, b.queries, b.routed_cached_tokens)
    assert [s.requests for s in a.per_instance] == [s.requests for s in b.per_instance]
    assert b.over_reports == 0 and b.index_fallbacks == 0


def test_redis_cluster_fleet_equals_in_process(conv, redis_cluster):
    f = FleetConfig(instances=3, router="cache-aware")
    a = replay_fleet(conv, CFG, f)
    b = replay_fleet(conv, CFG, replace(f, index=redis_cluster.url))
    assert (a.hits, a.queries) == (b.hits, b.queries)


def test_redis_killed_and_restarted_mid_replay(conv, redis_node, caplog):
    caplog.set_level(logging.WARNING, logger="kvblock.cluster")
    n = len(conv.requests)
    state = {"killed": False, "restarted": False}

    def progress(done: int) -> None:
        if not state["killed"] and done >= n // 4:
            redis_node.stop()
            state["killed"] = True
        elif state["killed"] and not state["restarted"] and done >= n // 2:
            redis_node.start()
            # Redis is tried again no sooner than retry_interval_s (0.5 s) after the last
            # failure; on a fast machine the rest of the replay can take less than that, so let
            # the interval pass here rather than depend on the replay's speed.
            time.sleep(0.6)
            state["restarted"] = True

    f = FleetConfig(instances=3, router="cache-aware", index=redis_node.url, check_all=True)
    r = replay_fleet(conv, CFG, f, progress)
    assert state["restarted"]
    assert r.served + r.unservable == n
    assert r.over_reports == 0
    assert 0 < r.index_fallbacks < n  # load-only routing while down, cache-aware before and after
    msgs = [rec.getMessage() for rec in caplog.records]
    assert sum("routing by load" in m for m in msgs) == 1  # one warning for the outage
    assert any("available again" in m for m in msgs)


@pytest.mark.parametrize("scheme", ["redis://", "redis+cluster://"])
def test_cli_replay_with_the_index_unreachable_routes_by_load(scheme, capsys):
    """An unreachable index is an outage for both schemes (redis+cluster:// used to exit 1
    with a redis-py traceback): exit 0, one warning, every request routed by load."""
    from cluster_helpers import free_port

    from kvblock.cli import main

    path = str(shared_path("traces", "mooncake_fast25_conversation_trace.jsonl"))
    code = main(["replay", path, "--limit", "20", "--block-size", "64", "--no-progress", "--instances", "2",
                 "--index", f"{scheme}127.0.0.1:{free_port()}", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    import json

    d = json.loads(out)
    assert d["index_fallbacks"] == d["requests"] == 20
    # it used to title itself "router cache-aware" (issue 34)
    assert d["routing"] == "least-loaded (cache-aware, but its index never answered)"
    code = main(["replay", path, "--limit", "20", "--block-size", "64", "--no-progress", "--instances", "2",
                 "--index", f"{scheme}127.0.0.1:{free_port()}"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "router least-loaded (cache-aware, but its index never answered)" in out
