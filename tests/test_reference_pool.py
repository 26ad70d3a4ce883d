"""Block pool and manager scenarios: the worked examples of spec §4.1, our own versions of
the vLLM test scenarios listed in spec §10 that apply to one full-attention group (plus the
sliding-window parent-hash case), the free-queue / map / block data structures, and bad input.

Expected values are derived by hand from the spec's rules; the manager-level tests run
against every implementation in ``tests/impls.py``, the data-structure and bad-input tests
against the pure-Python reference.
"""

from __future__ import annotations

import pytest

from apc_helpers import ids
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblock.hashing import block_hash_to_event_int, make_block_hash_with_group_id
from kvblock.extra_keys import generate_block_hash_extra_keys
from kvblock.reference.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from kvblock.reference.manager import KVCacheBlocks, KVCacheManager
from kvblock.request import LoRARequest, Request, RequestStatus, SamplingParams
from kvblock.stats import PrefixCacheStats

COMMON = [i for i in range(3) for _ in range(16)]  # three full 16-token blocks


def event_ints(hashes) -> list[int]:
    return [block_hash_to_event_int(h) for h in hashes]


def keyed(r, i: int) -> bytes:
    """The cache key of block ``i`` of ``r`` in group 0."""
    return make_block_hash_with_group_id(r.block_hashes[i], 0)


# -- spec §4.1 worked examples --------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_prefill(apc, algo):
    h = apc(11, 16, hash_algo=algo)
    req0 = h.req(COMMON + [3] * 7)
    assert h.admit(req0) == ([], [1, 2, 3, 4])
    for i in range(3):
        assert h.block(i + 1).block_hash == keyed(req0, i)
    assert h.block(4).block_hash is None

    req1 = h.req(COMMON + [5] * 5)
    hit, n, _ = h.lookup(req1)
    assert (hit, n) == ([1, 2, 3], 48)
    assert h.admit(req1) == ([1, 2, 3], [5])
    assert [h.block(i).ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]

    h.free(req0)
    h.free(req1)
    assert h.queue() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert h.free_count() == 10
    assert h.admit(h.req([99] * 160)) == ([], [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    assert h.free_count() == 0 and h.mgr.usage == 1.0


def test_free_order_second_example(apc):
    h = apc(11, 16)
    req0 = h.req([7] * 87)
    assert h.admit(req0)[1] == [1, 2, 3, 4, 5, 6]
    req1 = h.req([8] * 48)
    assert h.admit(req1)[1] == [7, 8, 9]
    assert h.queue() == [10]
    h.free(req0)
    assert h.queue() == [6, 10, 5, 4, 3, 2, 1]
    h.free(req1)
    assert h.queue() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]


# -- allocation, hits and free order ----------------------------------------------------------------


def test_decode(apc):
    h = apc(11, 16)
    req0 = h.req(COMMON + [3] * 7)
    h.admit(req0)
    for _ in range(4):
        req0.append_output_token_ids(8)
    assert ids(h.mgr.allocate_slots(req0, 4)) == []
    assert h.block(4).block_hash is None

    req0.num_computed_tokens = 59
    for _ in range(9 + 10):  # 9 fill block 4, 10 go to a new block
        req0.append_output_token_ids(7)
    assert ids(h.mgr.allocate_slots(req0, 19)) == [5]
    assert h.block(4).block_hash == keyed(req0, 3)
    assert h.block(5).block_hash is None
    assert h.map_size() == 4


def test_evict(apc):
    h = apc(11, 16)
    req0 = h.req([i // 16 for i in range(87)])
    assert h.admit(req0)[1] == [1, 2, 3, 4, 5, 6]
    req1 = h.req([100 + i for i in range(55)])
    assert h.admit(req1)[1] == [7, 8, 9, 10]
    h.free(req0)
    assert h.queue() == [6, 5, 4, 3, 2, 1]
    h.free(req1)
    assert h.queue() == [10, 6, 5, 4, 3, 2, 1, 9, 8, 7]

    req2 = h.req([i // 16 for i in range(32)] + [200, 201, 202])
    assert h.admit(req2) == ([1, 2], [10])
    assert h.queue() == [6, 5, 4, 3, 9, 8, 7]
    assert h.free_count() == 7


def test_hash_block_correct_reuse(apc):
    h = apc(2, 16)
    req0 = h.req(list(range(16)))
    assert h.admit(req0)[1] == [1]
    assert h.block(1).block_hash == keyed(req0, 0)
    h.free(req0)
    req1 = h.req(list(range(100, 115)))
    assert h.admit(req1)[1] == [1]
    assert h.block(1).block_hash is None
    assert h.map_size() == 0


def test_computed_blocks_not_evicted(apc):
    h = apc(3, 16)
    req0 = h.req(list(range(16)))
    assert h.admit(req0)[1] == [1]
    req1 = h.req(list(range(16, 32)))
    assert h.admit(req1)[1] == [2]
    h.free(req0)
    h.free(req1)
    assert h.queue() == [1, 2]
    req2 = h.req(list(range(16)) + list(range(40, 56)))
    assert h.admit(req2) == ([1], [2])
    assert h.table(req2) == [1, 2]
    assert h.block(1).block_hash == keyed(req0, 0)


def test_basic_prefix_caching_disabled(apc):
    h = apc(10, 4, enable_caching=False)
    req1 = h.req(list(range(10)))
    assert h.admit(req1) == ([], [1, 2, 3])
    h.free(req1)
    assert h.queue() == [3, 2, 1, 4, 5, 6, 7, 8, 9]
    req2 = h.req(list(range(10)))
    assert h.lookup(req2)[:2] == ([], 0)
    assert h.admit(req2)[1] == [3, 2, 1]
    req3 = h.req(list(range(24)))
    assert h.admit(req3)[1] == [4, 5, 6, 7, 8, 9]
    assert h.map_size() == 0
    assert all(b.block_hash is None for b in h.pool.blocks)
    assert h.mgr.allocate_slots(h.req([1]), 1) is None
    assert h.mgr.make_prefix_cache_stats() == PrefixCacheStats()


def test_prefill_not_enough_free_blocks_with_computed_blocks(apc):
    h = apc(11, 16)
    req0 = h.req(COMMON + [3] * 7)
    assert h.admit(req0)[1] == [1, 2, 3, 4]
    assert h.admit(h.req([50] * 80))[1] == [5, 6, 7, 8, 9]
    req1 = h.req(COMMON + [4] * 20)
    hit, n, blocks = h.lookup(req1)
    assert (hit, n) == ([1, 2, 3], 48)
    assert h.mgr.allocate_slots(req1, 20, 48, blocks) is None
    assert [h.block(i).ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert h.table(req1) == [] and h.free_count() == 1

    h.free(req0)
    assert h.queue() == [4, 10, 3, 2, 1]
    _, _, blocks = h.lookup(req1)
    assert ids(h.mgr.allocate_slots(req1, 20, 48, blocks)) == [4, 10]
    assert [h.block(i).ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert h.table(req1) == [1, 2, 3, 4, 10]


def test_prefill_plp(apc):
    h = apc(11, 16)
    plp = SamplingParams(prompt_logprobs=1)
    req0 = h.req(COMMON + [3] * 7, sampling_params=plp)
    assert h.lookup(req0)[:2] == ([], 0)
    assert h.admit(req0) == ([], [1, 2, 3, 4])
    assert h.map_size() == 3

    req1 = h.req(COMMON + [5] * 5)
    assert h.admit(req1) == ([1, 2, 3], [5])

    req2 = h.req(COMMON + [3] * 7, sampling_params=plp)
    assert h.admit(req2) == ([], [6, 7, 8, 9])
    assert h.map_size() == 3  # duplicates share the keys
    for i, (first, dup) in enumerate(((1, 6), (2, 7), (3, 8))):
        assert h.block(dup).block_hash == h.block(first).block_hash == keyed(req2, i)
        assert h.pool.cached_block_hash_to_block.contain(keyed(req2, i), dup)
        assert h.pool.get_cached_block(req2.block_hashes[i], [0])[0].block_id == first
    stats = h.mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 53, 48)


# -- caching and the hash -> block map ------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_cache_blocks(apc, impl, algo):
    h = apc(5, 4, hash_algo=algo)
    pool = impl.BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=4)
    req = h.req(list(range(14)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 2
    assert [b.block_hash for b in blocks] == [keyed(req, 0), keyed(req, 1), None]
    pool.cache_full_blocks(req, blocks, 2, 3, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 3
    assert blocks[2].block_hash == keyed(req, 2)
    pool.cache_full_blocks(req, blocks, 3, 3, 4, 0)  # nothing new: a no-op
    assert len(pool.cached_block_hash_to_block) == 3


def test_block_lookup_cache_single_block_per_key():
    cache = BlockHashToBlockMap()
    k0, k1, k2 = b"k0\0\0\0\0", b"k1\0\0\0\0", b"k2\0\0\0\0"
    b0, b1 = KVCacheBlock(0), KVCacheBlock(1)
    cache.insert(k0, b0)
    cache.insert(k1, b1)
    assert len(cache) == 2
    assert cache.get_one_block(k0) is b0 and cache.get_one_block(k1) is b1
    assert cache.get_one_block(k2) is None
    assert cache.contain(k0, 0) and not cache.contain(k0, 1) and not cache.contain(k2, 0)
    assert cache.pop(k0, 0) is b0
    assert cache.get_one_block(k0) is None and len(cache) == 1
    assert cache.pop(k1, 99) is None  # another block id: the block stays
    assert cache.get_one_block(k1) is b1
    assert cache.pop(k2, 0) is None
    assert list(cache.items()) == [(k1, b1)]


def test_block_lookup_cache_multi_blocks_per_key():
    cache = BlockHashToBlockMap()
    k0, k1 = b"k0\0\0\0\0", b"k1\0\0\0\0"
    b0, b1, b2 = KVCacheBlock(0), KVCacheBlock(1), KVCacheBlock(2)
    cache.insert(k0, b0)
    cache.insert(k0, b1)
    cache.insert(k1, b2)
    assert len(cache) == 2
    assert cache.get_one_block(k0) is b0  # first inserted wins
    assert cache.contain(k0, 0) and cache.contain(k0, 1)
    assert list(cache.items()) == [(k0, b0), (k0, b1), (k1, b2)]
    assert cache.pop(k0, 7) is None and cache.get_one_block(k0) is b0
    assert cache.pop(k0, 0) is b0
    assert cache.get_one_block(k0) is b1
    assert cache.pop(k0, 1) is b1
    assert cache.get_one_block(k0) is None and len(cache) == 1


def test_maybe_evict_cached_block():
    pool = BlockPool(6, True, 4, enable_kv_cache_events=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    k0, k1, k2 = (make_block_hash_with_group_id(bytes([i]) * 32, 0) for i in range(3))
    for block, key in ((b1, k0), (b2, k1), (b3, k1), (b4, k2)):
        block.block_hash = key
        pool.cached_block_hash_to_block.insert(key, block)
    assert len(pool.cached_block_hash_to_block) == 3

    pool.evict_blocks({1})
    assert b1.block_hash is None and len(pool.cached_block_hash_to_block) == 2
    pool.evict_blocks({2})
    assert pool.cached_block_hash_to_block.get_one_block(k1) is b3
    pool.evict_blocks({3})
    assert pool.cached_block_hash_to_block.get_one_block(k1) is None
    pool.evict_blocks({4, 5})  # 5 is not cached: ignored
    assert len(pool.cached_block_hash_to_block) == 0
    assert [b.ref_cnt for b in (b1, b2, b3, b4)] == [1, 1, 1, 1]
    assert pool.get_num_free_blocks() == 1
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[block_hash_to_event_int(bytes([i]) * 32)], medium="GPU", group_idx=0)
        for i in (0, 1, 1, 2)
    ]


def test_reset_prefix_cache(apc):
    h = apc(11, 16, enable_kv_cache_events=True)
    req0 = h.req(COMMON + [3] * 7)
    h.admit(req0)
    req1 = h.req(COMMON + [4] * 7)
    assert h.admit(req1) == ([1, 2, 3], [5])
    h.mgr.take_events()
    assert h.mgr.reset_prefix_cache() is False
    assert h.map_size() == 3 and h.mgr.take_events() == []
    h.free(req0)
    h.free(req1)
    queue = h.queue()
    assert h.mgr.reset_prefix_cache() is True
    assert h.map_size() == 0
    assert all(b.block_hash is None for b in h.pool.blocks)
    assert h.queue() == queue
    assert h.mgr.take_events() == [AllBlocksCleared()]
    assert h.mgr.make_prefix_cache_stats().reset is True


# -- extra keys ----------------------------------------------------------------------------------


def _expected_chain(impl, algo, tokens, extra_keys, block_size=16):
    fn = impl.hashing.get_hash_fn_by_name(algo)
    parent, out = None, []
    for i, extra in enumerate(extra_keys):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = impl.hashing.hash_block_tokens(fn, parent, block, extra)
        out.append(parent)
    return out


def test_mm_prefix_caching(apc, impl):
    h = apc(11, 16)
    tokens = COMMON + [3] * 7
    mm = [("aaa", 11, 10), ("bbb", 30, 18)]
    req0 = h.req(tokens, mm_features=mm)
    keys = [
        (("mm", "aaa", 11),),
        (("mm", "aaa", -5), ("mm", "bbb", 14)),
        (("mm", "bbb", -2),),
    ]
    assert [generate_block_hash_extra_keys(req0, 16 * i, 16 * i + 16, 0)[0] for i in range(3)] == keys
    assert req0.block_hashes == _expected_chain(impl, "sha256", tokens, keys)
    assert h.admit(req0) == ([], [1, 2, 3, 4])

    req0.append_output_token_ids([8] * 5)
    assert len(req0.block_hashes) == 3
    req0.append_output_token_ids([8] * 4)
    assert len(req0.block_hashes) == 4
    assert req0.block_hashes == _expected_chain(impl, "sha256", req0.all_token_ids, keys + [None])

    req1 = h.req(tokens, mm_features=mm)
    assert h.lookup(req1)[:2] == ([1, 2, 3], 48)
    assert h.lookup(h.req(tokens, mm_features=[("aaa", 11, 10), ("ccc", 30, 18)]))[:2] == ([1], 16)


def test_cache_key_salting(apc, impl):
    h = apc(11, 16)
    tokens = COMMON + [3] * 7
    req0 = h.req(tokens, cache_salt="salt1")
    keys = [(("cache_salt", "salt1"),), None, None]
    assert [generate_block_hash_extra_keys(req0, 16 * i, 16 * i + 16, 0)[0] for i in range(3)] == keys
    assert req0.block_hashes == _expected_chain(impl, "sha256", tokens, keys)
    h.admit(req0)
    req0.append_output_token_ids([9] * 9)
    assert req0.block_hashes == _expected_chain(impl, "sha256", req0.all_token_ids, keys + [None])

    assert h.lookup(h.req(tokens, cache_salt="salt1"))[:2] == ([1, 2, 3], 48)
    assert h.lookup(h.req(tokens, cache_salt="salt2"))[:2] == ([], 0)
    assert h.lookup(h.req(tokens))[:2] == ([], 0)


# -- stats -----------------------------------------------------------------------------------------


def test_prefix_cache_stats_disabled(apc):
    h = apc(11, 16, log_stats=False)
    assert h.mgr.prefix_cache_stats is None
    req = h.req(COMMON + [1])
    h.admit(req)
    h.mgr.record_prefix_cache_stats(req, 0)
    h.free(req)
    assert h.mgr.reset_prefix_cache() is True
    assert h.mgr.prefix_cache_stats is None
    assert h.mgr.make_prefix_cache_stats() is None


def test_prefix_cache_stats_record():
    stats = PrefixCacheStats()
    stats.record(num_tokens=100, num_hits=60, preempted=False)
    stats.record(num_tokens=50, num_hits=0, preempted=False)
    stats.record(num_tokens=30, num_hits=30, preempted=True)
    assert (stats.requests, stats.queries, stats.hits) == (2, 150, 60)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 30, 30)
    assert stats.hit_rate == 0.4 and PrefixCacheStats().hit_rate == 0.0
    for bad in ((-1, 0), (1, -1), (1, 2)):
        with pytest.raises(ValueError):
            stats.record(*bad, preempted=False)
    assert stats.requests == 2


# -- KV events -----------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
@pytest.mark.parametrize("lora", [None, LoRARequest("adapter", 42, "/adapters/a")])
def test_kv_cache_events(apc, blocks_to_cache, lora):
    h = apc(blocks_to_cache + 1, 16, enable_kv_cache_events=True)
    tokens = list(range(16 * blocks_to_cache))
    req0 = h.req(tokens, lora_request=lora)
    h.admit(req0)
    lora_keys = ("adapter",) if lora else None
    stored = BlockStored(
        block_hashes=event_ints(req0.block_hashes),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        lora_id=42 if lora else None,
        medium="GPU",
        lora_name="adapter" if lora else None,
        extra_keys=[lora_keys] * blocks_to_cache,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert h.mgr.take_events() == [stored]

    h.free(req0)
    req1 = h.req([t + 1000 for t in tokens])
    h.admit(req1)
    events = h.mgr.take_events()
    assert events[:-1] == [
        BlockRemoved(block_hashes=[x], medium="GPU", group_idx=0)
        for x in reversed(event_ints(req0.block_hashes))
    ]
    assert isinstance(events[-1], BlockStored)
    assert events[-1].block_hashes == event_ints(req1.block_hashes)
    assert events[-1].lora_id is None and events[-1].lora_name is None

    h.free(req1)
    assert h.mgr.reset_prefix_cache() is True
    assert h.mgr.take_events() == [AllBlocksCleared()]


def test_null_parent_block_hash(apc):
    """The parent of a stored block comes from ``request.block_hashes`` even when the
    physically preceding block has become the null block (sliding window of one block)."""
    h = apc(10, 4, sliding_window=4, enable_kv_cache_events=True)
    r = h.req([1, 2, 3, 4, 5, 6])
    assert h.admit(r) == ([], [1, 2])
    first = h.mgr.take_events()
    h.sample(r, 7)
    h.decode(r, 8)
    assert h.table(r) == [1, 2]
    h.decode(r, 9)
    assert h.table(r) == [0, 2]
    h0, h1 = event_ints(r.block_hashes[:2])
    common = dict(block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                  kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4)
    assert first == [BlockStored(block_hashes=[h0], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                 extra_keys=[None], **common)]
    assert h.mgr.take_events() == [BlockStored(block_hashes=[h1], parent_block_hash=h0,
                                               token_ids=[5, 6, 7, 8], extra_keys=[None], **common)]


def test_kv_cache_report_mode_full_reports_hits(apc):
    h = apc(10, 4, enable_kv_cache_events=True)
    a = h.req(list(range(1, 10)))
    h.admit(a)
    h.free(a)
    h.mgr.take_events()
    queue = h.queue()
    full = SamplingParams(extra_args={"kv_cache_report_mode": "full"})
    b = h.req(list(range(1, 10)), sampling_params=full)
    assert h.lookup(b)[:2] == ([1, 2], 8)
    assert h.mgr.take_events() == [
        BlockStored(block_hashes=event_ints(b.block_hashes[:2]), parent_block_hash=None,
                    token_ids=list(range(1, 9)), block_size=4, lora_id=None, medium="GPU",
                    lora_name=None, extra_keys=[None, None], group_idx=0,
                    kv_cache_spec_kind="full_attention")
    ]
    assert h.queue() == queue and h.block(1).ref_cnt == 0
    h.lookup(h.req(list(range(1, 10))))  # incremental mode: no event
    assert h.mgr.take_events() == []


# -- allocate_slots options ------------------------------------------------------------------------


def test_allocate_with_lookahead(apc):
    h = apc(10, 4)
    r = h.req([1, 2, 3])
    assert ids(h.mgr.allocate_slots(r, 3, num_lookahead_tokens=2)) == [1, 2]
    assert h.map_size() == 0


def test_watermark_applies_to_admissions_only(apc):
    h = apc(10, 4, watermark=0.5)  # int(0.5 * 10) = 5 blocks
    assert h.mgr.watermark_blocks == 5
    first = h.req(list(range(16)))
    assert ids(h.mgr.allocate_slots(first, 16)) == [1, 2, 3, 4]  # 4 + 5 <= 9
    second = h.req(list(range(100, 108)))
    assert h.mgr.allocate_slots(second, 8) is None  # 2 + 5 > 5
    assert ids(h.mgr.allocate_slots(second, 8, has_scheduled_reqs=False)) == [5, 6]
    first.status = RequestStatus.RUNNING
    first.num_computed_tokens = 16
    first.append_output_token_ids(1)
    assert ids(h.mgr.allocate_slots(first, 1)) == [7]  # running: no watermark


def test_full_sequence_must_fit_and_reserved_blocks(apc):
    h = apc(5, 4)
    r = h.req(list(range(20)))
    assert h.mgr.allocate_slots(r, 8, full_sequence_must_fit=True) is None  # 5 > 4
    assert h.mgr.allocate_slots(r, 8, reserved_blocks=3) is None  # 2 > 4 - 3
    assert ids(h.mgr.allocate_slots(r, 8, reserved_blocks=2)) == [1, 2]


def test_delay_cache_blocks(apc):
    h = apc(10, 4)
    r = h.req(list(range(8)))
    assert ids(h.mgr.allocate_slots(r, 8, delay_cache_blocks=True)) == [1, 2]
    assert h.map_size() == 0
    h.mgr.cache_blocks(r, 8)
    assert h.map_size() == 2


def test_external_computed_tokens(apc):
    h = apc(10, 4)
    r = h.req(list(range(9)))
    assert ids(h.mgr.allocate_slots(r, 1, num_external_computed_tokens=8)) == [3]
    assert h.table(r) == [1, 2, 3]
    assert h.map_size() == 2


def test_eagle_drops_the_last_hit_block(apc):
    h = apc(10, 4, use_eagle=True)
    a = h.req(list(range(1, 10)))
    h.admit(a)
    h.free(a)
    assert h.lookup(h.req(list(range(1, 10))))[:2] == ([1], 4)


def test_sliding_window_hit_needs_a_full_window(apc):
    h = apc(10, 4, sliding_window=8)  # a hit needs cdiv(7, 4) = 2 contiguous blocks
    a = h.req(list(range(1, 14)))
    assert h.admit(a)[1] == [1, 2, 3, 4]
    h.free(a)
    # The window before position 12 is blocks 1-2; block 0 is outside it: the null block.
    assert h.lookup(h.req(list(range(1, 14))))[:2] == ([0, 2, 3], 12)
    h.mgr.evict_blocks({2})
    # No full window anywhere: the cached run starting at block 0 is the hit.
    assert h.lookup(h.req(list(range(1, 14))))[:2] == ([1], 4)
    h.mgr.evict_blocks({1})
    assert h.lookup(h.req(list(range(1, 14))))[:2] == ([], 0)


def test_manager_misc(apc):
    h = apc(10, 4)
    r = h.req(list(range(6)))
    h.admit(r)
    assert h.mgr.get_num_common_prefix_blocks(r.request_id) == [0]
    assert h.mgr.usage == pytest.approx(2 / 9)
    blocks = h.mgr.get_blocks(r.request_id)
    assert ids(blocks) == [1, 2] and blocks.get_unhashed_block_ids() == [2]
    assert h.mgr.get_blocks("unknown") is h.mgr.empty_kv_cache_blocks
    assert h.mgr.create_kv_cache_blocks(([],)) is h.mgr.empty_kv_cache_blocks
    h.free(r)
    h.free(r)  # already freed: a no-op
    assert h.free_count() == 9


# -- KVCacheBlocks --------------------------------------------------------------------------------


def test_kv_cache_blocks():
    b1, b2, b3 = KVCacheBlock(1, _block_hash=b"x"), KVCacheBlock(2), KVCacheBlock(3)
    a, b = KVCacheBlocks(([b1],)), KVCacheBlocks(((b2, b3),))
    assert (a + b).get_block_ids() == ([1, 2, 3],)
    assert (a + b).get_unhashed_block_ids() == [2, 3]
    empty = a.new_empty()
    assert empty.blocks == ((),)
    assert empty.get_block_ids() == ([],) and empty.get_block_ids(allow_none=True) is None
    with pytest.raises(ValueError):
        KVCacheBlocks(([b1], [b2])).get_unhashed_block_ids()


# -- data structures ---------------------------------------------------------------------------------


def test_kv_cache_block():
    block = KVCacheBlock(block_id=0)
    assert (block.block_id, block.ref_cnt, block.block_hash) == (0, 0, None)
    assert (block.prev_free_block, block.next_free_block, block.is_null) == (None, None, False)
    block.ref_cnt += 1
    assert block.ref_cnt == 1
    block.block_hash = b"key"
    assert block.block_hash == b"key"
    with pytest.raises(ValueError):
        block.block_hash = b"other"
    block.reset_hash()
    assert block.block_hash is None
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.unknown_field = 1  # type: ignore[attr-defined]


def check_links(queue: FreeKVCacheBlockQueue, expected_ids: list[int]) -> None:
    """The list reads ``expected_ids`` forwards and backwards, with consistent links."""
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    forward, block = [], head.next_free_block
    while block is not tail:
        assert block.next_free_block.prev_free_block is block
        forward.append(block.block_id)
        block = block.next_free_block
    backward, block = [], tail.prev_free_block
    while block is not head:
        backward.append(block.block_id)
        block = block.prev_free_block
    assert forward == expected_ids == backward[::-1]
    assert queue.num_free_blocks == len(expected_ids)
    assert [b.block_id for b in queue.get_all_free_blocks()] == expected_ids


def test_free_kv_cache_block_queue_initialization():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    check_links(queue, [0, 1, 2])
    assert queue.fake_free_list_head.block_id == queue.fake_free_list_tail.block_id == -1
    empty = FreeKVCacheBlockQueue([])
    check_links(empty, [])
    assert empty.fake_free_list_head.next_free_block is empty.fake_free_list_tail


def test_free_kv_cache_block_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    check_links(queue, [1, 2, 3, 4])
    queue.remove(blocks[2])
    check_links(queue, [1, 3, 4])
    queue.append(blocks[2])
    check_links(queue, [1, 3, 4, 2])
    for _ in range(4):
        queue.popleft()
    check_links(queue, [])
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])


def test_free_kv_cache_block_queue_append_n():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append_n([])
    check_links(queue, [0, 1])
    queue.append_n(blocks[2:4])
    check_links(queue, [0, 1, 2, 3])
    with pytest.raises(ValueError):
        queue.append_n([blocks[4], blocks[1]])  # block 1 is already queued
    with pytest.raises(ValueError):
        queue.append_n([blocks[4], blocks[4]])
    check_links(queue, [0, 1, 2, 3])
    assert blocks[4].prev_free_block is None


def test_free_kv_cache_block_queue_prepend_n():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.prepend_n(blocks[4:6])
    check_links(queue, [4, 5, 0, 1])
    queue.prepend_n([])
    check_links(queue, [4, 5, 0, 1])
    empty = FreeKVCacheBlockQueue([])
    empty.prepend_n(blocks[2:4])
    check_links(empty, [2, 3])


def test_free_kv_cache_block_queue_popleft_n():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft_n(0) == []
    assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks[:2])
    check_links(queue, [2, 3, 4, 5])
    for bad, exc in ((5, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(exc):
            queue.popleft_n(bad)
        check_links(queue, [2, 3, 4, 5])
    assert [b.block_id for b in queue.popleft_n(4)] == [2, 3, 4, 5]
    check_links(queue, [])


def test_free_kv_cache_block_queue_get_all_free_blocks():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.get_all_free_blocks() == blocks
    queue.popleft()
    queue.remove(blocks[3])
    assert queue.get_all_free_blocks() == [blocks[1], blocks[2], blocks[4]]


def test_block_pool_basics():
    pool = BlockPool(5, True, 4)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    assert BlockPool(1, True, 4).get_usage() == 0.0
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2] and pool.get_usage() == 0.5
    pool.touch([pool.null_block, got[0]])
    assert got[0].ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.free_blocks([got[1], pool.null_block, got[0]])
    assert [b.ref_cnt for b in got] == [1, 0]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [2, 3, 4]
    assert pool.take_events() == []  # events off


# -- bad input ---------------------------------------------------------------------------------


def pool_state(pool: BlockPool):
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items()),
    )


def test_block_pool_rejects_bad_input_without_changes():
    pool = BlockPool(5, True, 4)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    before = pool_state(pool)
    foreign = BlockPool(5, True, 4).blocks[1]
    for call, exc in (
        (lambda: pool.free_blocks([a, b]), ValueError),  # b is already free: double free
        (lambda: pool.free_blocks([a, a]), ValueError),  # a has one reference
        (lambda: pool.free_blocks([foreign]), ValueError),
        (lambda: pool.free_blocks([object()]), TypeError),
        (lambda: pool.touch([a, foreign]), ValueError),
        (lambda: pool.get_new_blocks(-1), ValueError),
        (lambda: pool.get_new_blocks(4), ValueError),
        (lambda: pool.get_new_blocks(True), TypeError),
        (lambda: pool.evict_blocks([1, 5]), ValueError),
        (lambda: pool.evict_blocks([-1]), ValueError),
    ):
        with pytest.raises(exc):
            call()
        assert pool_state(pool) == before
    for args, exc in (((0, True, 4), ValueError), ((4, True, 0), ValueError), ((4.0, True, 4), TypeError)):
        with pytest.raises(exc):
            BlockPool(*args)


def test_cache_full_blocks_rejects_bad_ranges_and_cached_blocks(seed_env):
    mgr = KVCacheManager(6, 4, enable_kv_cache_events=True)
    pool = mgr.block_pool
    req = Request("r", list(range(9)), block_hasher=mgr.request_block_hasher)
    blocks = pool.get_new_blocks(3)
    before = pool_state(pool)
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, blocks, 0, 3, 4, 0)  # only 2 block hashes
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, blocks[:1], 0, 2, 4, 0)  # only 1 block
    assert pool_state(pool) == before
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored]
    keyed = pool_state(pool)
    # vLLM 0.33.0 asserts that a block already keyed for as many tokens is not cached again
    # (only a partial entry is promoted); nothing changes
    with pytest.raises(AssertionError):
        pool.cache_full_blocks(req, blocks, 1, 2, 4, 1)
    assert pool_state(pool) == keyed and pool.take_events() == []
    assert blocks[1].block_hash == make_block_hash_with_group_id(req.block_hashes[1], 0)
    assert len(pool.cached_block_hash_to_block) == 2


def test_manager_rejects_bad_input_without_changes(seed_env):
    mgr = KVCacheManager(10, 4, max_model_len=16)
    r = Request("r", list(range(9)), block_hasher=mgr.request_block_hasher)
    too_long = Request("long", list(range(17)), block_hasher=mgr.request_block_hasher)
    before = pool_state(mgr.block_pool)
    for call, exc in (
        (lambda: mgr.allocate_slots(r, 0), ValueError),
        (lambda: mgr.allocate_slots(r, -1), ValueError),
        (lambda: mgr.allocate_slots(r, 1, num_lookahead_tokens=-2), ValueError),
        (lambda: mgr.allocate_slots(r, 1.5), TypeError),
        (lambda: mgr.allocate_slots(too_long, 17), ValueError),
        (lambda: mgr.allocate_slots(r, 9, 4), ValueError),  # 4 computed tokens but no blocks
        (lambda: mgr.allocate_slots(r, 9, 0, ([],)), TypeError),
        (lambda: mgr.allocate_slots(r, 9, 0, KVCacheBlocks(((), ()))), ValueError),
    ):
        with pytest.raises(exc):
            call()
        assert pool_state(mgr.block_pool) == before
        assert mgr.get_block_ids("r") == ([],)
    assert ids(mgr.allocate_slots(r, 9)) == [1, 2, 3]
    hit = KVCacheBlocks(([mgr.block_pool.blocks[1]],))
    with pytest.raises(AssertionError, match="already holds blocks"):  # vLLM asserts
        mgr.allocate_slots(r, 1, 4, hit)
    for kwargs, exc in (
        ({"block_size": 0}, ValueError),
        ({"hash_algo": "md5"}, ValueError),
        ({"watermark": -0.1}, ValueError),
        ({"sliding_window": 0}, ValueError),
        ({"max_model_len": -1}, ValueError),
    ):
        args = {"num_blocks": 10, "block_size": 4, **kwargs}
        with pytest.raises(exc):
            KVCacheManager(args.pop("num_blocks"), args.pop("block_size"), **args)


def test_sliding_window_adoption_after_a_failed_allocation(impl):
    """Found by the manager lockstep; the values are vLLM 0.33.0's own (checked by running
    its KVCacheManager). A sliding-window request keeps num_computed_tokens = 16 after it is
    freed; allocate_slots(r, 1) then raises (the window estimate and the allocation disagree,
    as in vLLM), and a later adoption of the 16-token hit still succeeds: the failed call
    left the request holding no blocks. kvblock's own manager refuses both calls instead (a
    freed request with computed tokens: its KV is gone, tests/test_manager_finished_requests.py),
    changing nothing; kvblock.vllm keeps vLLM's behaviour."""
    mgr = impl.KVCacheManager(17, 1, enable_caching=True, sliding_window=3)
    r = Request("r0", [1, 2, 3, 4, 5, 6, 7, 8, 9] + [0] * 7, block_hasher=mgr.request_block_hasher)
    hit, n, _ = mgr.get_computed_blocks(r)
    assert ids(mgr.allocate_slots(r, r.num_tokens - n, n, hit)) == list(range(1, 17))
    r.num_computed_tokens = r.num_tokens
    r.append_output_token_ids(2)
    mgr.free(r)
    if impl.name == "kvblock":
        free = mgr.block_pool.get_num_free_blocks()
        with pytest.raises(ValueError, match="holds no blocks in this manager but has 16 computed"):
            mgr.allocate_slots(r, 1)
        hit, n, _ = mgr.get_computed_blocks(r)
        with pytest.raises(ValueError, match="holds no blocks in this manager but has 16 computed"):
            mgr.allocate_slots(r, 0, n, hit)
        assert mgr.get_block_ids("r0") == ([],) and mgr.block_pool.get_num_free_blocks() == free
        return
    with pytest.raises(ValueError, match="Cannot get 17 free blocks"):
        mgr.allocate_slots(r, 1)
    hit, n, _ = mgr.get_computed_blocks(r)
    assert (ids(hit), n) == ([0] * 14 + [15, 16], 16)
    assert ids(mgr.allocate_slots(r, 0, n, hit)) == [16, 15]
    assert mgr.get_block_ids("r0") == ([0] * 30 + [16, 15],)
