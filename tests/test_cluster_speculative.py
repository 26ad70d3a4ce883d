"""Speculative entries (kvblock.cluster.speculative): blocks just routed to an engine count for
routing until the engine's own events confirm them, drop them, or their TTL passes; the exact
answer (``match``, ``Decision.cached_blocks``) never includes them. The fleet replay shows
their effect on a burst of one new prefix, with 0 over-reports."""

from __future__ import annotations

import numpy as np
import pytest

from cluster_helpers import chain
from kvblock.cluster import DictIndex, PrefixIndex, Router
from kvblock.cluster.speculative import SpeculativeIndex
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvblock.replay import SimConfig
from kvblock.replay.fleet import FleetConfig, replay_fleet
from kvblock.replay.trace import Trace, TraceRequest


class Clock:
    """A settable clock (ms)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stored(hashes, parent=None):
    return encode_batch([BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=16,
                                     lora_id=None, medium="GPU", lora_name=None)], ts=0.0)


def removed(hashes):
    return encode_batch([BlockRemoved(block_hashes=hashes, medium="GPU")], ts=0.0)


@pytest.fixture(params=["rust", "dict"])
def spec(request):
    clock = Clock()
    base = PrefixIndex(16) if request.param == "rust" else DictIndex(16)
    ix = SpeculativeIndex(base, ttl_ms=100, clock_ms=clock)
    ix.add_instance("a")
    ix.add_instance("b")
    return ix, clock


def test_speculative_entries_never_enter_the_exact_answer(spec):
    ix, clock = spec
    c = chain(1, 6)
    ix.apply("a", stored(c[:2]))
    assert ix.speculate("a", c, start=2) == 4
    assert ix.match(c) == {"a": 2}  # exact: what the events said
    exact, sp = ix.match_both(c)
    assert exact == {"a": 2} and sp == {"a": 6}
    # another chain sharing no parent links does not ride on the entries
    other = chain(2, 6)
    assert ix.match_both(other) == ({}, {})
    # a chain that diverges after 3 blocks: speculation counts up to the divergence only
    div = c[:3] + chain(3, 3)
    assert ix.match_both(div)[1] == {"a": 3}
    assert ix.stats.added == 4 and ix.stats.live == 4


def test_events_confirm_or_drop_entries(spec):
    ix, clock = spec
    c = chain(1, 6)
    ix.speculate("a", c)
    ix.speculate("b", c[:3])
    ix.apply("a", stored(c[:4]))  # the engine computed 4 of the 6: confirmed
    assert ix.stats.confirmed == 4 and ix.speculative_blocks("a") == 2
    assert ix.match(c) == {"a": 4}
    assert ix.match_both(c)[1] == {"a": 6, "b": 3}
    ix.apply("a", removed([c[5]]))  # evicted before it was stored: dropped
    assert ix.stats.dropped == 1 and ix.match_both(c)[1] == {"a": 5, "b": 3}
    ix.apply("b", encode_batch([AllBlocksCleared()], ts=0.0))
    assert ix.stats.dropped == 4 and ix.speculative_blocks("b") == 0
    ix.clear_instance("a")  # a restart, a lost batch: everything speculated is void
    assert ix.stats.dropped == 5 and ix.match_both(c) == ({}, {})
    assert ix.stats.live == 0
    assert ix.stats.added == ix.stats.confirmed + ix.stats.dropped + ix.stats.expired


def test_entries_expire_after_the_ttl(spec):
    ix, clock = spec
    c = chain(1, 4)
    ix.speculate("a", c)
    clock.t = 99
    assert ix.match_both(c)[1] == {"a": 4}
    ix.speculate("a", c)  # routed again: a fresh TTL, not counted twice
    assert ix.stats.added == 4
    clock.t = 150
    assert ix.match_both(c)[1] == {"a": 4}
    clock.t = 198
    assert ix.match_both(c)[1] == {"a": 4}
    clock.t = 199  # 99 + the TTL
    assert ix.match_both(c)[1] == {}
    ix.expire()
    assert ix.stats.expired == 4 and ix.stats.live == 0 and ix.speculative_blocks("a") == 0


def test_bad_input_changes_nothing(spec):
    ix, clock = spec
    c = chain(1, 4)
    ix.speculate("a", c)
    before = (ix.match_both(c), ix.stats.to_dict())
    with pytest.raises(ValueError):
        ix.apply("a", b"\x93garbage")
    with pytest.raises((ValueError, TypeError)):
        ix.speculate("a", ["not a hash"])
    assert (ix.match_both(c), ix.stats.to_dict()) == before
    with pytest.raises(ValueError):
        SpeculativeIndex(PrefixIndex(16), ttl_ms=0, clock_ms=clock)
    with pytest.raises(ValueError):
        SpeculativeIndex(PrefixIndex(16), ttl_ms=5, clock_ms=clock, max_entries=0)
    small = SpeculativeIndex(PrefixIndex(16), ttl_ms=5, clock_ms=clock, max_entries=3)
    assert small.speculate("a", c) == 3 and small.stats.refused == 1


def test_router_scores_with_speculation_and_reports_exact():
    clock = Clock()
    ix = SpeculativeIndex(PrefixIndex(16), ttl_ms=1000, clock_ms=clock)
    names = [f"e{i}" for i in range(4)]
    router = Router(names, ix, "cache-aware", block_size=16, load_weight=0.1)
    c = chain(5, 64)  # a new 1024-token prefix, a burst of 4 requests of it
    decisions = []
    for _ in range(4):
        d = router.route(c, 64 * 16)
        router.add_waiting(d.instance, 64 * 16)
        decisions.append(d)
    assert len({d.instance for d in decisions}) == 1  # the burst follows the first
    assert all(d.cached_blocks == 0 and d.cached_tokens == 0 for d in decisions)  # nothing claimed
    assert [d.speculative_blocks for d in decisions] == [0, 64, 64, 64]
    # without speculation the same burst is spread by load
    plain = Router(names, PrefixIndex(16), "cache-aware", block_size=16, load_weight=0.1)
    spread = set()
    for _ in range(4):
        d = plain.route(c, 64 * 16)
        plain.add_waiting(d.instance, 64 * 16)
        spread.add(d.instance)
    assert len(spread) == 4


def burst(n: int = 16, prefix: int = 1024, tail: int = 64) -> Trace:
    """``n`` requests arriving at once, sharing one new ``prefix``-token prompt head."""
    rng = np.random.default_rng(0)
    head = rng.integers(0, 50_000, prefix)
    reqs = []
    for k in range(n):
        toks = np.concatenate([head, rng.integers(0, 50_000, tail)]).astype(np.int64)
        reqs.append(TraceRequest(k, f"req-{k}", 0.0, len(toks), 4, prompt_tokens=toks))
    return Trace("burst", "test:burst", reqs)


@pytest.mark.parametrize("instances,load_weight", [(16, 0.5), (8, 0.1)])
def test_fleet_burst_with_and_without_speculation(instances, load_weight):
    cfg = SimConfig(num_blocks=2048, block_size=16)
    f = FleetConfig(instances=instances, router="cache-aware", load_weight=load_weight, check_all=True)
    plain = replay_fleet(burst(), cfg, f)
    fast = replay_fleet(burst(), cfg, FleetConfig(**{**f.__dict__, "speculative_ttl_ms": 500.0}))
    # without: the burst is spread (every engine it reaches computes the prefix);
    # with: it follows the first engine until load outweighs the prefix
    assert fast.hit_rate > plain.hit_rate + 0.1
    assert sum(1 for s in fast.per_instance if s.requests) < sum(1 for s in plain.per_instance if s.requests)
    assert plain.over_reports == fast.over_reports == 0  # the exact answers stayed exact
    sp = fast.speculation
    assert sp is not None and sp["added"] > 0 and sp["confirmed"] == sp["added"] and sp["live"] == 0
    assert plain.speculation is None and fast.to_dict()["speculation"] == sp
