"""The fleet prefix index: kvblock's Rust index against a plain Python dict-of-sets index
(msgspec decoding, ``{hash: {instance, ...}}``), and the Redis index (one script call per
batch, one pipeline per lookup) against a one-command-per-block Redis client. One run;
``ratio`` = baseline / kvblock.

* ingest: block events per second, whole msgpack ``KVEventBatch`` payloads of a 64-instance
  fleet (stores of 32-block chains with a shared 8-block system prompt, evictions);
* lookup: a 64-block prefix across 64 instances (instance ``i`` holds ``i`` of its blocks);
* memory: bytes per (block, holder) (printed in the summary).
"""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kvblock.cluster import PrefixIndex
from kvblock.events import BlockRemoved, BlockStored, decode_batch, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

INSTANCES = 64
M64 = (1 << 63) - 1


class PlainDictIndex:
    """What a Python router would write: msgspec decoding, ``{hash: set of instances}``,
    a lookup walking the chain and intersecting sets."""

    def __init__(self) -> None:
        self.blocks: dict[int, set[str]] = {}

    def apply(self, instance: str, payload: bytes) -> None:
        blocks = self.blocks
        for ev in decode_batch(payload).events:
            if type(ev) is BlockStored:
                for h in ev.block_hashes:
                    s = blocks.get(h)
                    if s is None:
                        blocks[h] = {instance}
                    else:
                        s.add(instance)
            elif type(ev) is BlockRemoved:
                for h in ev.block_hashes:
                    s = blocks.get(h)
                    if s is not None:
                        s.discard(instance)
                        if not s:
                            del blocks[h]
            else:
                for h in list(blocks):
                    s = blocks[h]
                    s.discard(instance)
                    if not s:
                        del blocks[h]

    def match(self, hashes) -> dict[str, int]:
        out: dict[str, int] = {}
        alive = None
        i = 0
        for i, h in enumerate(hashes):
            cur = self.blocks.get(h, ())
            if alive is None:
                alive = set(cur)
            else:
                for name in alive.difference(cur):
                    out[name] = i
                alive.intersection_update(cur)
            if not alive:
                return out
        for name in alive or ():
            out[name] = i + 1
        return out


def _stored(hashes, parent=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None)


def fleet_stream(rounds: int = 40, seed: int = 1):
    """``[(instance, payload)]`` and the number of block events: each round every instance
    stores a 32-block chain (8 shared blocks + 24 of its own) and evicts 16 old blocks."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, M64, 8).tolist()
    held: dict[str, list[int]] = {f"e{i}": [] for i in range(INSTANCES)}
    out, events = [], 0
    for _ in range(rounds):
        for name in held:
            own = rng.integers(1, M64, 24).tolist()
            evs = [_stored(system), _stored(own, system[-1])]
            events += 32
            if len(held[name]) >= 64:
                old = held[name][:16]
                del held[name][:16]
                evs.append(BlockRemoved(block_hashes=old, medium="GPU"))
                events += 16
            held[name] += own
            out.append((name, encode_batch(evs, ts=0.0)))
    return out, events


STREAM, EVENTS = fleet_stream()


def _ingest(ix):
    for name, payload in STREAM:
        ix.apply(name, payload)
    return ix


def test_ingest_kvblock(record):
    record("index ingest (per block event)", "kvblock", lambda: _ingest(PrefixIndex()), per=EVENTS, rounds=7)


def test_ingest_dict(record):
    record("index ingest (per block event)", "reference", lambda: _ingest(PlainDictIndex()), per=EVENTS, rounds=5)


def lookup_state():
    """64 instances: instance ``i`` holds the first ``i`` blocks of a 64-block chain, plus
    2,000 blocks of its own."""
    rng = np.random.default_rng(2)
    chain = rng.integers(1, M64, 64).tolist()
    ix, ref = PrefixIndex(), PlainDictIndex()
    for i in range(INSTANCES):
        own = rng.integers(1, M64, 2000).tolist()
        p = encode_batch([_stored(chain[: i + 1]), _stored(own)], ts=0.0)
        ix.apply(f"e{i}", p)
        ref.apply(f"e{i}", p)
    return chain, ix, ref


CHAIN, LIX, LREF = lookup_state()
CHAIN_ARR = np.array(CHAIN, dtype=np.uint64)


def test_lookup_state_agrees():
    assert LIX.match(CHAIN) == LREF.match(CHAIN) == {f"e{i}": i + 1 for i in range(INSTANCES)}


def test_lookup_kvblock_dense(record):
    record("index lookup 64 blocks x 64 instances", "kvblock", LIX.match_dense, CHAIN_ARR)


def test_lookup_kvblock_dict(record):
    record("index lookup 64 blocks x 64 instances (dict answer)", "kvblock", LIX.match, CHAIN)


def test_lookup_dict(record):
    record("index lookup 64 blocks x 64 instances", "reference", LREF.match, CHAIN)


def test_lookup_dict_again(record):
    # the same baseline, against kvblock's dict-answer form
    record("index lookup 64 blocks x 64 instances (dict answer)", "reference", LREF.match, CHAIN)


def test_memory_per_pair(report_line):
    ix = _ingest(PrefixIndex())
    pairs = ix.num_pairs()
    tracemalloc.start()
    ref = _ingest(PlainDictIndex())
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ref_pairs = sum(len(s) for s in ref.blocks.values())
    assert ref_pairs == pairs
    report_line(f"index memory per (block, holder): kvblock {ix.bytes_per_pair():.1f} B "
                f"({pairs:,} pairs, {ix.num_nodes():,} blocks), dict-of-sets {cur / ref_pairs:.1f} B "
                f"(ratio {cur / ref_pairs / ix.bytes_per_pair():.1f}x)")
    single = PrefixIndex()
    rng = np.random.default_rng(3)
    for i in range(INSTANCES):
        single.apply(f"e{i}", encode_batch([_stored(rng.integers(1, M64, 4000).tolist())], ts=0.0))
    report_line(f"index memory per (block, holder), every block on one instance only: "
                f"{single.bytes_per_pair():.1f} B ({single.num_pairs():,} pairs)")


# -- Redis ----------------------------------------------------------------------------------------

class NaiveRedisIndex:
    """One Redis command, one round trip, per block: HSET / HDEL per block event, HGET per
    block per instance for a lookup (the same keys as RedisPrefixIndex)."""

    def __init__(self, client, ns: str) -> None:
        self.c = client
        self.ns = ns

    def key(self, inst: str) -> str:
        return f"kvb:{{{self.ns}:{inst}}}:b:0"

    def apply(self, instance: str, payload: bytes) -> None:
        from kvblock.cluster import parent_tag

        key = self.key(instance)
        for ev in decode_batch(payload).events:
            if type(ev) is BlockStored:
                tag = parent_tag(ev.parent_block_hash)
                for h in ev.block_hashes:
                    self.c.hset(key, h.to_bytes(8, "big"), tag.to_bytes(4, "big"))
                    tag = parent_tag(h)
            elif type(ev) is BlockRemoved:
                for h in ev.block_hashes:
                    self.c.hdel(key, h.to_bytes(8, "big"))

    def match(self, hashes, instances) -> dict[str, int]:
        from kvblock.cluster import parent_tag

        out = {}
        for inst in instances:
            key = self.key(inst)
            tag, n = 0, 0
            for h in hashes:
                v = self.c.hget(key, h.to_bytes(8, "big"))
                if v != tag.to_bytes(4, "big"):
                    break
                n += 1
                tag = parent_tag(h)
            if n:
                out[inst] = n
        return out


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    pytest.importorskip("redis")
    from redis_fixtures import RedisServer

    s = RedisServer(tmp_path_factory.mktemp("bench-redis"))
    try:
        s.start()
    except Exception as e:  # no redis-server here: the Redis benchmarks are skipped
        pytest.skip(f"redis-server: {e}")
    yield s
    s.stop()


R_STREAM = STREAM[:128]  # the first two rounds of the 64 instances
R_EVENTS = sum(
    len(ev.block_hashes) for _, p in R_STREAM for ev in decode_batch(p).events if hasattr(ev, "block_hashes"))
_ns = iter(range(10**6))


def test_redis_ingest_batched(record, redis_server):
    from kvblock.cluster import RedisPrefixIndex

    def run():
        ix = RedisPrefixIndex(redis_server.url, f"bench{next(_ns)}", ttl_s=None)
        for name, payload in R_STREAM:
            ix.apply(name, payload)

    record("redis ingest (per block event)", "kvblock", run, per=R_EVENTS, rounds=5)


def test_redis_ingest_naive(record, redis_server):
    def run():
        ix = NaiveRedisIndex(redis_server.client(), f"naive{next(_ns)}")
        for name, payload in R_STREAM:
            ix.apply(name, payload)

    record("redis ingest (per block event)", "reference", run, per=R_EVENTS, rounds=3)


@pytest.fixture(scope="module")
def redis_lookup_state(redis_server):
    from kvblock.cluster import RedisPrefixIndex

    rng = np.random.default_rng(2)
    chain = rng.integers(1, M64, 64).tolist()
    ix = RedisPrefixIndex(redis_server.url, "lookup", ttl_s=None)
    naive = NaiveRedisIndex(redis_server.client(), "lookup")
    names = [f"e{i}" for i in range(INSTANCES)]
    for i, name in enumerate(names):
        ix.apply(name, encode_batch([_stored(chain[: i + 1]), _stored(rng.integers(1, M64, 2000).tolist())], ts=0.0))
    want = {n: i + 1 for i, n in enumerate(names)}
    assert ix.match(chain, instances=names) == naive.match(chain, names) == want
    return chain, ix, naive, names


def test_redis_lookup_pipelined(record, redis_lookup_state):
    chain, ix, _, names = redis_lookup_state
    record("redis lookup 64 blocks x 64 instances", "kvblock", lambda: ix.match(chain, instances=names), rounds=50)


def test_redis_lookup_naive(record, redis_lookup_state):
    chain, _, naive, names = redis_lookup_state
    record("redis lookup 64 blocks x 64 instances", "reference", lambda: naive.match(chain, names), rounds=5)


def test_redis_memory(report_line, redis_lookup_state):
    _, ix, _, names = redis_lookup_state
    total = sum(ix.memory_bytes(n) for n in names)
    pairs = sum(i + 1 + 2000 for i in range(INSTANCES))
    report_line(f"redis memory per (block, holder): {total / pairs:.1f} B (MEMORY USAGE of {pairs:,} pairs)")
