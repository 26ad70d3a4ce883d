"""The Redis index against the in-process index on real ``redis-server``s (one node and a
three-node Redis Cluster): identical answers on the same event streams (hypothesis), TTL
expiry, and Redis faults (down, restarted, flushed) with the router still answering."""

from __future__ import annotations

import itertools
import logging
import time

import pytest
from hypothesis import HealthCheck, given, settings

from cluster_streams import MEDIA, chain_of, fleet_stream, queries
from conftest import require_module
from kvblock.cluster import PrefixIndex, Router
from kvblock.cluster.errors import IndexUnavailable
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from redis_fixtures import redis_cluster, redis_node  # noqa: F401  (fixtures)

redis = require_module("redis")  # fails under CI=true, skips elsewhere
from kvblock.cluster import RedisPrefixIndex  # noqa: E402

_ns = itertools.count()


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None)


def payload(*events):
    return encode_batch(list(events), ts=0.0)


def differential(url, stream, qs):
    rix = RedisPrefixIndex(url, f"t{next(_ns)}")
    ix = PrefixIndex()
    try:
        for inst, p in stream:
            ix.apply(inst, p)
            rix.apply(inst, p)
        for q in qs:
            ch = chain_of(q)
            for medium in (None,) + MEDIA[:2]:
                assert rix.match(ch, medium) == ix.match(ch, medium), (q, medium)
        # a reader that is not the writer sees the same
        reader = RedisPrefixIndex(url, rix.namespace)
        for q in qs:
            assert reader.match(chain_of(q)) == ix.match(chain_of(q))
        reader.close()
        assert rix.resyncs == 0 and rix.failures == 0
    finally:
        rix.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=fleet_stream(max_batches=15), qs=queries)
def test_redis_equals_in_process(redis_node, stream, qs):
    differential(redis_node.url, stream, qs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=fleet_stream(max_batches=15), qs=queries)
def test_redis_cluster_equals_in_process(redis_cluster, stream, qs):
    differential(redis_cluster.url, stream, qs)


def test_cluster_spreads_instances_over_nodes(redis_cluster):
    rix = RedisPrefixIndex(redis_cluster.url, f"t{next(_ns)}")
    for i in range(12):
        rix.apply(f"engine-{i}", payload(stored([1, 2, 3 + i])))
    assert rix.match([1, 2, 3]) == {"engine-0": 3, **{f"engine-{i}": 2 for i in range(1, 12)}}
    nodes = set()
    for i in range(12):
        slot = rix.client.keyslot(rix._keys(f"engine-{i}", 1)[0])
        assert slot == rix.client.keyslot(rix._keys(f"engine-{i}", 1)[1])  # one slot per instance
        nodes.add(rix.client.get_node_from_key(rix._keys(f"engine-{i}", 1)[0]).port)
    assert len(nodes) >= 2
    rix.close()


def test_ttl_expires_dead_instances(redis_node):
    rix = RedisPrefixIndex(redis_node.url, f"t{next(_ns)}", ttl_s=1.0)
    rix.apply("alive", payload(stored([1, 2])))
    rix.apply("dead", payload(stored([1, 2, 3])))
    assert rix.match([1, 2, 3]) == {"alive": 2, "dead": 3}
    # "alive" is touched every 0.1 s, far inside its TTL even on a loaded machine; "dead" is not
    for _ in range(12):
        time.sleep(0.1)
        rix.touch("alive")
    rix.registry_refresh_s = 0
    assert rix.match([1, 2, 3]) == {"alive": 2}
    c = redis_node.client()
    assert not any(b"dead" in k for k in c.keys("*"))  # its keys are gone
    assert rix.expire() == ["dead"]
    # the dead instance speaks again: Redis lost it, the writer rewrites it from its mirror
    rix.apply("dead", payload(stored([9], 3)))
    assert rix.match([1, 2, 3, 9]) == {"alive": 2, "dead": 4}
    assert rix.resyncs == 1
    rix.close()


def test_redis_down_and_restarted(redis_node, caplog):
    rix = RedisPrefixIndex(redis_node.url, "faults", retry_interval_s=0.0)
    ix = PrefixIndex()
    router = Router(["e0", "e1"], rix, "cache-aware", block_size=16)
    a, b = [1, 2, 3, 4], [1, 2, 7]

    def both(inst, p):
        ix.apply(inst, p)
        rix.apply(inst, p)

    both("e0", payload(stored(a)))
    both("e1", payload(stored(b)))
    assert router.route(a, 64).instance == "e0"
    redis_node.stop()
    caplog.set_level(logging.WARNING, logger="kvblock.cluster")
    # writes go to the mirror; the router answers by load, warning once
    both("e0", payload(BlockRemoved(block_hashes=[3, 4], medium="GPU")))
    both("e1", payload(stored([8, 9], 7)))
    router.set_load("e0", 100, 0)
    decisions = [router.route(a, 64) for _ in range(5)]
    assert all(not d.index_available and d.instance == "e1" and d.cached_blocks == 0 for d in decisions)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 2  # one from the index, one from the router
    with pytest.raises(IndexUnavailable):
        rix.match(a)
    # Redis comes back empty (no persistence): the writer rewrites its instances
    redis_node.start()
    router.set_load("e0", 0, 0)
    d = router.route(b + [8, 9], 80)
    assert d.index_available and d.instance == "e1" and d.cached_blocks == 5
    for q in (a, b, b + [8, 9], [1, 2]):
        assert rix.match(q) == ix.match(q)
    assert rix.resyncs >= 2
    # a flush while the writer is up: the next batch of an instance notices and rewrites it
    redis_node.client().flushall()
    both("e0", payload(stored([5], 2)))
    for q in (a, [1, 2, 5], b + [8, 9]):
        got, want = rix.match(q, instances=["e0", "e1"]), ix.match(q)
        assert got.get("e0", 0) == want.get("e0", 0)
        assert got.get("e1", 0) <= want.get("e1", 0)  # not rewritten yet: less, never more
    both("e1", payload(stored([6], 2)))
    for q in (a, [1, 2, 5], [1, 2, 6], b + [8, 9]):
        assert rix.match(q) == ix.match(q)
    rix.close()


def test_all_blocks_cleared_and_clear_instance(redis_node):
    rix = RedisPrefixIndex(redis_node.url, f"t{next(_ns)}")
    rix.apply("e", payload(stored([1, 2, 3]), stored([1, 2], medium="CPU")))
    assert rix.match([1, 2, 3]) == {"e": 3} and rix.match([1, 2, 3], "CPU") == {"e": 2}
    rix.apply("e", payload(AllBlocksCleared(), stored([5])))
    assert rix.match([1, 2, 3]) == {} and rix.match([5]) == {"e": 1}
    rix.clear_instance("e")
    assert rix.match([5]) == {}
    assert rix.remove_instance("e") == 0
    with pytest.raises(KeyError):
        rix.remove_instance("e")
    with pytest.raises(ValueError):
        rix.apply("e", b"\x93garbage")
    with pytest.raises(ValueError):
        RedisPrefixIndex("http://nope", "x")
    rix.close()


def test_unreachable_from_the_start():
    from cluster_helpers import free_port

    rix = RedisPrefixIndex(f"redis://127.0.0.1:{free_port()}", "x", timeout_s=0.2)
    rix.apply("e", payload(stored([1])))  # kept in the mirror
    with pytest.raises(IndexUnavailable):
        rix.match([1])
    router = Router(["e"], rix)
    assert router.route([1], 16).instance == "e"
    assert rix.mirror.match([1]) == {"e": 1}


def test_cluster_unreachable_from_the_start_is_an_outage_not_an_error():
    """redis+cluster:// used to raise redis-py's RedisClusterException from __init__ (the
    CLI printed its 71-line traceback); now it is the same outage as redis://."""
    from cluster_helpers import free_port

    rix = RedisPrefixIndex(f"redis+cluster://127.0.0.1:{free_port()}", "x", timeout_s=0.2)
    assert rix.is_cluster
    rix.apply("e", payload(stored([1])))  # kept in the mirror
    with pytest.raises(IndexUnavailable, match="Redis"):
        rix.match([1])
    assert Router(["e"], rix).route([1], 16).instance == "e"
    assert rix.mirror.match([1]) == {"e": 1} and rix.failures >= 1
    rix.close()
    with pytest.raises(ValueError, match="redis\\+cluster://host:port"):
        RedisPrefixIndex("redis+cluster://127.0.0.1:99999", "x")


def test_cluster_url_of_a_node_not_in_cluster_mode_says_so(redis_node):
    rix = RedisPrefixIndex(redis_node.url.replace("redis://", "redis+cluster://"), "x", timeout_s=0.5)
    rix.apply("e", payload(stored([1])))
    with pytest.raises(IndexUnavailable, match="[Cc]luster mode is not enabled"):
        rix.match([1])
    rix.close()


def test_match_without_instances_sees_an_instance_this_index_just_wrote(redis_node):
    # issue 32: match() without an instance list read a registry cached for 1 s
    ns = f"t{next(_ns)}"
    rix = RedisPrefixIndex(redis_node.url, ns)
    rix.apply("e0", payload(stored([1, 2])))
    assert rix.match([1, 2]) == {"e0": 2}  # the registry is read (and cached) here
    rix.apply("e1", payload(stored([1, 2, 3])))
    assert rix.match([1, 2, 3]) == {"e0": 2, "e1": 3}
    rix.remove_instance("e0")
    assert rix.match([1, 2, 3]) == {"e1": 3}
    # another process's new instance: seen once the cache is older than registry_refresh_s
    other = RedisPrefixIndex(redis_node.url, ns)
    other.apply("e2", payload(stored([1])))
    assert rix.match([1], instances=["e1", "e2"]) == {"e1": 1, "e2": 1}
    assert set(rix.instances(refresh=True)) == {"e1", "e2"}
