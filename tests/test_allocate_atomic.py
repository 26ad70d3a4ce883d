"""A failed ``allocate_slots`` changes nothing (issue 13): computed tokens past
``max_model_len`` used to raise from the external-token allocation after the prefix hit's
blocks had been touched, leaking their references for good."""

from __future__ import annotations

import pytest


def _state(mgr, request_ids):
    pool = mgr.block_pool
    return (
        pool.get_num_free_blocks(),
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [pool.blocks[i].ref_cnt for i in range(pool.num_gpu_blocks)],
        [mgr.get_block_ids(r) for r in request_ids],
    )


def _admit(impl, mgr, rid, tokens):
    req = impl_request(impl, mgr, rid, tokens)
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    return req


def impl_request(impl, mgr, rid, tokens):
    from kvblock.request import Request

    impl.hashing.init_none_hash(impl.hashing.get_hash_fn_by_name("sha256"))
    return Request(rid, tokens, block_hasher=mgr.request_block_hasher)


@pytest.mark.parametrize("external", [53, 200, 10**6])
def test_external_tokens_past_max_model_len_leak_nothing(impl, external):
    """The issue's case: a 12-token request admitted and freed, then a 13-token request
    with the same prefix (a 3-block hit) and external tokens past max_model_len."""
    mgr = impl.KVCacheManager(40, 4, max_model_len=64)
    first = _admit(impl, mgr, "a", list(range(12)))
    mgr.free(first)
    assert mgr.block_pool.get_num_free_blocks() == 39
    req = impl_request(impl, mgr, "b", list(range(13)))
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert hit == 12
    before = _state(mgr, ["a", "b"])
    with pytest.raises(ValueError, match="num_external_computed_tokens.*max_model_len 64"):
        mgr.allocate_slots(req, 1, hit, blocks, num_external_computed_tokens=external)
    assert _state(mgr, ["a", "b"]) == before
    assert mgr.block_pool.get_num_free_blocks() == 39
    mgr.free(req)
    assert mgr.reset_prefix_cache()
    # the manager goes on working: the same request with external tokens that fit
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 1, hit, blocks, num_external_computed_tokens=64 - 13) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 39


def test_computed_tokens_at_max_model_len_are_accepted(impl):
    """Exactly max_model_len computed tokens is the boundary that still fits."""
    mgr = impl.KVCacheManager(40, 4, max_model_len=64)
    req = impl_request(impl, mgr, "a", list(range(13)))
    assert mgr.allocate_slots(req, 0, num_external_computed_tokens=64) is not None
    assert len(mgr.get_block_ids("a")[0]) == 16
    other = impl_request(impl, mgr, "b", list(range(13)))
    with pytest.raises(ValueError, match="65 external"):
        mgr.allocate_slots(other, 0, num_external_computed_tokens=65)


def test_running_request_computed_past_max_model_len(impl):
    """A running request whose num_computed_tokens (plus external) passes max_model_len is
    refused too, naming the field, and keeps its blocks."""
    mgr = impl.KVCacheManager(40, 4, max_model_len=64)
    req = _admit(impl, mgr, "a", list(range(12)))
    before = _state(mgr, ["a"])
    req.num_computed_tokens = 65
    with pytest.raises(ValueError, match="request.num_computed_tokens: 65 computed"):
        mgr.allocate_slots(req, 1)
    assert _state(mgr, ["a"]) == before


def _known(mgr):
    """The request ids a manager holds state for."""
    if hasattr(mgr, "req_to_blocks"):
        return sorted(set(mgr.req_to_blocks) | set(mgr.num_cached_block))
    return mgr.num_requests


def test_pool_short_for_skipped_tokens_leaves_no_table(impl):
    """A request with computed tokens outside its sliding window, no blocks and no hit to
    adopt is counted as if they were skipped but gets blocks for all of them (as in vLLM):
    the pool is short, the call raises, and no empty table is left behind (the reference
    used to keep one). kvblock's own manager refuses such a request before it reads the pool
    (computed tokens and no table: its KV is gone, tests/test_manager_finished_requests.py);
    it changes nothing either."""
    mgr = impl.KVCacheManager(11, 4, max_model_len=64, sliding_window=3, enable_caching=False)
    req = impl_request(impl, mgr, "a", list(range(41)))
    req.num_computed_tokens = 40
    known = _known(mgr)
    before = _state(mgr, ["a"])
    msg = "holds no blocks in this manager but has 40 computed" if impl.name == "kvblock" else "Cannot get 11 free"
    with pytest.raises(ValueError, match=msg):
        mgr.allocate_slots(req, 1)
    assert _state(mgr, ["a"]) == before and _known(mgr) == known


def test_admit_batch_refuses_nothing_it_cannot_do():
    """admit_batch checks every request before it admits any."""
    from impls import IMPLS

    impl = IMPLS["kvblock"]
    mgr = impl.KVCacheManager(40, 4, max_model_len=64)
    first = _admit(impl, mgr, "a", list(range(12)))
    mgr.free(first)
    good = impl_request(impl, mgr, "b", list(range(13)))
    long = impl_request(impl, mgr, "c", list(range(65)))
    before = _state(mgr, ["a", "b", "c"])
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.admit_batch([good, long])
    assert _state(mgr, ["a", "b", "c"]) == before
    n, *_ = mgr.admit_batch([good])
    assert n == 1
