"""``kvblock replay --ideal`` against an independent model of vLLM's prefix cache.

The model never hashes a token: following the shared traces README, block ``j`` of trace block
``h`` is keyed by the pair ``(h, j)`` (ids are prefix hashes, so the pair names the whole
prefix). It keeps vLLM 0.33.0's free queue (spec §3.3, §4.1) as an ordered dict of block ids:
a lookup walks keys until the first miss and keeps the last token uncomputed; an admission
takes the hit blocks out of the queue and pops new blocks from its head, evicting their keys;
the request's full blocks are cached; the request is freed tail first, unhashed blocks to the
head and hashed ones to the tail. Requests needing more blocks than the cache holds are
skipped (unservable).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
from conftest import shared_path

from kvblock.replay import SimConfig, load_trace, replay

TRACES = {
    "conversation": ("mooncake_fast25_conversation_trace.jsonl", 300),
    "synthetic": ("mooncake_fast25_synthetic_trace.jsonl", 200),
}


def model_ideal(records: list[dict], block_size: int, num_blocks: int | None) -> dict:
    """vLLM's prefix cache with requests that finish instantly, on (hash id, sub-block) keys."""
    k = 512 // block_size
    if num_blocks is None:
        num_blocks = sum(-(-r["input_length"] // block_size) for r in records) + 1
    usable = num_blocks - 1
    queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
    key_of: dict[int, tuple[int, int]] = {}
    blocks_of: dict[tuple[int, int], list[int]] = {}
    hits = queries = evictions = unservable = 0
    for rec in records:
        n = rec["input_length"]
        num_full, total = n // block_size, -(-n // block_size)
        if total > usable:
            unservable += 1
            continue
        keys = [(rec["hash_ids"][q // k], q % k) for q in range(num_full)]
        hit = 0
        while hit < min(num_full, (n - 1) // block_size) and keys[hit] in blocks_of:
            hit += 1
        table = [blocks_of[keys[q]][0] for q in range(hit)]
        for b in table:
            del queue[b]
        for _ in range(total - hit):
            b, _ = queue.popitem(last=False)
            if b in key_of:
                key = key_of.pop(b)
                blocks_of[key].remove(b)
                if not blocks_of[key]:
                    del blocks_of[key]
                evictions += 1
            table.append(b)
        for q in range(hit, num_full):
            key_of[table[q]] = keys[q]
            blocks_of.setdefault(keys[q], []).append(table[q])
        hits += hit * block_size
        queries += n
        freed = table[::-1]
        for b in reversed([b for b in freed if b not in key_of]):
            queue[b] = None
            queue.move_to_end(b, last=False)
        for b in freed:
            if b in key_of:
                queue[b] = None
    return {"hits": hits, "queries": queries, "evictions": evictions, "unservable": unservable}


def test_model_on_the_spec_example():
    """Spec §4.1's worked example, in hash-id form: the second request hits the shared 48 tokens."""
    recs = [{"input_length": 55, "hash_ids": [0]}, {"input_length": 53, "hash_ids": [0]}]
    assert model_ideal(recs, 16, 11) == {"hits": 48, "queries": 108, "evictions": 0, "unservable": 0}


@pytest.fixture(scope="module", params=sorted(TRACES))
def trace_slice(request):
    name, n = TRACES[request.param]
    path = shared_path("traces", name)
    with open(path) as f:
        records = [json.loads(next(f)) for _ in range(n)]
    return request.param, load_trace(str(path), limit=n), records


@pytest.mark.parametrize("capacity", [1_000, 10_000, None], ids=["1k", "10k", "unlimited"])
def test_ideal_hits_match_the_independent_model(trace_slice, capacity):
    name, trace, records = trace_slice
    result = replay(trace, SimConfig(ideal=True, num_blocks=capacity))
    expected = model_ideal(records, 16, capacity)
    got = {"hits": result.hits, "queries": result.queries, "evictions": result.evictions,
           "unservable": len(result.unservable)}
    assert got == expected
    assert result.hits > 0 and result.served == len(records) - expected["unservable"]
    assert result.blocks_hit * 16 == result.hits
    if capacity is None:
        assert result.evictions == 0 and not result.unservable
    else:
        assert result.evictions > 0
    if capacity == 1_000:
        assert result.unservable and all(u.blocks_needed > 999 for u in result.unservable)


def test_reference_agrees_on_a_small_slice(trace_slice):
    name, trace, records = trace_slice
    small = trace.head(60)
    cfg = SimConfig(ideal=True, num_blocks=2_000, fingerprint=True)
    kv = replay(small, cfg)
    ref = replay(small, SimConfig(ideal=True, num_blocks=2_000, fingerprint=True, impl="reference"))
    assert (kv.hits, kv.queries, kv.evictions, kv.fingerprint) == (ref.hits, ref.queries, ref.evictions, ref.fingerprint)
    assert (kv.hits, kv.queries, kv.evictions) == tuple(model_ideal(records[:60], 16, 2_000)[k] for k in ("hits", "queries", "evictions"))
    assert kv.usage.tolist() == ref.usage.tolist()


def test_block_size_32_and_xxhash(trace_slice):
    """Other block sizes and hash algorithms change the keys, not the model."""
    name, trace, records = trace_slice
    small = trace.head(100)
    result = replay(small, SimConfig(ideal=True, num_blocks=3_000, block_size=32, hash_algo="xxhash"))
    expected = model_ideal(records[:100], 32, 3_000)
    assert (result.hits, result.queries, result.evictions) == (expected["hits"], expected["queries"], expected["evictions"])
