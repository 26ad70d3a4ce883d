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
