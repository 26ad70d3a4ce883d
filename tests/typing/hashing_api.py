"""Hashing and the block pool's id API with the types mypy --strict must infer (checked by
scripts/typecheck.py; also run by tests/test_typing_snippets.py)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

import kvblock
from kvblock import BlockPool, hashing
from kvblock.hashing import BlockHash, HashFunction

fn = hashing.get_hash_fn_by_name("sha256_cbor")
assert_type(fn, HashFunction)
hashing.init_none_hash(fn)
assert_type(fn((b"parent", (1, 2, 3), None)), bytes)
hashes = kvblock.hash_blocks(np.arange(64, dtype=np.int64), 16, algo="sha256_cbor")
assert_type(hashes, list[BlockHash])
one = kvblock.hash_block_tokens(fn, None, [1, 2, 3, 4])
assert_type(one, BlockHash)
hasher = kvblock.get_request_block_hasher(16, fn)
req = kvblock.Request("r", list(range(40)), block_hasher=hasher, cache_salt="salt",
                      lora_request=kvblock.LoRARequest("adapter", 1, "/adapters/a"))
assert_type(hashing.hash_requests([req]), int)
assert_type(hashing.maybe_convert_block_hash(hashes[0]), int | bytes)

pool = BlockPool(num_gpu_blocks=128, enable_caching=True, hash_block_size=16)
ids = pool.allocate_ids(4)
assert_type(ids, npt.NDArray[np.int32])
pool.cache_ids(ids, list(hashes), 0, 4)
hit = pool.lookup_prefix(list(hashes))
assert_type(hit, npt.NDArray[np.int32])
pool.touch_ids(hit)
pool.free_ids(ids, reverse=True)
pool.free_ids(hit)
blocks = pool.get_new_blocks(2)
assert_type(blocks, list[kvblock.KVCacheBlock])
assert_type(blocks[0].block_id, int)
pool.free_blocks(blocks)
assert_type(pool.get_num_free_blocks(), int)
