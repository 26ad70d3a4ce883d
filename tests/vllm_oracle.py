"""The installed vLLM's own ``KVCacheManager`` and kvblock's side by side, for tests that use vLLM
as the oracle: the same configuration, vLLM requests, and the state both expose."""

from __future__ import annotations

import pytest

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as vku
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

import kvblock.vllm as kv
from kvblock.vllm.manager import VllmKVCacheManager
from kvblock.vllm.originals import original

# vLLM's own hashing, also when kvblock.vllm.patch() has swapped kvblock's in
get_request_block_hasher = original(vku, "get_request_block_hasher")
init_none_hash = original(vku, "init_none_hash")

A = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)


def both(specs, num_blocks: int, block_size: int, hash_block_size: int, **kw):
    """vLLM's own manager and kvblock's, on the same configuration (one group per spec). A
    case that needs a hash lookahead is skipped on a release without one (0.32)."""
    from kvblock.vllm.releases import current

    if not current().hash_lookahead and kw.pop("num_hash_lookahead_tokens", 0):
        pytest.skip(f"vLLM {current().series} has no hash lookahead")
    init_none_hash(sha256)
    out = []
    for cls in (VllmKVCacheManager, kv.KVCacheManager):
        cfg = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        )
        out.append(cls(cfg, 64, block_size, hash_block_size, enable_caching=True, **kw))
    assert type(out[1]) is kv.KVCacheManager
    return out


def request(rid: str, tokens: list[int], hash_block_size: int, lookahead: int = 0) -> Request:
    """A vLLM ``Request`` hashed by vLLM's own block hasher (sha256)."""
    # vLLM 0.32's hasher has no lookahead parameter
    hasher = get_request_block_hasher(hash_block_size, sha256, lookahead) if lookahead else get_request_block_hasher(
        hash_block_size, sha256
    )
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), None, block_hasher=hasher)


def state(m) -> tuple:
    """Everything a manager's state shows: block tables and cached-block counts per group, the
    free queue in order, and every block's reference count and hash."""
    pool = m.block_pool
    return (
        [{r: [b.block_id for b in bl] for r, bl in stm.req_to_blocks.items()} for stm in m.coordinator.single_type_managers],
        [dict(stm.num_cached_block) for stm in m.coordinator.single_type_managers],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
    )
