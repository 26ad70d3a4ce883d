"""Cases the vLLM lockstep (tests/test_vllm_lockstep.py) found, kept as regression tests with
vLLM 0.33.0's own unpatched ``KVCacheManager`` as the oracle: each runs one call on both
managers and checks the same result or the same exception type, and that kvblock's state
after an error is what vLLM's is (unchanged where vLLM is atomic)."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest

from conftest import require_module

vllm = require_module("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvblock.vllm as kv  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from vllm_oracle import A, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm_oracle import both as _both  # noqa: E402
from vllm_oracle import request as _request  # noqa: E402
from vllm_oracle import state as _state  # noqa: E402

from kvblock import _core  # noqa: E402

#: For the tests of a CPython fast path's own state (rust/src/py/fast/): they skip where
#: KVBLOCK_NO_FAST_PATHS=1 turned the fast paths off.
FAST_PATHS_ONLY = pytest.mark.skipif(not _core.FAST_PATHS, reason="the CPython fast paths are off (KVBLOCK_NO_FAST_PATHS)")


def _mamba(bs: int) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")


def _same(v, k, fv, fk):
    """Run ``fv`` on vLLM and ``fk`` on kvblock: equal results or the same exception type,
    and equal states afterwards. Returns vLLM's result or exception."""
    rv = rk = None
    try:
        rv = fv()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        rv = e
    try:
        rk = fk()
    except Exception as e:  # noqa: BLE001
        rk = e
    if isinstance(rv, Exception) or isinstance(rk, Exception):
        assert type(rv) is type(rk), f"vLLM {rv!r}, kvblock {rk!r}"
    assert _state(v) == _state(k)
    return rv


def test_evict_blocks_past_the_pool_is_an_assertion_error():
    """vLLM asserts a connector's block id is in the pool (kvblock raised ValueError)."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 2, 4, 4)
    before = _state(k)
    err = _same(v, k, lambda: v.evict_blocks({2}), lambda: k.evict_blocks({2}))
    assert isinstance(err, AssertionError)
    assert _state(k) == before
    # valid ids still evict alike
    _same(v, k, lambda: v.evict_blocks({0, 1}), lambda: k.evict_blocks({0, 1}))


@pytest.mark.parametrize(
    "spec",
    [
        SlidingWindowSpec(block_size=1, sliding_window=1, **A),
        ChunkedLocalAttentionSpec(block_size=1, attention_chunk_size=4, **A),
        _mamba(1),
    ],
    ids=["sliding_window", "chunked_local", "mamba_align"],
)
def test_lookup_past_lookahead_hashes_raises_index_error_as_vllm(spec):
    """With hash lookahead a request holds fewer hashes than tokens; vLLM's sliding-window,
    chunked-local and Mamba finders index the hash list up to max_cache_hit_length and raise
    IndexError (kvblock answered a miss)."""
    v, k = _both([spec], 16, 1, 1, num_hash_lookahead_tokens=2)
    rv, rk = (_request("r0", [1, 2, 3, 4, 5, 6, 7, 8], 1, lookahead=2) for _ in range(2))
    assert len(rv.block_hashes) == 6
    if not isinstance(spec, SlidingWindowSpec):
        # the chunked finder walks left to right (it raises only if every block before hits),
        # Mamba looks for cached blocks only
        for m, r in ((v, rv), (k, rk)):
            assert m.allocate_slots(r, 8) is not None
            m.free(r)
        rv, rk = (_request("r1", [1, 2, 3, 4, 5, 6, 7, 8], 1, lookahead=2) for _ in range(2))
    err = _same(v, k, lambda: v.get_computed_blocks(rv), lambda: k.get_computed_blocks(rk))
    assert isinstance(err, IndexError)
    # a limit inside the hashes looks up alike
    res = _same(v, k, lambda: v.get_computed_blocks(rv, 6), lambda: k.get_computed_blocks(rk, 6))
    assert res[1] == _same(v, k, lambda: v.get_computed_blocks(rv, 6), lambda: k.get_computed_blocks(rk, 6))[1]


def test_adopting_into_a_request_with_blocks_returns_none_when_it_does_not_fit():
    """vLLM checks capacity (returning None) before asserting that a request holding blocks
    adopts no computed tokens; kvblock asserted first."""
    v, k = _both([FullAttentionSpec(block_size=1, **A)], 2, 1, 1)
    rv, rk = (_request("r0", list(range(1, 9)), 1) for _ in range(2))
    for r in (rv, rk):
        r.status = RequestStatus.WAITING
    _same(v, k, lambda: v.allocate_slots(rv, 1, delay_cache_blocks=True),
          lambda: k.allocate_slots(rk, 1, delay_cache_blocks=True))
    res = _same(v, k, lambda: v.allocate_slots(rv, 1, num_external_computed_tokens=1),
                lambda: k.allocate_slots(rk, 1, num_external_computed_tokens=1))
    assert res is None


def test_adopting_into_a_request_with_blocks_asserts_when_it_fits():
    """Once the capacity check passes, both assert (kvblock without changing anything)."""
    v, k = _both([FullAttentionSpec(block_size=1, **A)], 8, 1, 1)
    rv, rk = (_request("r0", list(range(1, 9)), 1) for _ in range(2))
    _same(v, k, lambda: v.allocate_slots(rv, 1, delay_cache_blocks=True),
          lambda: k.allocate_slots(rk, 1, delay_cache_blocks=True))
    before = _state(k)
    err = _same(v, k, lambda: v.allocate_slots(rv, 1, num_external_computed_tokens=1),
                lambda: k.allocate_slots(rk, 1, num_external_computed_tokens=1))
    assert isinstance(err, AssertionError)
    assert _state(k) == before


def test_constructor_checks_in_vllms_order():
    """A configuration breaking two rules raises the error vLLM checks first: the retention
    interval (ValueError, in the base coordinator) before the unitary coordinator's
    hash_block_size assertion (kvblock raised the AssertionError)."""
    errors = []
    for cls in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(
            num_blocks=4,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size=2, **A))],
            prefix_cache_retention_interval=2,
        )
        with pytest.raises(Exception) as info:
            cls(cfg, 8, 2, 1, enable_caching=True)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) is ValueError, errors


def test_cross_attention_lookup_with_caching_is_not_implemented_as_vllm():
    """A hybrid configuration with a cross-attention group and caching on: vLLM's
    CrossAttentionManager raises NotImplementedError on a lookup (kvblock: RuntimeError)."""
    specs = [FullAttentionSpec(block_size=1, **A), CrossAttentionSpec(block_size=1, **A)]
    v, k = _both(specs, 4, 1, 1)
    rv, rk = (_request("r0", list(range(1, 9)), 1) for _ in range(2))
    err = _same(v, k, lambda: v.get_computed_blocks(rv), lambda: k.get_computed_blocks(rk))
    assert isinstance(err, NotImplementedError)


def _mamba_spec(spec_blocks: int) -> MambaSpec:
    return MambaSpec(
        block_size=1, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align",
        num_speculative_blocks=spec_blocks,
    )


def test_running_request_with_mamba_hits_gets_vllms_capacity_answer_first():
    """A running request handed Mamba "align" hit blocks: vLLM's Mamba block count does not
    assert (its base rule does), so vLLM answers None when they do not fit; kvblock asserted."""
    v, k = _both([_mamba_spec(0)], 2, 1, 1)
    rv, rk = (_request("r0", list(range(1, 9)), 1) for _ in range(2))
    for m, r in ((v, rv), (k, rk)):
        assert m.allocate_slots(r, 8) is not None
        r.num_computed_tokens = 8
        r.status = RequestStatus.RUNNING
        r.append_output_token_ids([0])
    hv, hk = v.get_computed_blocks(rv), k.get_computed_blocks(rk)
    assert hv[1] == hk[1] > 0
    res = _same(v, k, lambda: v.allocate_slots(rv, 0, 7, hv[0]), lambda: k.allocate_slots(rk, 0, 7, hk[0]))
    assert res is None


def test_hits_for_a_group_that_does_not_track_the_request_get_vllms_capacity_answer():
    """Found by a random lockstep run (full attention and Mamba "align", 2-token blocks,
    1-token hashes). A first 1-token chunk makes the Mamba group cache a partial checkpoint
    and track the request as running; the full-attention group has no full block to cache and
    does not track it. vLLM's block count asserts only in a group that tracks the request, so
    hits handed to the full-attention group get vLLM's capacity answer (None); kvblock took
    the request as running in every group and asserted."""
    v, k = _both([FullAttentionSpec(block_size=2, **A), _mamba(2)], 3, 2, 1, enable_kv_cache_events=True)
    for m in (v, k):
        a = _request("a", [0, 0], 1)
        assert m.allocate_slots(a, 2) is not None
        a.num_computed_tokens = 2
        m.free(a)
    rv, rk = (_request("b", [0, 0], 1) for _ in range(2))
    _same(v, k, lambda: v.allocate_slots(rv, 1), lambda: k.allocate_slots(rk, 1))
    tracked = [[("b" in stm.num_cached_block) for stm in m.coordinator.single_type_managers] for m in (v, k)]
    assert tracked == [[False, True]] * 2
    hv, hk = v.get_computed_blocks(rv), k.get_computed_blocks(rk)
    assert hv[1] == hk[1] == 1 and all(hv[0].blocks)
    res = _same(v, k, lambda: v.allocate_slots(rv, 0, hv[1] + 1, hv[0]),
                lambda: k.allocate_slots(rk, 0, hk[1] + 1, hk[0]))
    assert res is None


def test_caching_stops_at_a_cross_attention_group_with_vllms_value_error():
    """Found by a random lockstep run (Mamba "align" then cross attention, caching and KV
    events on): vLLM caches group by group and its cross-attention group raises ValueError
    when reached. kvblock checked every group's table for the events' IndexError first,
    the cross-attention group's too, and raised IndexError instead."""
    specs = [_mamba(1), CrossAttentionSpec(block_size=1, **A)]
    v, k = _both(specs, 2, 1, 1, enable_kv_cache_events=True)
    rv, rk = (_request("r0", list(range(1, 13)), 1) for _ in range(2))
    errors = []
    for m, r in ((v, rv), (k, rk)):
        with pytest.raises(ValueError, match="prefix caching is disabled") as info:
            m.allocate_slots(r, 7)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    # kvblock changed what vLLM changed before raising: the Mamba group's blocks and cache
    assert _state(v) == _state(k)


def test_refused_external_tokens_leave_no_table():
    """External tokens that need more blocks than are free: vLLM takes a block and leaves it
    in the request's table before raising ValueError; kvblock raises the same error and
    leaves nothing at all (no block taken, no empty table)."""
    v, k = _both([_mamba_spec(1)], 3, 1, 1)
    rv, rk = (_request("r0", list(range(1, 9)), 1) for _ in range(2))
    before = _state(k)
    with pytest.raises(ValueError):
        v.allocate_slots(rv, 1, num_external_computed_tokens=1)
    with pytest.raises(ValueError):
        k.allocate_slots(rk, 1, num_external_computed_tokens=1)
    assert _state(k) == before
    assert k.block_pool.get_num_free_blocks() == 2


def _window_and_two_mambas(num_blocks: int):
    """vLLM's manager and kvblock's over a 1-token sliding-window MLA group and two Mamba
    "align" groups (the first with a block-aligned prefill checkpoint block), 1-token blocks
    and hashes, KV events on, max_model_len 8 (the lockstep's configuration)."""
    groups = [
        SlidingWindowMLASpec(block_size=1, sliding_window=1, **A),
        MambaSpec(block_size=1, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align",
                  num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1),
        _mamba(1),
    ]
    init_none_hash(sha256)
    out = []
    for cls in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], g) for i, g in enumerate(groups)],
            prefix_cache_retention_interval=0,
        )
        out.append(cls(cfg, 8, 1, 1, enable_caching=True, enable_kv_cache_events=True))
    assert type(out[1]) is kv.KVCacheManager
    return out


def test_refused_external_tokens_leave_the_mamba_checkpoint_as_it_was():
    """Found by a random lockstep run. External tokens that need more blocks than are free:
    vLLM's count (which sets the Mamba group's prefill checkpoint) passes, then it raises
    ValueError half way through taking blocks. kvblock refuses before taking any, with the
    same error, but had set the checkpoint while counting: a refusal that changed state. Now
    the checkpoint is put back and the refusal changes nothing."""
    v, k = _window_and_two_mambas(4)
    rv, rk = (_request("r0", list(range(1, 13)), 1) for _ in range(2))
    # a first call that does not fit (None) leaves the request known to the groups, with
    # empty tables
    for m, r in ((v, rv), (k, rk)):
        assert m.allocate_slots(r, 4, num_external_computed_tokens=1, reserved_blocks=100) is None
    before = (_state(k), [k._group_mamba_state(g, "r0") for g in range(3)])
    with pytest.raises(ValueError, match="free blocks"):
        v.allocate_slots(rv, 8, num_external_computed_tokens=8)
    with pytest.raises(ValueError, match="free blocks"):
        k.allocate_slots(rk, 8, num_external_computed_tokens=8)
    assert (_state(k), [k._group_mamba_state(g, "r0") for g in range(3)]) == before
    assert k.block_pool.get_num_free_blocks() == 3


def test_caching_past_the_table_with_a_block_mask_is_vllms_assertion():
    """Found with the case above. Computed tokens past the request's table (external tokens
    beyond what it holds) in a sliding-window group that caches with a block mask: vLLM
    asserts that the mask covers the sliced table, before the KV events' indexing that would
    raise IndexError. kvblock checked for the IndexError first and raised it."""
    v, k = _window_and_two_mambas(6)
    rv, rk = (_request("r0", list(range(1, 13)), 1) for _ in range(2))
    errors = []
    for m, r in ((v, rv), (k, rk)):
        try:
            m.allocate_slots(r, 4, num_external_computed_tokens=8)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            errors.append(type(e))
    assert errors == [AssertionError, AssertionError]


@pytest.mark.parametrize("lookahead", [2, 3])
def test_hybrid_lookup_past_lookahead_hashes_is_index_error(lookahead):
    """Found by a random lockstep run: sliding window (1-token blocks), sliding window
    (2-token blocks) and Mamba, hashed at 1 token with lookahead. vLLM's hybrid lookup reads
    the hash list past its end and raises IndexError; kvblock raised ValueError there. Reading
    past a request's block_hashes is now IndexError everywhere."""
    specs = [SlidingWindowSpec(block_size=1, sliding_window=1, **A), SlidingWindowSpec(block_size=2, sliding_window=3, **A),
             _mamba(2)]
    v, k = _both(specs, 64, 2, 1, num_hash_lookahead_tokens=lookahead)
    rv, rk = (_request("r", list(range(1, 17)), 1, lookahead=lookahead) for _ in range(2))
    before = _state(k)
    err = _same(v, k, lambda: v.get_computed_blocks(rv), lambda: k.get_computed_blocks(rk))
    assert isinstance(err, IndexError)
    assert _state(k) == before


def _decode_ready(m, r):
    """Admit ``r`` (6 tokens: two 4-token blocks), compute its prompt, sample one token, and
    make the no-op decode call that puts it in kvblock's request-object slot cache."""
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    r.append_output_token_ids(100)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=0) is m.empty_kv_cache_blocks


@pytest.mark.parametrize("forget", ["coordinator_free", "reset_then_free"])
def test_request_forgotten_by_id_is_not_answered_from_a_reused_slot(forget):
    """kvblock answers a running request's no-op ``allocate_slots`` / ``cache_blocks`` from
    the request object's address (``py/slot_cache.rs``). A request the manager forgot by id
    (the coordinator's ``free(request_id)``), whose slot a new request then took, must get
    vLLM's answer for an unknown request, not the new request's no-op."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)
    rv, rk = (_request("r", list(range(1, 7)), 4) for _ in range(2))
    for m, r in ((v, rv), (k, rk)):
        _decode_ready(m, r)
        if forget == "coordinator_free":
            m.coordinator.free("r")
        else:
            m.free(r)
            m.reset_prefix_cache()
            m.coordinator.free("r")  # nothing left: a no-op on both
    assert _state(v) == _state(k)
    xv, xk = (_request("x", list(range(50, 58)), 4) for _ in range(2))
    for m, x in ((v, xv), (k, xk)):
        assert m.allocate_slots(x, 8) is not None  # takes the vacant slot in kvblock
    res = _same(v, k, lambda: v.allocate_slots(rv, 1), lambda: k.allocate_slots(rk, 1))
    assert res is not None and res is not v.empty_kv_cache_blocks  # an unknown request gets blocks
    _same(v, k, lambda: v.cache_blocks(rv, 7), lambda: k.cache_blocks(rk, 7))


def test_request_given_an_equal_id_string_gets_vllms_answers():
    """kvblock's full ``allocate_slots`` path uses the slot its slot cache found for the
    request object only while the request's ``request_id`` is the string object the entry was
    made with; an equal id in another string object (vLLM keys by value) is looked up by its
    text again. Through the decode steps that fill and start blocks, both managers give the
    same answers and end each step in the same state."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)
    rv, rk = (_request("req-1", list(range(1, 7)), 4) for _ in range(2))
    for m, r in ((v, rv), (k, rk)):
        _decode_ready(m, r)
        fresh = "".join(["req", "-1"])
        assert fresh == r.request_id and fresh is not r.request_id
        r.request_id = fresh
    for step in range(8):
        _same(v, k, lambda: v.allocate_slots(rv, 1, num_lookahead_tokens=0),
              lambda: k.allocate_slots(rk, 1, num_lookahead_tokens=0))
        for r in (rv, rk):
            r.num_computed_tokens += 1
            r.append_output_token_ids(100 + step)
        _same(v, k, lambda: v.cache_blocks(rv, rv.num_computed_tokens),
              lambda: k.cache_blocks(rk, rk.num_computed_tokens))
    assert [b.block_id for b in k.coordinator.single_type_managers[0].req_to_blocks["req-1"]] == \
        [b.block_id for b in v.coordinator.single_type_managers[0].req_to_blocks["req-1"]]
    assert len(k.coordinator.single_type_managers[0].req_to_blocks["req-1"]) == 4


def test_request_renamed_before_a_block_boundary_call_gets_vllms_answer():
    """A call that leaves the no-op check (here one that fills a block) uses the slot found
    for the request object only if its ``request_id`` is still the string object the entry
    was made with: a request renamed to another id (vLLM keys by the id it reads, so it sees
    a new request) gets vLLM's answer for that id, and both managers end in the same state."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)
    rv, rk = (_request("req-1", list(range(1, 7)), 4) for _ in range(2))
    for m, r in ((v, rv), (k, rk)):
        _decode_ready(m, r)
        r.num_computed_tokens += 1
        r.append_output_token_ids(101)  # 7 computed of 8 tokens: the next call fills block 1
        r.request_id = "req-2"
    res = _same(v, k, lambda: v.allocate_slots(rv, 1, num_lookahead_tokens=0),
                lambda: k.allocate_slots(rk, 1, num_lookahead_tokens=0))
    assert res is not None and res.get_block_ids() != ([],)  # a new request's blocks
    assert set(k.coordinator.single_type_managers[0].req_to_blocks) == {"req-1", "req-2"}


def test_dead_request_address_taken_by_another_request_is_not_answered_from_the_cache():
    """kvblock knows a request in its slot cache by its address and ``request_id`` object. When
    a request object dies while the manager still holds its blocks (its id is still live), and another
    request object, with another id, takes its address, the newcomer must get vLLM's answer for
    an unknown request (new blocks), not the dead request's no-op; and the dead request's id
    keeps its blocks. Run in a child process with C malloc (``vllm_address_reuse.py``), which
    places the newcomer at the dead request's address on its first try (its docstring says how)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "vllm_address_reuse.py"
    env = dict(os.environ, PYTHONMALLOC="malloc")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    last = out.stdout.strip().splitlines()[-1:] or [out.stderr[-2000:]]
    assert out.returncode == 0, last[0]
    assert last[0].startswith("reused ")


@FAST_PATHS_ONLY
def test_slot_cache_releases_freed_requests_and_stays_bounded():
    """The slot cache keeps no request object alive (it holds the request's id string),
    freeing a request through its object drops its entry, and requests
    forgotten by id stay in a table of fixed size (4,096 entries), so no entry is kept
    without bound."""
    import sys

    _, k = _both([FullAttentionSpec(block_size=4, **A)], 8192, 4, 4)
    reqs = [_request(f"r{i}", [i + 1] * 6, 4) for i in range(8)]
    base = sys.getrefcount(reqs[0])
    for r in reqs:
        _decode_ready(k, r)
    held = sys.getrefcount(reqs[0])  # outside the asserts: pytest's rewriting holds values
    assert k._slot_cache_len() == 8
    assert held == base
    k.free(reqs[0])
    assert k._slot_cache_len() == 7
    for r in reqs[1:]:
        k.free(r)
    assert k._slot_cache_len() == 0
    live = []
    for i in range(5000):
        r = _request(f"f{i}", [i + 1] * 6, 4)
        _decode_ready(k, r)
        k.coordinator.free(r.request_id)  # forgotten by id: the cache cannot drop it then
        live.append(r)  # kept alive: their addresses stay distinct
    assert 0 < k._slot_cache_len() <= 4096
    assert k.block_pool.get_num_free_blocks() == 8191


class _IdWatchedRequest(Request):
    """A vLLM ``Request`` that counts its ``request_id`` reads (``id_reads``): a call
    answered from the slot cache reads it once (the cache's identity check)."""

    @property
    def request_id(self):
        self.id_reads += 1
        return self._rid

    @request_id.setter
    def request_id(self, v):
        self.id_reads = 0
        self._rid = v


class _RefSubclass(weakref.ref):
    pass


def _other_weak_references(r) -> list:
    """Weak references of every kind CPython keeps in ``r``'s weak-reference list besides
    the basic one: with a callback, a proxy, a ``weakref.ref`` subclass, a
    ``WeakValueDictionary`` entry."""
    return [weakref.ref(r, lambda _: None), weakref.proxy(r), _RefSubclass(r),
            weakref.WeakValueDictionary({"r": r})]


@FAST_PATHS_ONLY
@pytest.mark.parametrize("when", ["before", "after"])
def test_slot_cache_knows_a_request_that_has_other_weak_references(when):
    """Weak references to a request (with a callback, a proxy, a ``weakref.ref`` subclass, a
    ``WeakValueDictionary`` entry), made before or after kvblock first sees it, change nothing:
    step by step the request reads its id exactly as often as a twin request with none (once a
    step: the slot cache's identity check, whose read the full path reuses), and all three managers
    (the fast entry with and without other references, the PyO3 method) give the same answers
    and end each step in the same state."""
    runs = []
    for m, with_others in ((_small_manager(), True), (_small_manager(), False), (_small_manager(), False)):
        r = _IdWatchedRequest("r", list(range(1, 7)), SamplingParams(max_tokens=64), None,
                              block_hasher=get_request_block_hasher(4, sha256, 0))
        others = _other_weak_references(r) if with_others and when == "before" else []
        _decode_ready(m, r)
        if with_others and when == "after":
            others = _other_weak_references(r)
        runs.append((m, r, others))
    (k, rk, others), (c, rc, _), (v, rv, _) = runs
    assert len(others) == 4 and weakref.getweakrefcount(rk) >= 4
    reads = []
    for step in range(8):
        rk.id_reads = rc.id_reads = 0
        a = k.allocate_slots(rk, 1, num_lookahead_tokens=0)
        a_control = c.allocate_slots(rc, 1, num_lookahead_tokens=0)
        b = _CORE.allocate_slots(v, rv, 1, num_lookahead_tokens=0)
        assert rk.id_reads == rc.id_reads, f"step {step}: other weak references changed the id reads"
        reads.append(rk.id_reads)
        answers = [(x is None, x is m.empty_kv_cache_blocks, None if x is None else x.get_block_ids())
                   for x, m in ((a, k), (a_control, c), (b, v))]
        assert answers[0] == answers[1] == answers[2]
        for m, r in ((k, rk), (c, rc), (v, rv)):
            r.num_computed_tokens += 1
            r.append_output_token_ids(100 + step)
            m.cache_blocks(r, r.num_computed_tokens - 1)
        assert _state(k) == _state(c) == _state(v)
    # of the 8 decode steps (7 to 14 tokens, 4-token blocks), the 4 that neither fill a block
    # (8, 12: it is cached) nor start one (9, 13: it is allocated) are answered from the cache;
    # the others take the full path, which uses the id the cache's check read: once a step
    assert reads == [1] * 8
    assert k._slot_cache_len() == 1


@pytest.mark.parametrize("new_id", ["other", "equal_text"])
def test_request_renamed_after_a_no_op_call_gets_vllms_answers(new_id):
    """A request renamed after kvblock answered a no-op call from its slot cache (found by a
    fresh user: the slot cache then knew the request by a weak reference and went on answering
    the old id's no-op, leaving the new id with no blocks). vLLM keys by the id it reads, so
    another id is a new request that gets blocks, and an equal id in another string object is
    the same request; kvblock's slot cache compares the id object on every hit, so both
    managers give the same answers and states on every step after the rename."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)
    rv, rk = (_request("req-a", list(range(1, 7)), 4) for _ in range(2))
    for m, r in ((v, rv), (k, rk)):
        _decode_ready(m, r)  # ends with a no-op allocate_slots: r is in kvblock's slot cache
        fresh = "req-b" if new_id == "other" else "".join(["req", "-a"])
        assert fresh is not r.request_id
        r.request_id = fresh
    for step in range(6):
        res = _same(v, k, lambda: v.allocate_slots(rv, 1, num_lookahead_tokens=0),
                    lambda: k.allocate_slots(rk, 1, num_lookahead_tokens=0))
        if step == 0:
            renamed = new_id == "other"
            assert res is not None and (res.get_block_ids() != ([],)) == renamed
        for r in (rv, rk):
            r.num_computed_tokens += 1
            r.append_output_token_ids(100 + step)
        _same(v, k, lambda: v.cache_blocks(rv, rv.num_computed_tokens),
              lambda: k.cache_blocks(rk, rk.num_computed_tokens))
    held = set(k.coordinator.single_type_managers[0].req_to_blocks)
    assert held == ({"req-a", "req-b"} if new_id == "other" else {"req-a"})


def test_partial_mamba_hit_queues_the_same_copy_on_write_copy():
    """A request that hits mid-way into a Mamba block (hash blocks of 16 tokens, Mamba blocks
    of 544, vLLM's partial hash hits) gets a private copy of the shared Mamba state: both
    managers queue the same copy and retain the same blocks until ``take_kv_cache_block_copies``
    hands them over, then free them alike. (The randomized lockstep reaches this only in a
    few of thousands of examples.)"""
    init_none_hash(sha256)
    specs = [FullAttentionSpec(block_size=16, **A), replace(_mamba(16), block_size=544)]
    managers = []
    for cls in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(
            num_blocks=200,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        )
        managers.append(cls(cfg, 8192, 544, 16, enable_caching=True, num_hash_lookahead_tokens=1))
    v, k = managers
    assert type(k) is kv.KVCacheManager
    tokens = list(range(1249))
    for m in (v, k):
        first = _request("first", tokens, 16, lookahead=1)
        assert m.allocate_slots(first, 1248) is not None
        first.num_computed_tokens = 1248
        m.new_step_starts()
        assert m.allocate_slots(first, 1) is not None
        first.num_computed_tokens = 1249
        m.new_step_starts()
        m.free(first)
    assert _state(v) == _state(k)
    sv, sk = (_request("second", tokens, 16, lookahead=1) for _ in range(2))
    (bv, nv, _), (bk, nk, _) = v.get_computed_blocks(sv), k.get_computed_blocks(sk)
    assert nv == nk == 1248
    _same(v, k, lambda: v.allocate_slots(sv, 1, nv, bv), lambda: k.allocate_slots(sk, 1, nk, bk))
    cv, ck = v.take_kv_cache_block_copies(), k.take_kv_cache_block_copies()
    assert cv[0], "no copy-on-write copy was queued"
    assert [tuple(c) for c in cv[0]] == [tuple(c) for c in ck[0]]
    assert [type(c) for c in ck[0]] == [type(c) for c in cv[0]]
    assert [b.block_id for b in cv[1]] == [b.block_id for b in ck[1]]
    _same(v, k, lambda: v.block_pool.free_blocks(cv[1]), lambda: k.block_pool.free_blocks(ck[1]))
    assert v.take_kv_cache_block_copies() == k.take_kv_cache_block_copies() == ([], [])


# -- the fast entries (rust/src/py/fast_entry.rs) ------------------------------------------------
# kvblock.vllm's manager class answers allocate_slots / cache_blocks through fastcall entries
# that take vLLM's decode-step call shapes without PyO3's argument matching and hand every other
# call to KVCacheManagerCore's own method. Every shape must get exactly the method's answer.

_CORE = kv.KVCacheManager.__mro__[1]  # kvblock._core.KVCacheManagerCore


def _small_manager():
    """A kvblock manager of 32 four-token blocks, one full-attention group."""
    init_none_hash(sha256)
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size=4, **A))])
    return kv.KVCacheManager(cfg, 64, 4, 4, enable_caching=True)


def _twins():
    """Two kvblock managers in the same state, each with a decode-ready request "r" (in its
    slot cache) and a waiting request "w"."""
    out = []
    for _ in range(2):
        m = _small_manager()
        r = _request("r", list(range(1, 7)), 4)
        _decode_ready(m, r)
        out.append((m, r, _request("w", list(range(30, 39)), 4)))
    return out


def _answer(f):
    try:
        res = f()
    except Exception as e:  # noqa: BLE001 - type and message are compared
        return ("raised", type(e), str(e))
    if res is None or isinstance(res, (int, float, bool)):
        return ("value", res)
    return ("blocks", res.get_block_ids())


class _Int(int):
    pass


_KW = "".join(["num_", "lookahead_tokens"])  # a keyword name that is not the interned one
ALLOCATE_SHAPES = {
    "decode": ((1,), {"num_lookahead_tokens": 0}),
    "positional only": ((1,), {}),
    "lookahead past the table": ((1,), {"num_lookahead_tokens": 3}),
    "crosses a block boundary": ((3,), {}),
    "runtime keyword name": ((1,), {_KW: 0}),
    "zero new tokens": ((0,), {}),
    "negative": ((-1,), {}),
    "bool": ((True,), {}),
    "int subclass": ((_Int(1),), {}),
    "float": ((1.0,), {}),
    "str": (("1",), {}),
    "huge": ((2**70,), {}),
    "negative lookahead": ((1,), {"num_lookahead_tokens": -1}),
    "bool lookahead": ((1,), {"num_lookahead_tokens": True}),
    "unknown keyword": ((1,), {"lookahead": 0}),
    "two keywords": ((1,), {"num_lookahead_tokens": 0, "delay_cache_blocks": True}),
    "keyword num_new_tokens": ((), {"num_new_tokens": 1}),
    "duplicate num_new_tokens": ((1,), {"num_new_tokens": 1}),
    "three positional": ((1, 0), {}),
    "missing num_new_tokens": ((), {}),
}


_COUNTS = {"allocate_slots": ("num_new_tokens", "num_new_computed_tokens", None, "num_lookahead_tokens",
                                "num_external_computed_tokens", None, "num_encoder_tokens", None,
                                "reserved_blocks"),
           "cache_blocks": ("num_computed_tokens",)}


def _as_vllm_reads(name, args, kwargs):
    """The arguments as vLLM's method body uses them: a bool passed as a count is the int 0 or
    1 (``True + 3 == 4``). The fast entry takes them so; the core method is kvblock's strict API
    and refuses a bool count."""
    counts = _COUNTS[name]
    take = lambda k, v: int(v) if isinstance(v, bool) and k in counts else v  # noqa: E731
    named = [counts[i] if i < len(counts) else None for i in range(len(args))]
    return (tuple(take(k, v) for k, v in zip(named, args)),
            {k: take(k, v) for k, v in kwargs.items()})


def _entry_matches_method(name, args, kwargs, who, prepare=None):
    """Call ``name`` through the fast entry on one twin and, on the other, KVCacheManagerCore's
    method on the same arguments as vLLM's body reads them (see ``_as_vllm_reads``): the same
    answer (blocks, value, or exception type and message) and the same state after. Returns the
    twin the entry was called on, and its request."""
    (m1, r1, w1), (m2, r2, w2) = _twins()
    if prepare:
        prepare(r1)
        prepare(r2)
    req1, req2 = (r1, r2) if who == "r" else (w1, w2)
    ref_args, ref_kwargs = _as_vllm_reads(name, args, kwargs)
    ref = _answer(lambda: getattr(_CORE, name)(m1, req1, *ref_args, **ref_kwargs))
    got = _answer(lambda: getattr(m2, name)(req2, *args, **kwargs))
    assert got == ref
    assert _state(m1) == _state(m2)
    return m2, req2


@pytest.mark.parametrize("who", ["r", "w"])
@pytest.mark.parametrize("shape", list(ALLOCATE_SHAPES))
def test_allocate_slots_fast_entry_answers_every_call_shape_as_the_method(shape, who):
    args, kwargs = ALLOCATE_SHAPES[shape]
    m, req = _entry_matches_method("allocate_slots", args, kwargs, who)
    if shape == "decode" and who == "r":
        assert m.allocate_slots(req, *args, **kwargs) is m.empty_kv_cache_blocks


CACHE_SHAPES = {
    "no newly full block": ((7,), {}),
    "a newly full block": ((8,), {}),
    "keyword": ((), {"num_computed_tokens": 7}),
    "negative": ((-1,), {}),
    "bool": ((True,), {}),
    "float": ((7.0,), {}),
    "huge": ((2**70,), {}),
    "three positional": ((7, 1), {}),
    "missing": ((), {}),
}


def _eight_tokens(r):
    r.append_output_token_ids(101)  # 8 tokens: the second block can become full
    r.num_computed_tokens = 7


@pytest.mark.parametrize("who", ["r", "w"])
@pytest.mark.parametrize("shape", list(CACHE_SHAPES))
def test_cache_blocks_fast_entry_answers_every_call_shape_as_the_method(shape, who):
    args, kwargs = CACHE_SHAPES[shape]
    _entry_matches_method("cache_blocks", args, kwargs, who, _eight_tokens)


class _SubManager(kv.KVCacheManager):
    """A subclass of kvblock's vLLM manager: another type behind the same fast entries."""


def test_fast_entries_take_each_manager_type_and_refuse_other_selves():
    """The fast entries check ``self`` once per type (they keep the first manager type seen and
    skip the MRO walk for it): a manager of another type (a subclass, called after the first
    type is kept) gets the same answers and state, and an object that is no manager is
    CPython's ``TypeError`` for a method descriptor, with nothing run."""
    (m1, r1, w1), _ = _twins()
    assert m1.allocate_slots(r1, 1, num_lookahead_tokens=0) is m1.empty_kv_cache_blocks  # type kept
    init_none_hash(sha256)
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size=4, **A))])
    sub = _SubManager(cfg, 64, 4, 4, enable_caching=True)
    assert type(sub) is _SubManager
    r2 = _request("r", list(range(1, 7)), 4)
    _decode_ready(sub, r2)
    for m, r in ((m1, r1), (sub, r2)):
        assert m.allocate_slots(r, 1, num_lookahead_tokens=0) is m.empty_kv_cache_blocks
        assert m.cache_blocks(r, 7) is None
    assert _state(m1) == _state(sub)
    # across a block boundary both append the same block ids
    r1.append_output_token_ids(101)
    r2.append_output_token_ids(101)
    r1.num_computed_tokens = r2.num_computed_tokens = 7
    assert _answer(lambda: m1.allocate_slots(r1, 1)) == _answer(lambda: sub.allocate_slots(r2, 1))
    assert _state(m1) == _state(sub)
    before = _state(m1)
    for name, args in (("allocate_slots", (r1, 1)), ("cache_blocks", (r1, 7))):
        with pytest.raises(TypeError, match="KVCacheManagerCore"):
            getattr(kv.KVCacheManager, name)(object(), *args)
    assert _state(m1) == before


class _WatchedRequest(Request):
    """A vLLM ``Request`` whose ``num_computed_tokens`` reads are counted and can run a hook
    (raise, or call the manager again) while a manager call reads them."""

    hook = None
    reads = 0

    @property
    def num_computed_tokens(self):
        type(self).reads += 1
        if type(self).hook is not None:
            type(self).hook(self)
        return self._nct

    @num_computed_tokens.setter
    def num_computed_tokens(self, v):
        self._nct = v


def _watched(m):
    r = _WatchedRequest("r", list(range(1, 7)), SamplingParams(max_tokens=64), None,
                        block_hasher=get_request_block_hasher(4, sha256, 0))
    _decode_ready(m, r)
    return r


def _raise_once(r):
    _WatchedRequest.hook = None
    raise KeyError("transient")


@pytest.mark.parametrize("new_tokens", [1, 3])  # a no-op decode step, and one crossing a block boundary
@pytest.mark.parametrize("hook", ["raises", "calls the manager again", "none"])
def test_fast_entry_reads_the_request_as_often_as_the_method_and_raises_what_it_raises(hook, new_tokens):
    """What runs while a request is read (a property that raises, or that calls the manager
    back) sees the fast entry do exactly what the method does: the same number of reads, the
    same exception (a re-entrant call is refused with the manager's RuntimeError), the same
    state after."""
    seen = []
    for via in ("method", "entry"):
        m = _small_manager()
        r = _watched(m)
        call = (lambda *a, **k: _CORE.allocate_slots(m, *a, **k)) if via == "method" else m.allocate_slots
        again = (lambda q: _CORE.cache_blocks(m, q, 4)) if via == "method" else (lambda q: m.cache_blocks(q, 4))

        def reenter(q, again=again):
            _WatchedRequest.hook = None
            again(q)

        _WatchedRequest.reads = 0
        _WatchedRequest.hook = {"raises": _raise_once, "calls the manager again": reenter, "none": None}[hook]
        try:
            got = _answer(lambda: call(r, new_tokens, num_lookahead_tokens=0))
        finally:
            _WatchedRequest.hook = None
        seen.append((got, _WatchedRequest.reads, _state(m)))
    assert seen[0] == seen[1]
    if hook == "raises":
        assert seen[1][0][:2] == ("raised", KeyError)
    if hook == "calls the manager again":
        assert seen[1][0][:2] == ("raised", RuntimeError) and "already borrowed" in seen[1][0][2]


@pytest.mark.parametrize("hook", ["raises", "calls the manager again"])
def test_cache_blocks_fast_entry_raises_what_the_method_raises_while_reading_the_request(hook):
    """The same for ``cache_blocks`` at a newly full block, where the request is read."""
    seen = []
    for via in ("method", "entry"):
        m = _small_manager()
        r = _watched(m)
        r.append_output_token_ids(101)
        r.num_computed_tokens = 7
        call = (lambda *a: _CORE.cache_blocks(m, *a)) if via == "method" else m.cache_blocks
        again = (lambda q: _CORE.allocate_slots(m, q, 1)) if via == "method" else (lambda q: m.allocate_slots(q, 1))

        def reenter(q, again=again):
            _WatchedRequest.hook = None
            again(q)

        _WatchedRequest.reads = 0
        _WatchedRequest.hook = _raise_once if hook == "raises" else reenter
        try:
            got = _answer(lambda: call(r, 8))
        finally:
            _WatchedRequest.hook = None
        seen.append((got, _WatchedRequest.reads, _state(m)))
    assert seen[0] == seen[1]
    assert seen[1][0][0] == "raised"


def test_fast_entries_keep_the_methods_signature_and_docstring():
    import inspect

    from kvblock import _core

    for name in ("allocate_slots", "cache_blocks"):
        entry, method = getattr(kv.KVCacheManager, name), getattr(_CORE, name)
        assert entry is not method
        assert inspect.signature(entry) == inspect.signature(method)
        assert entry.__doc__ == method.__doc__
    with pytest.raises(ValueError, match="no fast entry"):
        _core._fast_entry("free")


def test_refused_adoption_of_a_partial_hybrid_hit_leaves_no_table():
    """Issue 32: full attention (block size 2) + Mamba "align" (block size 1), hash block size 1.
    A connector lookup's hit adopted with one token more than it covers puts the partial tail
    block where vLLM's copy-on-write does not find it: vLLM asserts after adopting the hit and
    taking blocks (its state is past comparing); kvblock raises the same AssertionError and
    changes nothing (it left an empty Mamba table behind)."""
    init_none_hash(sha256)
    specs = [FullAttentionSpec(block_size=2, **A), _mamba(1)]
    out = []
    for cls in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])
        out.append(cls(cfg, 8, 2, 1, enable_caching=True, enable_kv_cache_events=True))
    v, k = out
    reqs = []
    for m in (v, k):
        r0 = _request("r0", list(range(1, 9)), 1)
        assert m.allocate_slots(r0, 8) is not None
        r0.num_computed_tokens = 8
        m.free(r0)
        r1 = _request("r1", list(range(1, 9)), 1)
        blocks, hit, *_ = m.get_computed_blocks_for_connector(r1)
        assert hit == 6
        reqs.append((r1, blocks, hit))
    assert v.take_events() == k.take_events()
    before = _state(k)
    errors = []
    for m, (r1, blocks, hit) in zip((v, k), reqs):
        with pytest.raises(AssertionError) as e:
            m.allocate_slots(r1, 0, num_new_computed_tokens=hit + 1, new_computed_blocks=blocks)
        errors.append(e.value)
    assert _state(k) == before
    assert all("r1" not in stm.req_to_blocks for stm in k.coordinator.single_type_managers)
    assert k.take_events() == []


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("events", [False, True])
def test_decode_steps_across_block_boundaries_take_vllms_blocks_until_the_pool_runs_out(groups, lookahead, events):
    """kvblock answers a running request's block-boundary ``allocate_slots`` (every group full
    attention) that only appends blocks (slots past its tables, nothing newly full to cache)
    or only caches a newly full block past the full path's other reads and checks
    (``boundary_at`` in ``py/manager/state.rs``).
    Two requests decode side by side in a pool that cached a finished request's blocks (skipping
    the caching after every third step, so that some calls have a full block to cache): every call returns
    vLLM's blocks (evicting the cached ones in vLLM's order) and leaves vLLM's
    state, up to and past the step where the pool runs out (None, nothing changed). The
    boundary path answers calls of both kinds with the fast paths on and KV events off (only
    appending ones without lookahead, where a block fills in the call that needs the next),
    and no call with events on (the full path makes their events)."""
    specs = [FullAttentionSpec(block_size=4, **A) for _ in range(groups)]
    v, k = _both(specs, 1 + 12 * groups, 4, 4, enable_kv_cache_events=events)
    done_v, done_k = (_request("done", list(range(200, 212)), 4) for _ in range(2))
    for m, r in ((v, done_v), (k, done_k)):  # a finished request leaves 3 cached blocks behind
        assert m.allocate_slots(r, 12) is not None
        m.free(r)
    pairs = [tuple(_request(rid, list(range(1 + 10 * i, 6 + 10 * i)), 4) for _ in range(2)) for i, rid in
             enumerate(("a", "b"))]
    for rv, rk in pairs:
        _same(v, k, lambda: v.allocate_slots(rv, 5), lambda: k.allocate_slots(rk, 5))
        for r in (rv, rk):
            r.num_computed_tokens = 5
    refused = 0
    for step in range(40):
        for rv, rk in pairs:
            out = {}
            got = _same(v, k, lambda: out.setdefault("v", v.allocate_slots(rv, 1, num_lookahead_tokens=lookahead)),
                        lambda: out.setdefault("k", k.allocate_slots(rk, 1, num_lookahead_tokens=lookahead)))
            assert not isinstance(got, Exception)
            assert (out["k"] is None) == (got is None)
            if got is None:
                refused += 1
                continue
            assert out["k"].get_block_ids() == got.get_block_ids(), f"step {step}: other new blocks"
            for r in (rv, rk):
                r.num_computed_tokens += 1
                r.append_output_token_ids(300 + step)
            if step % 3 != 2:  # else the next call caches the block that filled
                _same(v, k, lambda: v.cache_blocks(rv, rv.num_computed_tokens),
                      lambda: k.cache_blocks(rk, rk.num_computed_tokens))
    assert refused > 0  # the pool ran out
    if events:
        assert v.take_events() == k.take_events()
    grew, cached = _CORE._boundary_calls(k)
    if _core.FAST_PATHS and not events:
        # with lookahead the slots run a block ahead, so a block fills in a call that takes none
        assert grew > 0 and (cached > 0) == (lookahead > 0)
    else:
        assert (grew, cached) == (0, 0)
