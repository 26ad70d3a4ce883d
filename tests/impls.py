"""The KV cache manager implementations the parametrised tests run against.

Each entry is a namespace with the implementation's ``KVCacheManager``, ``KVCacheBlocks``,
``BlockPool`` and the hashing module whose ``NONE_HASH`` its request hasher reads. Add the
Rust-backed implementation here to run every ``impl`` test against it too.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvblock import block_pool as kv_block_pool
from kvblock import hashing as kv_hashing
from kvblock import manager as kv_manager
from kvblock.reference import block_pool as ref_block_pool
from kvblock.reference import hashing as ref_hashing
from kvblock.reference import manager as ref_manager

IMPLS = {
    "reference": SimpleNamespace(
        name="reference",
        KVCacheManager=ref_manager.KVCacheManager,
        KVCacheBlocks=ref_manager.KVCacheBlocks,
        BlockPool=ref_block_pool.BlockPool,
        hashing=ref_hashing,
    ),
    "kvblock": SimpleNamespace(
        name="kvblock",
        KVCacheManager=kv_manager.KVCacheManager,
        KVCacheBlocks=kv_manager.KVCacheBlocks,
        BlockPool=kv_block_pool.BlockPool,
        hashing=kv_hashing,
    ),
}
