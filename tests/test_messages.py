"""Error messages say what is wrong (issue 13): a duplicate within one call is not a double
free, a negative block id is not an int32 overflow, a missing hash function is named, and
every count argument and request field is read the same way (a bool or a non-int is a
TypeError, a negative or out-of-range int a ValueError, each naming the field), in kvblock
and in the reference alike. Each failing call changes nothing."""

from __future__ import annotations

import pytest

from conftest import require_module
from kvblock import BlockPool, KVCacheManager, Request
from kvblock import hashing as kv_hashing
from kvblock.reference import hashing as ref_hashing
from kvblock.reference.block_pool import BlockPool as RefBlockPool
from kvblock.reference.manager import KVCacheManager as RefManager


def test_duplicate_in_one_free_is_not_called_a_double_free():
    pool = BlockPool(16, True, 4)
    ids = pool.allocate_ids(6)
    free = pool.get_num_free_blocks()
    with pytest.raises(ValueError, match=r"block 5 is listed 2 times in this call but holds 1 reference$") as e:
        pool.free_ids([5, 5])
    assert "double free" not in str(e.value)
    assert pool.get_num_free_blocks() == free and pool.blocks[5].ref_cnt == 1
    pool.touch_ids([5])
    with pytest.raises(ValueError, match="block 5 is listed 3 times in this call but holds 2 references"):
        pool.free_ids([5, 4, 5, 5])
    assert pool.blocks[5].ref_cnt == 2 and pool.blocks[4].ref_cnt == 1
    pool.free_ids(ids)
    pool.free_ids([5])
    with pytest.raises(ValueError, match="block 5 is already free .*double free"):
        pool.free_ids([5])


def test_reference_pool_says_the_same():
    pool = RefBlockPool(16, True, 4)
    blocks = pool.get_new_blocks(6)
    b = blocks[4]
    with pytest.raises(ValueError, match=rf"block {b.block_id} is listed 2 times in this call but holds 1 reference$"):
        pool.free_blocks([b, b])
    assert b.ref_cnt == 1
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="already free .*double free"):
        pool.free_blocks([b])


def test_negative_block_id_is_called_negative():
    torch = require_module("torch")
    from kvblock import BlockTable

    bt = BlockTable(4, 2, 4, 8, "cpu")
    for ids in ([-3], torch.tensor([1, -3])):
        with pytest.raises(ValueError, match=r"block id -3 at index \d is negative \(block ids are >= 0\)") as e:
            bt.add_row(ids, 1)
        assert "int32" not in str(e.value)
    assert bt.num_blocks_per_row[1] == 0
    with pytest.raises(ValueError, match="not int32-representable"):
        bt.add_row([2**31], 1)


@pytest.mark.parametrize("hashing", [kv_hashing, ref_hashing], ids=["kvblock", "reference"])
@pytest.mark.parametrize(
    "bad, message",
    [
        (None, r"hash_fn: expected a hash function such as get_hash_fn_by_name\('sha256'\), got NoneType"),
        ("sha256", r"use get_hash_fn_by_name\('sha256'\)"),
        (lambda seed: 7, "hash_fn: must return bytes, returned int"),
    ],
)
def test_init_none_hash_names_a_missing_hash_function(hashing, bad, message):
    hashing.init_none_hash(hashing.get_hash_fn_by_name("sha256"))
    root = hashing.NONE_HASH
    with pytest.raises(TypeError, match=message):
        hashing.init_none_hash(bad)
    assert hashing.NONE_HASH == root


BAD_COUNTS = [
    (True, TypeError, "expected int, got bool"),
    (2**64, ValueError, "18446744073709551616 is out of range"),
    (-1, ValueError, "must be >= 0, got -1"),
    (1.5, TypeError, "expected int, got float"),
    (None, TypeError, "expected int, got NoneType"),
]


@pytest.fixture(params=["kvblock", "reference"])
def manager(request):
    cls = KVCacheManager if request.param == "kvblock" else RefManager
    return cls(40, 4, max_model_len=64, sliding_window=8, log_stats=True)


@pytest.mark.parametrize("value, exc, message", BAD_COUNTS, ids=lambda v: repr(v)[:12])
@pytest.mark.parametrize("field", ["num_computed_tokens", "num_in_flight_tokens"])
def test_request_fields_read_like_count_arguments(manager, field, value, exc, message):
    """``request.num_computed_tokens = True`` was taken as 1 and ``2**64`` gave an
    OverflowError naming nothing; now each reads as ``num_new_tokens`` does."""
    req = Request("a", list(range(9)), block_hasher=manager.request_block_hasher)
    setattr(req, field, value)
    free = manager.block_pool.get_num_free_blocks()
    with pytest.raises(exc, match=rf"^request\.{field}: {message}"):
        manager.allocate_slots(req, 1)
    assert manager.block_pool.get_num_free_blocks() == free and manager.get_block_ids("a") == ([],)


@pytest.mark.parametrize("value, exc, message", BAD_COUNTS, ids=lambda v: repr(v)[:12])
@pytest.mark.parametrize("arg", ["num_new_tokens", "num_lookahead_tokens", "num_external_computed_tokens"])
def test_count_arguments(manager, arg, value, exc, message):
    req = Request("a", list(range(9)), block_hasher=manager.request_block_hasher)
    kw = {"num_new_tokens": 1, arg: value}
    with pytest.raises(exc, match=rf"^{arg}: {message}"):
        manager.allocate_slots(req, **kw)
    assert manager.get_block_ids("a") == ([],)


@pytest.mark.parametrize("value, exc, message", BAD_COUNTS, ids=lambda v: repr(v)[:12])
def test_record_prefix_cache_stats_checks_num_hits(manager, value, exc, message):
    req = Request("a", list(range(9)), block_hasher=manager.request_block_hasher)
    with pytest.raises(exc, match=rf"^num_hits: {message}"):
        manager.record_prefix_cache_stats(req, value)
    assert manager.make_prefix_cache_stats().requests == 0


@pytest.mark.parametrize("bad", [None, "a", 3, object()], ids=["None", "request-id", "int", "object"])
@pytest.mark.parametrize("log_stats", [True, False])
def test_record_prefix_cache_stats_names_a_non_request(bad, log_stats):
    """kvblock's own manager: ``record_prefix_cache_stats(None, 1)`` (and
    ``prefix_cache_lookup_enabled(None)``) raised AttributeError where every other method
    raises a TypeError naming ``request``; now the same TypeError, the stats unchanged.
    (kvblock.vllm's manager keeps vLLM's AttributeError, as the reference keeps its plain
    attribute reads.)"""
    manager = KVCacheManager(40, 4, max_model_len=64, log_stats=log_stats)
    message = r"^request: expected a request with a `skip_reading_prefix_cache` attribute, got "
    with pytest.raises(TypeError, match=message + type(bad).__name__):
        manager.record_prefix_cache_stats(bad, 1)
    with pytest.raises(TypeError, match=message):
        manager.prefix_cache_lookup_enabled(bad)
    with pytest.raises(TypeError, match=r"^request: .*got NoneType"):
        manager.get_computed_blocks(None)  # the core's words, which these now share
    stats = manager.make_prefix_cache_stats()
    assert stats is None if not log_stats else (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_record_prefix_cache_stats_reads_the_whole_request_before_counting():
    """A request-like object lacking ``num_tokens`` / ``num_preemptions`` is named the same way
    and counts nothing; num_hits past the request's tokens is a ValueError naming both."""
    manager = KVCacheManager(40, 4, max_model_len=64, log_stats=True)

    class Partial:
        skip_reading_prefix_cache = False
        num_tokens = 9

    with pytest.raises(TypeError, match=r"^request: expected a request with a `num_preemptions` attribute, got Partial"):
        manager.record_prefix_cache_stats(Partial(), 1)
    req = Request("a", list(range(9)), block_hasher=manager.request_block_hasher)
    with pytest.raises(ValueError, match=r"num_hits \(10\) exceeds num_tokens \(9\)"):
        manager.record_prefix_cache_stats(req, 10)
    assert manager.prefix_cache_stats.requests == 0
    manager.record_prefix_cache_stats(req, 4)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 4)


@pytest.mark.parametrize(
    "flag",
    ["enable_caching", "log_stats", "enable_kv_cache_events", "use_eagle",
     "enable_mamba_shared_prefix_checkpoint", "priority_retention", "verify_hits"],
)
@pytest.mark.parametrize("bad", [1, "yes", None])
def test_own_constructor_flags_must_be_bools_and_are_named(flag, bad):
    """kvblock's own constructor names an on/off argument that is not a bool (PyO3's own
    message named only the types); numpy's bools are bools."""
    import numpy as np

    with pytest.raises(TypeError, match=f"^{flag}: must be a bool, got"):
        KVCacheManager(16, 4, **{flag: bad})
    assert KVCacheManager(16, 4, **{flag: np.False_}).block_pool.get_num_free_blocks() == 15
