"""The KV cache manager's public API as a scheduler uses it, with the types mypy --strict
must infer (checked by scripts/typecheck.py; also run by tests/test_typing_snippets.py)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

from kvblock import BlockPool, KVCacheBlocks, KVCacheManager, PrefixCacheStats, Request, RequestStatus
from kvblock.events import KVCacheEvent
from kvblock.hashing import BlockHash

mgr = KVCacheManager(num_blocks=64, block_size=4, hash_algo="sha256", max_model_len=128, log_stats=True,
                     enable_kv_cache_events=True)
assert_type(mgr.request_block_hasher, Callable[[Any], list[BlockHash]])
assert_type(mgr.block_pool, BlockPool)
req = Request("req-0", list(range(10)), block_hasher=mgr.request_block_hasher)
assert_type(req.block_hashes, list[bytes])
assert_type(req.num_tokens, int)

blocks, num_hit, _ = mgr.get_computed_blocks(req)
assert_type(blocks, KVCacheBlocks)
assert_type(num_hit, int)
new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
assert_type(new, KVCacheBlocks | None)
assert new is not None
ids = new.get_block_ids()
assert_type(ids, tuple[list[int], ...] | None)
mgr.record_prefix_cache_stats(req, num_hit)
req.num_computed_tokens = req.num_tokens
req.status = RequestStatus.RUNNING
req.append_output_token_ids(7)
req.append_output_token_ids([8, 9])
decode = mgr.allocate_slots(req, 1, num_lookahead_tokens=0)
assert_type(decode, KVCacheBlocks | None)
table: tuple[list[int], ...] = mgr.get_block_ids(req.request_id)
mgr.free(req)

stats = mgr.make_prefix_cache_stats()
assert_type(stats, PrefixCacheStats | None)
assert stats is not None
assert_type(stats.hit_rate, float)
events = mgr.take_events()
assert_type(events, list[KVCacheEvent])
assert_type(mgr.usage, float)
assert_type(mgr.reset_prefix_cache(), bool)

# the batch step API
waiting = [Request(f"b{i}", list(range(i, i + 9)), block_hasher=mgr.request_block_hasher) for i in range(3)]
n, hit_tokens, num_new_blocks, hit_ids, new_ids = mgr.admit_batch(waiting)
assert_type(n, int)
assert_type(hit_tokens, npt.NDArray[np.int32])
counts, flat = mgr.allocate_slots_batch(waiting[:n])
assert_type(counts, npt.NDArray[np.int32])
for r in waiting:
    mgr.free(r)
