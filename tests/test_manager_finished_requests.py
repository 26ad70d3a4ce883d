"""kvblock's own manager gives no blocks to a request whose KV is gone (new-user finding M1).

A request this manager holds no block table for, but whose ``num_computed_tokens`` is set
(freed, then decoded again by a scheduler bug), or whose status is ``FINISHED_*``, used to get
a fresh table: its "computed" full blocks were cached under its hashes and announced in a
``BlockStored`` event, so a later request with the same prefix hit KV nobody wrote.
``allocate_slots`` and ``allocate_slots_batch`` now refuse it with a ``ValueError`` naming the
request, and change nothing (the batch is undone: requests listed before it get nothing).
vLLM's own manager has no such guard, and ``kvblock.vllm``'s keeps vLLM's behaviour (checked
against the installed vLLM below).
"""

from __future__ import annotations

import pytest

from kvblock import KVCacheManager, Request, RequestStatus


def _manager() -> KVCacheManager:
    return KVCacheManager(64, 16, enable_kv_cache_events=True)


def _req(m: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, block_hasher=m.request_block_hasher)


def _state(m: KVCacheManager, ids: list[str]) -> tuple:
    """Everything a call could change: free queue, ref counts, cache keys, tables, events."""
    pool = m.block_pool
    return (
        pool.get_num_free_blocks(),
        pool.free_queue_ids(),
        [pool.ref_cnt(i) for i in range(pool.num_gpu_blocks)],
        pool.cached_items(),
        [m.get_block_ids(r) for r in ids],
        m.num_requests,
    )


def _finished_and_evicted(m: KVCacheManager) -> Request:
    """The finding's request: admitted, fully computed, finished, freed, its blocks evicted."""
    x = _req(m, "X", list(range(5000, 5064)) + [1])
    assert m.admit_batch([x])[0] == 1
    x.num_computed_tokens = x.num_tokens
    x.status = RequestStatus.FINISHED_STOPPED
    m.free(x)
    m.block_pool.free_ids(m.block_pool.allocate_ids(63))  # every block handed out: X's keys go
    assert m.block_pool.num_cached_keys() == 0
    m.take_events()
    return x


def test_batch_refuses_a_freed_request_and_undoes_the_batch():
    m = _manager()
    x = _finished_and_evicted(m)
    x.status = RequestStatus.RUNNING  # a scheduler that lost track: computed tokens, no table
    good = _req(m, "G", list(range(40)))
    before = _state(m, ["X", "G"])
    with pytest.raises(ValueError, match=r'request "X" holds no blocks in this manager but has 65 computed'):
        m.allocate_slots_batch([good, x], [good.num_tokens, 1])
    assert _state(m, ["X", "G"]) == before
    assert m.take_events() == []
    # nothing was cached: a request with X's prefix finds no hit
    y = _req(m, "Y", list(range(5000, 5064)) + [2])
    assert m.probe(y) == 0
    # the batch without X goes through
    counts, ids = m.allocate_slots_batch([good], [good.num_tokens])
    assert counts.tolist() == [3] and len(ids) == 3


def test_allocate_slots_refuses_a_freed_request_with_computed_tokens():
    m = _manager()
    x = _finished_and_evicted(m)
    x.status = RequestStatus.RUNNING
    before = _state(m, ["X"])
    with pytest.raises(ValueError, match=r"holds no blocks in this manager but has 65 computed"):
        m.allocate_slots(x, 1)
    assert _state(m, ["X"]) == before
    assert m.take_events() == []
    assert m.probe(_req(m, "Y", list(range(5000, 5064)) + [2])) == 0


@pytest.mark.parametrize("status", [s for s in RequestStatus if RequestStatus.is_finished(s)], ids=lambda s: s.name)
def test_a_finished_request_gets_no_blocks(status):
    """A finished request without a table (aborted while waiting, or freed and reset) is
    refused by allocate_slots, allocate_slots_batch and admit_batch, naming its status;
    nothing changes."""
    m = _manager()
    r = _req(m, "F", list(range(40)))
    r.status = status
    before = _state(m, ["F"])
    with pytest.raises(ValueError, match=rf'request "F" is finished \({status.name}\)'):
        m.allocate_slots(r, r.num_tokens)
    assert _state(m, ["F"]) == before
    with pytest.raises(ValueError, match=rf'request "F" is finished \({status.name}\)'):
        m.allocate_slots_batch([r], [r.num_tokens])
    assert _state(m, ["F"]) == before
    waiting = _req(m, "W", list(range(100, 140)))
    before = _state(m, ["F", "W"])
    with pytest.raises(ValueError, match=rf'request "F" is finished \({status.name}\)'):
        m.admit_batch([waiting, r])  # the batch is undone: W is not admitted either
    assert _state(m, ["F", "W"]) == before
    assert m.take_events() == []


def test_waiting_and_running_requests_are_allocated_as_before():
    """The guard reads only requests with no table: a new waiting request is allocated, and a
    running one (table held, computed tokens set) decodes."""
    m = _manager()
    r = _req(m, "R", list(range(31)))
    blocks = m.allocate_slots(r, r.num_tokens)
    assert blocks is not None and len(m.get_block_ids("R")[0]) == 2
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens
    r.append_output_token_ids(7)
    assert m.allocate_slots(r, 1) is not None
    counts, _ = m.allocate_slots_batch([r], [1])
    assert counts.tolist() == [0]


def test_the_vllm_drop_in_allocates_a_freed_request_as_vllm_does():
    """vLLM's manager has no guard: a freed request with computed tokens gets a new table and
    its blocks are cached. kvblock.vllm's manager does exactly what the installed vLLM does."""
    from conftest import require_module

    require_module("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import RequestStatus as VllmStatus

    from vllm_oracle import A, both, request, state

    out = []
    for m in both([FullAttentionSpec(block_size=16, **A)], 64, 16, 16, enable_kv_cache_events=True):
        x = request("X", list(range(5000, 5064)) + [1], 16)
        blocks, hit, *_ = m.get_computed_blocks(x)
        assert m.allocate_slots(x, x.num_tokens - hit, hit, blocks) is not None
        x.num_computed_tokens = x.num_tokens
        x.status = VllmStatus.FINISHED_STOPPED
        m.free(x)
        new = m.allocate_slots(x, 1)
        out.append((new.get_block_ids(), state(m)))
    assert out[0] == out[1]
