"""The fleet index's memory cap (exact under the cap: it may under-report, never
over-report; every dropped pair counted) and tier weights (``match_weighted`` against the
reference, and the cache-aware router's choice with and without them)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_streams import MEDIA, chain_of, fleet_stream, queries
from kvblock.cluster import DictIndex, PrefixIndex, Router
from kvblock.events import BlockStored


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None)


def held_pairs(ref: DictIndex) -> set[tuple]:
    """(medium, hash, parent tag, instance) of every pair the reference holds."""
    return {(m, h, tag, name) for m, t in ref.blocks.items() for h, node in t.items()
            for tag, s in node.items() for name in s}


def kept_pairs(ix: PrefixIndex) -> set[tuple]:
    return {(m, h, tag, name) for name in ix.instances() for m in ix.media() for h, tag in ix.blocks_of(name, m)}


@settings(max_examples=200, deadline=None)
@given(fleet_stream(), queries, st.integers(0, 40))
def test_capped_index_never_over_reports(stream, qs, cap):
    """Lockstep with the uncapped reference: the capped index keeps a subset of the truth,
    answers at most the truth's prefix, stays under the cap, and counts what it dropped."""
    ix, ref = PrefixIndex(max_pairs=cap), DictIndex()
    for inst, payload in stream:
        ix.apply(inst, payload)
        ref.apply(inst, payload)
        assert ix.num_pairs() <= cap
        kept, truth = kept_pairs(ix), held_pairs(ref)
        assert kept <= truth
        assert len(kept) == ix.num_pairs()
        assert sum(ix.instance_pairs(n) for n in ix.instances()) == ix.num_pairs()
        # every pair held but not kept went by eviction, and was counted
        assert len(truth) - len(kept) <= ix.evicted()[0]
        for q in qs:
            ch = chain_of(q)
            for medium in (None,) + MEDIA[:2]:
                want = ref.match(ch, medium)
                for name, k in ix.match(ch, medium).items():
                    assert k <= want.get(name, 0), (name, q, medium)


def test_cap_counts_and_policy():
    ix = PrefixIndex(16)
    shared = list(range(1, 11))
    for name, base in (("a", 100), ("b", 200)):
        ix.apply_events(name, [stored(shared), stored(list(range(base, base + 10)), shared[-1])])
    assert ix.num_pairs() == 40 and ix.evicted() == (0, 0, 0)
    ix.max_pairs = 30
    # private tails go first: the shared prefix still answers for both
    assert ix.num_pairs() == 30 and ix.evicted() == (10, 10, 1)
    assert ix.match(shared) == {"a": 10, "b": 10}
    assert ix.max_pairs == 30
    ix.max_pairs = None
    ix.apply_events("c", [stored(list(range(300, 340)))])
    assert ix.num_pairs() == 70 and ix.evicted()[0] == 10


@pytest.mark.parametrize("cap", [500, 200, 60])
@pytest.mark.parametrize("upfront", [False, True])
def test_cap_keeps_each_chains_head(cap, upfront):
    """Conversations (some behind one shared system prompt) stored in steps on 4
    instances, in lockstep with the uncapped reference: the capped index evicts chains'
    tails first, so with ``deepest`` the longest answer it still gives, every chain answers
    at least ``min(truth, deepest - 1)`` blocks and never more than the truth; the cap set
    on a full index (depths computed then) or from the start (depths kept on the way)."""
    system = [("sys", b) for b in range(12)]
    chains = []
    for c in range(80):
        path = list(system) if c % 2 == 0 else []
        path += [(c, b) for b in range(1 + (c * 37) % 30)]
        chains.append((f"e{c % 4}", chain_of(tuple(path))))
    ix, ref = PrefixIndex(16, max_pairs=None if upfront else cap), DictIndex()
    for step in range(3):  # each conversation grows by a third per step, under its parent
        for name, ch in chains:
            a, b = len(ch) * step // 3, len(ch) * (step + 1) // 3
            if a < b:
                evs = [stored(ch[a:b], ch[a - 1] if a else None)]
                ix.apply_events(name, evs)
                ref.apply_events(name, evs)
    if upfront:
        ix.max_pairs = cap
    assert ix.num_pairs() <= cap < sum(len(ch) for _, ch in chains)
    assert ix.evicted()[0] > 0
    deepest = max(ix.match(ch).get(name, 0) for name, ch in chains)
    for name, ch in chains:
        got, truth = ix.match(ch).get(name, 0), ref.match(ch)[name]
        assert min(truth, deepest - 1) <= got <= truth, (name, len(ch), got, deepest)


@pytest.mark.parametrize("bad", [-1, True, "10", 1.5, [3]])
def test_bad_cap_changes_nothing(bad):
    ix = PrefixIndex(16, max_pairs=8)
    ix.apply_events("a", [stored([1, 2, 3, 4])])
    with pytest.raises((TypeError, ValueError), match="max_pairs"):
        ix.max_pairs = bad
    assert ix.max_pairs == 8 and ix.num_pairs() == 4 and ix.evicted() == (0, 0, 0)
    with pytest.raises((TypeError, ValueError), match="max_pairs"):
        PrefixIndex(16, max_pairs=bad)


WEIGHTS = st.fixed_dictionaries({}, optional={m: st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]) for m in MEDIA})


@settings(max_examples=200, deadline=None)
@given(fleet_stream(), queries, WEIGHTS)
def test_match_weighted_against_reference(stream, qs, weights):
    ix, ref = PrefixIndex(), DictIndex()
    for inst, payload in stream:
        ix.apply(inst, payload)
        ref.apply(inst, payload)
    for q in qs:
        ch = chain_of(q)
        got, want = ix.match_weighted(ch, weights), ref.match_weighted(ch, weights)
        assert got.keys() == want.keys()
        for name, (credit, blocks) in got.items():
            assert blocks == want[name][1] and math.isclose(credit, want[name][0])
            # never more than the prefix at the best weight, at least the best tier's prefix
            top = max(weights.values(), default=0.0)
            assert credit <= top * blocks + 1e-9
        # a single named medium at weight 1 is the plain per-medium match (match(ch, None) is
        # any medium; weights keyed None are the blocks of events without a medium)
        for m in MEDIA[:2]:
            plain = {n: (float(k), k) for n, k in ix.match(ch, m).items()}
            assert ix.match_weighted(ch, {m: 1.0}) == plain


def test_weighted_credit_by_tier():
    ix = PrefixIndex(16)
    q = list(range(1, 9))
    ix.apply_events("a", [stored(q[:4]), stored(q[4:], q[3], medium="CPU")])
    ix.apply_events("b", [stored(q, medium="CPU")])
    ix.apply_events("c", [stored(q[:2]), stored(q, medium="disk")])
    w = {"GPU": 1.0, "CPU": 0.75, "disk": 0.25}
    assert ix.match_weighted(q, w) == {"a": (7.0, 8), "b": (6.0, 8), "c": (3.5, 8)}
    assert ix.match_weighted(q, {"GPU": 1.0}) == {"a": (4.0, 4), "c": (2.0, 2)}
    for bad in ({"GPU": -1.0}, {"GPU": float("nan")}, {"GPU": "1"}, {"GPU": True}, {3: 1.0}):
        with pytest.raises((TypeError, ValueError), match="weights"):
            ix.match_weighted(q, bad)


@pytest.mark.parametrize("make", [PrefixIndex, DictIndex])
def test_router_prefers_the_gpu_prefix_with_tier_weights(make):
    """a holds 8 blocks on host memory (offloaded), b 6 on the GPU: on prefix length alone
    a wins; with host memory at 0.5, a's credit is 4 blocks against b's 6."""
    ix = make(16)
    q = list(range(1, 9))
    ix.apply_events("a", [stored(q, medium="CPU")])
    ix.apply_events("b", [stored(q[:6])])
    plain = Router(["a", "b"], ix, load_weight=0.0)
    assert plain.route(q, 8 * 16).instance == "a"
    weighted = Router(["a", "b"], ix, load_weight=0.0, tier_weights={"GPU": 1.0, "CPU": 0.5})
    d = weighted.route(q, 8 * 16)
    assert (d.instance, d.cached_blocks, d.cached_tokens) == ("b", 6, 96)
    # a medium left out weighs nothing: a GPU-only router never counts a's host blocks
    gpu_only = Router(["a", "b"], ix, load_weight=0.0, tier_weights={"GPU": 1.0})
    assert gpu_only.route(q, 8 * 16).instance == "b"


def test_router_refuses_bad_tier_weights():
    ix = PrefixIndex(16)
    for bad in ({}, {"GPU": -0.5}, {"GPU": float("inf")}, {"GPU": "x"}, {1: 1.0}, [("GPU", 1.0)]):
        with pytest.raises(ValueError, match="tier_weights"):
            Router(["a"], ix, tier_weights=bad)
    with pytest.raises(ValueError, match="medium"):
        Router(["a"], ix, tier_weights={"GPU": 1.0}, medium="GPU")

    class NoWeights:
        def match(self, block_hashes, medium=None):
            return {}

    with pytest.raises(ValueError, match="match_weighted"):
        Router(["a"], NoWeights(), tier_weights={"GPU": 1.0})
