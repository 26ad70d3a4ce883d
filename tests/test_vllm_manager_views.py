"""The per-type manager state vLLM's code reads through ``coordinator.single_type_managers``
(issue 33): the Mamba manager's prefill checkpoints (``_checkpoints``), its pending
copy-on-write copies, the partial tail (``_partial_hit_reqs``, ``_producer_partial_tail_reqs``),
a group's own ``cache_blocks``, and each group's manager class (vLLM finds the cross-attention
manager with ``isinstance``). kvblock shows them as views of its Rust state; each case runs the
same calls on vLLM's own unpatched manager and compares what the two show."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import require_module

vllm = require_module("vllm")

import torch  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

import kvblock.vllm as kv  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402
from kvblock.vllm.releases import current  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from vllm_oracle import A, init_none_hash  # noqa: E402
from vllm_oracle import both as _both  # noqa: E402
from vllm_oracle import request as _request  # noqa: E402
from vllm_oracle import state as _state  # noqa: E402


def _mamba(bs: int) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")


def _ids(pairs):
    return [tuple(b if isinstance(b, int) else b.block_id for b in p) for p in pairs]


def _per_type(m) -> list:
    """What vLLM's code reads from each group's manager besides its tables."""
    out = []
    for stm in m.coordinator.single_type_managers:
        row = {
            "class": type(stm).__name__,
            "partial_hit": {r: (i, b.block_id) for r, (i, b) in stm._partial_hit_reqs.items()},
            "pending_cow": _ids(stm._pending_cow_copies),
        }
        if getattr(stm, "mamba_cache_mode", None) == "align":
            row.update(
                checkpoints=dict(stm._checkpoints),
                producer_tail={r: (b.block_id, n) for r, (b, n) in stm._producer_partial_tail_reqs.items()},
                last_state_block_idx=dict(stm.last_state_block_idx),
                retired=dict(stm._num_retired_blocks),
                allocated=set(stm._allocated_block_reqs),
                offloads=[(r, g, b.block_id, t) for r, g, b, t in stm._pending_boundary_state_offloads],
            )
        out.append(row)
    return out


def _partial_hit_pair():
    """vLLM's manager and kvblock's with a full-attention group of 16-token blocks and a Mamba
    group of 544, hashed every 16 tokens (vLLM's partial hash hits), a first request of 1249
    tokens computed and freed: a second request with the same tokens hits 1248 of them,
    mid-way into a Mamba block."""
    if not current().hash_lookahead:
        pytest.skip(f"vLLM {current().series} has no hash lookahead")
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
        assert _per_type(m)[1]["allocated"] == {"first"}
        first.num_computed_tokens = 1248
        m.new_step_starts()
        assert m.allocate_slots(first, 1) is not None
        first.num_computed_tokens = 1249
        m.new_step_starts()
        m.free(first)
    assert _state(v) == _state(k) and _per_type(v) == _per_type(k)
    return v, k, tokens


def test_partial_mamba_hit_state_reads_as_vllms():
    """The partial hit's pending copy, checkpoints and tails read the same through
    kvblock's views as through vLLM's own manager, at every step, and draining one group's
    copies (``take_pending_cow_copies``) drains them from the manager too."""
    v, k, tokens = _partial_hit_pair()
    sv, sk = (_request("second", tokens, 16, lookahead=1) for _ in range(2))
    (bv, nv, _), (bk, nk, _) = v.get_computed_blocks(sv), k.get_computed_blocks(sk)
    assert nv == nk == 1248
    assert v.allocate_slots(sv, 1, nv, bv) is not None and k.allocate_slots(sk, 1, nk, bk) is not None
    pv, pk = _per_type(v), _per_type(k)
    assert pv == pk
    assert pv[1]["pending_cow"], "no copy-on-write copy was queued"
    # one group's drain: the same pairs, and nothing left for the manager's take
    tv = v.coordinator.single_type_managers[1].take_pending_cow_copies()
    tk = k.coordinator.single_type_managers[1].take_pending_cow_copies()
    assert _ids(tv) == _ids(tk) == pv[1]["pending_cow"]
    assert all(type(b).__name__ == "KVCacheBlock" for pair in tk for b in pair)
    assert v.take_kv_cache_block_copies() == k.take_kv_cache_block_copies() == ([], [])
    assert _per_type(v) == _per_type(k) and _state(v) == _state(k)
    # the views are live: the next step's state reads through the same objects
    views = k.coordinator.single_type_managers[1]
    checkpoints, tails = views._checkpoints, views._producer_partial_tail_reqs
    for m, r in ((v, sv), (k, sk)):
        r.num_computed_tokens = 1249
        m.new_step_starts()
        m.free(r)
    assert _per_type(v) == _per_type(k)
    vm = v.coordinator.single_type_managers[1]
    assert dict(checkpoints) == dict(vm._checkpoints)
    assert {r: (b.block_id, n) for r, (b, n) in tails.items()} == {
        r: (b.block_id, n) for r, (b, n) in vm._producer_partial_tail_reqs.items()
    }


def test_boundary_state_offloads_drain_per_group_as_vllms():
    """``take_pending_boundary_state_offloads`` of the Mamba group returns vLLM's hand-offs
    and leaves none for the manager's ``take_boundary_state_offloads``."""
    v, k, tokens = _partial_hit_pair()
    rv, rk = (_request("third", tokens[:1100] + [7] * 149, 16, lookahead=1) for _ in range(2))
    (bv, nv, _), (bk, nk, _) = v.get_computed_blocks(rv), k.get_computed_blocks(rk)
    assert nv == nk
    assert v.allocate_slots(rv, 1249 - nv, nv, bv) is not None and k.allocate_slots(rk, 1249 - nk, nk, bk) is not None
    assert _per_type(v) == _per_type(k)
    ov = v.coordinator.single_type_managers[1].take_pending_boundary_state_offloads()
    ok = k.coordinator.single_type_managers[1].take_pending_boundary_state_offloads()
    assert [(r, g, b.block_id, t) for r, g, b, t in ov] == [(r, g, b.block_id, t) for r, g, b, t in ok]
    assert v.take_boundary_state_offloads() == k.take_boundary_state_offloads() == {}


def test_cross_attention_manager_is_found_by_class():
    """vLLM's coordinator and engine look a group's manager up by class: kvblock's views are
    instances of vLLM's own manager classes, and only of the group's."""
    cross = CrossAttentionSpec(block_size=16, **A)
    for m in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["self"], FullAttentionSpec(block_size=16, **A)),
                KVCacheGroupSpec(["cross"], cross),
            ],
        )
        mgr = m(cfg, 64, 16, 16, enable_caching=False)
        full, xattn = mgr.coordinator.single_type_managers
        assert isinstance(xattn, CrossAttentionManager) and not isinstance(full, CrossAttentionManager)
        assert isinstance(full, FullAttentionManager) and not isinstance(xattn, MambaManager)
        found = [i for i, s in enumerate(mgr.coordinator.single_type_managers) if isinstance(s, CrossAttentionManager)]
        assert found == [1]
        assert type(xattn).__name__ == "CrossAttentionManager"


def test_group_cache_blocks_caches_as_vllms():
    """A group's own ``cache_blocks(request, num_tokens, replay_boundaries=...)`` caches that
    group's blocks only, as vLLM's per-type manager does."""
    sw = FullAttentionSpec(block_size=8, **A)
    v, k = _both([FullAttentionSpec(block_size=4, **A), sw], 64, 8, 4)
    for m in (v, k):
        r = _request("r", list(range(30)), 4)
        assert m.allocate_slots(r, 30, delay_cache_blocks=True) is not None
        stm = m.coordinator.single_type_managers[1]
        stm.cache_blocks(r, 24, replay_boundaries=(24,))
        assert dict(stm.num_cached_block) == {"r": 3}
        assert dict(m.coordinator.single_type_managers[0].num_cached_block).get("r", 0) == 0
    assert _state(v) == _state(k)


def test_partial_hit_entry_written_by_hand_is_copied_as_vllms():
    """vLLM's tests (and connectors) set ``_partial_hit_reqs[request_id] = (index, block)``
    on a group's manager: the next allocation replaces that block by a private copy and
    queues the copy, on kvblock's views as on vLLM's manager."""
    v, k = _both([FullAttentionSpec(block_size=16, **A)], 32, 16, 16)
    for m in (v, k):
        stm = m.coordinator.single_type_managers[0]
        source = m.block_pool.get_new_blocks(1)[0]
        stm.req_to_blocks["cow"] = [source]
        stm._partial_hit_reqs["cow"] = (0, source)
        assert "cow" in stm._partial_hit_reqs and stm._partial_hit_reqs["cow"][1].block_id == source.block_id
        stm.allocate_new_blocks("cow", 16, 16)
    assert _per_type(v) == _per_type(k) and _state(v) == _state(k)
    assert _per_type(k)[0]["pending_cow"], "no copy queued"


def test_views_refuse_bad_writes_and_change_nothing():
    """The read-only views raise TypeError on a write; a partial-hit entry naming a block
    outside the pool or an out-of-range group is a ValueError; nothing changes."""
    _, k = _both([FullAttentionSpec(block_size=16, **A)], 32, 16, 16)
    stm = k.coordinator.single_type_managers[0]
    before = (_state(k), _per_type(k))
    with pytest.raises(ValueError):
        stm._partial_hit_reqs["x"] = (0, 10**6)
    with pytest.raises(KeyError):
        del stm._partial_hit_reqs["absent"]
    with pytest.raises(ValueError):
        k._group_cache_blocks(5, _request("r", list(range(20)), 16), 16)
    with pytest.raises(ValueError):
        k._group_set_partial_hit(5, "x", None)
    assert (_state(k), _per_type(k)) == before
    if current().hash_lookahead:
        _, km, _ = _partial_hit_pair()
        mamba = km.coordinator.single_type_managers[1]
        with pytest.raises(TypeError):
            mamba._checkpoints["x"] = (0, 0)
        with pytest.raises(TypeError):
            mamba._producer_partial_tail_reqs["x"] = (None, 0)


def test_release_rules_bad_input_is_refused_before_anything_is_built():
    """The release rules ``kvblock.vllm`` hands the Rust core (``Release.core_rules()``): an
    unknown rule is a ValueError naming it, a rule that is not a bool a TypeError; the 0.32
    rule lets a Mamba group in mode "none" cache, which 0.33's refuses (with vLLM's
    ``AssertionError``: the core raises vLLM's types for vLLM's callers)."""
    from kvblock import _core

    groups = [{"kind": "full_attention", "block_size": 4},
              {"kind": "mamba", "block_size": 4, "mamba_cache_mode": "none"}]

    def build(rules):
        return _core.KVCacheManagerCore(_core.BlockPoolCore(10, True, 4), groups, 100, 4, 4, release_rules=rules)

    with pytest.raises(ValueError, match="unknown rule"):
        build({"mamba_caches_everything": True})
    with pytest.raises(TypeError, match="expected bool"):
        build({"mamba_none_mode_caches": 1})
    with pytest.raises(AssertionError, match="requires mamba_cache_mode='align'"):
        build({})  # vLLM's caller dialect (the default): vLLM's own assert, raised by the core
    assert build({"mamba_none_mode_caches": True}).block_pool.get_num_free_blocks() == 9
    assert set(current().core_rules()) == {
        "eagle_groups_drop_always", "mamba_none_mode_caches", "partial_tail_rekeyed", "eagle_junction_block_retained",
        "hisparse_trim_null_head"}


def test_group_allocation_past_the_pool_changes_nothing():
    """A group's ``allocate_new_blocks`` for more blocks than are free raises vLLM's error
    and leaves the pool (free count, every block's ref count) and the tables as they were,
    with no entry left for the request (vLLM's ``defaultdict`` keeps an empty one)."""
    v, k = _both([FullAttentionSpec(block_size=16, **A)], 32, 16, 16)
    errors = []
    for m in (v, k):
        stm = m.coordinator.single_type_managers[0]
        free = m.block_pool.get_num_free_blocks()
        refs = [b.ref_cnt for b in m.block_pool.blocks]
        before = (_state(m), _per_type(m))
        with pytest.raises(ValueError) as e:
            stm.allocate_new_blocks("big", 16 * 100, 16 * 100)
        errors.append(str(e.value))
        assert m.block_pool.get_num_free_blocks() == free
        assert [b.ref_cnt for b in m.block_pool.blocks] == refs
        if m is k:
            assert (_state(k), _per_type(k)) == before and "big" not in stm.req_to_blocks
    assert errors[0] == errors[1]
