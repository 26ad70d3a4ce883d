"""``kvblock.vllm.hisparse``: the HiSparse views vLLM's ``get_hisparse_coordinator``, connector
and tests read, on kvblock's manager (``KVBLOCK_VLLM_HISPARSE=1``). vLLM's own HiSparse tests
drive them (``tests/test_vllm_hisparse_judged.py``); here: the binding, and bad input to the
host pool view (vLLM's exception, nothing changed)."""

from __future__ import annotations

import pytest

from conftest import require_module

require_module("vllm")

hisparse = pytest.importorskip("vllm.v1.hisparse.coordinator")

from test_vllm_hisparse_manager import BS, _config  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as st  # noqa: E402

from kvblock.vllm.hisparse import HostBlockPool  # noqa: E402
from kvblock.vllm.manager import KVCacheManager  # noqa: E402


@pytest.fixture
def manager(monkeypatch):
    monkeypatch.setenv("KVBLOCK_VLLM_HISPARSE", "1")
    return KVCacheManager(_config(32, 16), max_model_len=128, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True)


def test_get_hisparse_coordinator_returns_kvblock_s_view(manager):
    c = hisparse.get_hisparse_coordinator(manager)
    assert isinstance(c, hisparse.HiSparseCoordinator)
    assert c is hisparse.get_hisparse_coordinator(manager)
    assert isinstance(c.host_manager, st.HiSparseSourceManager)
    assert isinstance(c.host_manager.block_pool, HostBlockPool)
    assert c.host_manager.block_pool.medium == "CPU"
    assert [type(m).__name__ for m in c.resident_managers] == ["HiSparseResidentManager"]
    assert [type(m).__name__ for m in c.hot_managers] == ["HiSparseHotManager"]
    assert c.gpu_pool is manager.block_pool
    assert c.build_offload_command().page_transfers == []
    assert not c.has_pending_work()


def test_host_pool_bad_input_changes_nothing(manager):
    pool = hisparse.get_hisparse_coordinator(manager).get_host_block_pool()
    free = pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == free - 2
    with pytest.raises(ValueError):
        pool.get_new_blocks(free)
    with pytest.raises(AssertionError):
        pool.evict_blocks([blocks[0].block_id, pool.num_gpu_blocks])
    with pytest.raises(TypeError):
        pool.free_blocks([object()])
    pool.free_blocks(blocks)
    with pytest.raises(ValueError):
        pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == free
    assert [b.ref_cnt for b in blocks] == [0, 0]


def test_import_step_tokens_is_fixed_by_the_first_lookup_as_vllm_s(manager):
    from kvblock.vllm.hisparse import RELEASE

    if not RELEASE.hisparse_import_reservations:
        c = hisparse.get_hisparse_coordinator(manager)
        assert not hasattr(c, "import_step_tokens")
        with pytest.raises(ValueError):
            manager._hisparse_set_import_step_tokens(5)
        return
    # vLLM 0.34's connector passes its import step to the first lookup, which builds the
    # coordinator with it; a later lookup with another value is refused, as vLLM's
    c = hisparse.get_hisparse_coordinator(manager, import_step_tokens=5)
    assert c.import_step_tokens == 5
    assert hisparse.get_hisparse_coordinator(manager, import_step_tokens=None) is c
    with pytest.raises(AssertionError):
        hisparse.get_hisparse_coordinator(manager, import_step_tokens=7)
    assert c.import_step_tokens == 5


def test_reuse_watchers_show_the_residency_s_watchers(manager):
    pool = manager.block_pool
    assert pool._reuse_watchers == {}
    blocks = pool.get_new_blocks(2)
    seen = []
    pool.unpin_blocks(blocks, seen.append)
    watchers = pool._reuse_watchers
    assert list(watchers) == [b.block_id for b in blocks]
    assert all(cb is seen.append or cb == seen.append for cb in watchers.values())
    # reusing a watched block fires its watcher once and drops it, as vLLM's pool does
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert sorted(b.block_id for b in seen) == sorted(b.block_id for b in blocks)
    assert pool._reuse_watchers == {}

def test_host_copy_on_write_reaches_the_connector_and_is_released(manager):
    # vLLM's HiSparseSourceManager: a partial hit on a host block is copied into a private
    # host block; the copy goes to the connector (take_host_block_copies), not to the
    # worker's device copies, and both endpoints stay held until the worker ran it
    c = hisparse.get_hisparse_coordinator(manager)
    source = c.host_manager
    pool = source.block_pool
    free = pool.get_num_free_blocks()
    src = pool.get_new_blocks(1)[0]
    source.req_to_blocks["cow"] = [src]
    source._partial_hit_reqs["cow"] = (0, src)
    (cow,) = source.allocate_new_blocks("cow", BS, BS)
    assert cow.pool is pool and cow is pool.blocks[cow.block_id]
    assert manager.take_new_block_ids() == []
    assert manager.take_kv_cache_block_copies() == ([], [])
    assert source.take_pending_cow_copies() == []
    assert not c.has_pending_work()
    copies = c.take_host_block_copies()
    assert copies == (hisparse.KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=cow.block_id),)
    assert c.take_host_block_copies() == ()
    assert c.has_pending_work()
    source.free("cow")
    assert (src.ref_cnt, cow.ref_cnt) == (1, 1)
    with pytest.raises(TypeError):
        c.release_completed_host_copies(["not an id"])
    assert c.has_pending_work() and pool.get_num_free_blocks() == free - 2
    c.release_completed_host_copies([src.block_id])  # not a destination: nothing
    assert pool.get_num_free_blocks() == free - 2
    c.release_completed_host_copies([cow.block_id])
    assert pool.get_num_free_blocks() == free
    assert not c.has_pending_work()


def test_pop_blocks_for_free_routes_host_blocks_to_the_host_pool(manager):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    c = hisparse.get_hisparse_coordinator(manager)
    host = c.get_host_block_pool()
    host_free, device_free = host.get_num_free_blocks(), manager.block_pool.get_num_free_blocks()
    req = Request("r", list(range(2 * BS)), SamplingParams(max_tokens=1), None)
    assert manager.allocate_slots(req, 2 * BS) is not None
    source = manager.get_blocks("r").blocks[c.host_group_id]
    assert [b.pool for b in source] == [host, host]
    with pytest.raises(AttributeError):
        manager.pop_blocks_for_free(object())  # not a request: nothing popped
    assert manager.get_blocks("r").blocks[c.host_group_id] == source
    blocks = manager.pop_blocks_for_free(req)
    assert [b for b in blocks if b.pool is host] == source
    assert host.get_num_free_blocks() < host_free
    manager.block_pool.free_blocks(reversed(blocks))
    assert host.get_num_free_blocks() == host_free
    assert manager.block_pool.get_num_free_blocks() == device_free


def test_hot_group_require_hot_is_the_residency_s(manager):
    c = hisparse.get_hisparse_coordinator(manager)
    (hot,) = c.hot_managers
    hot.require_hot("r")
    assert hot.hot_required == {"r"}
    with pytest.raises(ValueError):
        manager._hisparse_require_hot(5, "q")
    assert hot.hot_required == {"r"}
