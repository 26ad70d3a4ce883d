"""The router refuses what would make its claims wrong (issue 34, a fresh user's finds): a
``block_size`` other than its index's (a 4-block hit at 16 tokens claimed as 4 x 32 tokens),
negative token counts in ``route``, ``set_load`` and ``add_waiting``; each refusal leaves the
router as it was."""

from __future__ import annotations

import pytest

from kvblock.cluster import DictIndex, PrefixIndex, Router
from kvblock.events import BlockStored


def _index(block_size: int = 16) -> PrefixIndex:
    ix = PrefixIndex(block_size=block_size)
    ix.apply_events("a", [BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=list(range(64)),
                               block_size=block_size, lora_id=None, medium="GPU", lora_name=None)])
    return ix


def test_a_block_size_other_than_the_index_is_refused():
    with pytest.raises(ValueError, match="differs from the index's block_size 16"):
        Router(["a", "b"], _index(16), block_size=32)
    r = Router(["a", "b"], _index(16), block_size=16, load_weight=0.0)
    d = r.route([1, 2, 3, 4], 65)
    assert (d.instance, d.cached_blocks, d.cached_tokens) == ("a", 4, 64)
    # an index that takes any block size (None) leaves the router's to the caller
    assert Router(["a"], PrefixIndex(), block_size=32).block_size == 32
    assert Router(["a"], DictIndex(block_size=None), block_size=32).block_size == 32
    for bad in (0, -16, True, 16.0):
        with pytest.raises(ValueError, match="block_size"):
            Router(["a"], PrefixIndex(), block_size=bad)


def test_negative_token_counts_are_refused_and_change_nothing():
    r = Router(["a", "b"], _index(), load_weight=1.0)
    r.set_load("a", 100, 20)
    with pytest.raises(ValueError, match="num_tokens: must be >= 0"):
        r.route([], -5)
    with pytest.raises(ValueError, match="running_tokens"):
        r.set_load("a", -1, 0)
    with pytest.raises(ValueError, match="waiting_tokens"):
        r.set_load("a", 5, -1)
    with pytest.raises(ValueError, match="tokens: must be >= 0"):
        r.add_waiting("a", -3)
    with pytest.raises(TypeError, match="num_tokens"):
        r.route([], 1.5)
    with pytest.raises(KeyError):
        r.add_waiting("zz", 3)
    assert r.load("a") == 120 and r.load("b") == 0
    assert r.route([], 0).cached_tokens == 0


def test_an_infinite_load_weight_is_refused():
    """``inf`` made every idle instance's score ``inf * 0 = nan``, which no comparison
    prefers: routing then ignored both the cache and the load (the CLI already refused it)."""
    for bad in (float("inf"), float("nan"), -0.5):
        with pytest.raises(ValueError, match="load_weight must be a finite number >= 0"):
            Router(["a", "b"], _index(), load_weight=bad)
    for bad in ("0.5", None, True):
        with pytest.raises(TypeError, match="load_weight"):
            Router(["a", "b"], _index(), load_weight=bad)
    r = Router(["a", "b"], _index(), load_weight=1e9)  # large but finite: least-loaded
    r.set_load("a", 10, 0)
    assert [r.route([1, 2, 3, 4], 64).instance for _ in range(3)] == ["b", "b", "b"]


def test_instance_names_are_checked_where_they_enter():
    with pytest.raises(TypeError, match=r"write \['e0'\]"):
        Router("e0", _index())  # a string is not a list of names (it was split into 'e', '0')
    for bad in ([1, 2], ["a", None]):
        with pytest.raises(TypeError, match="instance name must be a str"):
            Router(bad, _index())
    with pytest.raises(ValueError, match="must not be empty"):
        Router(["a", ""], _index())
    r = Router(["a"], _index())
    for bad, exc in ((123, TypeError), ("", ValueError), (None, TypeError)):
        with pytest.raises(exc):
            r.add_instance(bad)
    assert r.instances == ["a"]
    with pytest.raises(KeyError, match="unknown instance 'zz'"):
        r.load("zz")
    r.add_instance("b")
    assert r.instances == ["a", "b"] and r.load("b") == 0


def test_tier_weights_report_blocks_not_the_weighted_credit():
    """With tier weights the score is a weighted prefix (a float); the decision's
    ``speculative_blocks`` stays a block count, equal to ``cached_blocks`` without a
    speculative index, as its docstring says."""
    ix = PrefixIndex(block_size=16)
    ix.apply_events("a", [BlockStored(block_hashes=list(range(1, 7)), parent_block_hash=None,
                                      token_ids=list(range(96)), block_size=16, lora_id=None, medium="CPU",
                                      lora_name=None)])
    r = Router(["a", "b"], ix, tier_weights={"GPU": 1.0, "CPU": 0.5}, load_weight=0.0)
    d = r.route(list(range(1, 7)), 100)
    assert (d.instance, d.cached_blocks, d.cached_tokens) == ("a", 6, 96)
    assert d.speculative_blocks == 6 and type(d.speculative_blocks) is int
