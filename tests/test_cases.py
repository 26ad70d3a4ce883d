"""The manager and pool scenarios of ``../shared/cases/CASES.md`` (C02-C21, C23-C25).

Every test follows its case's call sequence and checks its exact expected values. The
hashes are sha256 with ``PYTHONHASHSEED`` unset (root ``066b1e89...``); the ``apc`` fixture
sets that root for the implementation under test.
"""

from __future__ import annotations

import pickle
import random
import tracemalloc

import msgspec
import pytest

from apc_helpers import ids
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblock.hashing import block_hash_to_event_int, make_block_hash_with_group_id
from kvblock.extra_keys import generate_block_hash_extra_keys
from impls import IMPLS
from kvblock.request import LoRARequest, Request, RequestStatus, SamplingParams

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# CASES.md "Reference hashes" (sha256, default root, BS = 4).
H0 = bytes.fromhex("52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a")
H1 = bytes.fromhex("bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde")
H2 = bytes.fromhex("41609895a9415ae1093250e556389cf528d32e2c5e1957195f3971065b56d691")
G0 = bytes.fromhex("e2ca51e8c3e0ebabf63be6e7815390b6a3f18622ef1fcd380ba8e42e6c83eb28")
G1 = bytes.fromhex("def35608a094ce6d8cf3ccc8eaf49c4943a73865498f9e9299863e3f46a81d75")
S0 = bytes.fromhex("9df1abb8a62e5a80dddafad39ab7897b8c2339852bffb8bdc834d851e6ff31f4")
S1 = bytes.fromhex("8d728c3a4e5f11a8cad56f8ddffa0ce91f9481d2b16ac1a9d7d42982bd66e28b")
T1 = bytes.fromhex("f300d3d97c38739d6df2a36c159ee3a82d0694f441dde17bdee4e05a88467d58")
H0_INT, H1_INT, H2_INT = 1882140585328457242, 15284023028817948126, 6861639779391821457
G0_INT, G1_INT = 840172218544810792, 11062597976171486581
S0_INT, S1_INT = 14426393352653976052, 15552101054717289099


def rng(a: int, b: int) -> list[int]:
    """CASES.md ``[a..b]``: a through b inclusive."""
    return list(range(a, b + 1))


def stored(hashes, parent, token_ids, extra_keys, block_size=4, lora=None) -> BlockStored:
    """The ``BlockStored`` a single full-attention group emits (after ``take_events``)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=lora.lora_int_id if lora else None,
        medium="GPU",
        lora_name=lora.lora_name if lora else None,
        extra_keys=extra_keys,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(hash_int: int) -> BlockRemoved:
    """The ``BlockRemoved`` of one evicted group-0 key."""
    return BlockRemoved(block_hashes=[hash_int], medium="GPU", group_idx=0)


def extra_keys_of(r, block_size: int) -> list:
    """The tagged extra keys of each full block of ``r``."""
    out, mm_idx = [], 0
    for start in range(0, r.num_tokens - block_size + 1, block_size):
        keys, mm_idx = generate_block_hash_extra_keys(r, start, start + block_size, mm_idx)
        out.append(keys)
    return out


# -- Hashing and cache keys --------------------------------------------------------------------


def test_c02_equal_content_at_another_depth_is_another_key(apc):
    h = apc(10, 4, enable_kv_cache_events=True)
    assert h.req([7] * 8).block_hashes == [S0, S1] and S0 != S1
    assert h.req([9, 9, 9, 9, 7, 7, 7, 7]).block_hashes[1] == T1 != S1

    a = h.req([7] * 8 + [5])
    assert h.admit(a) == ([], [1, 2, 3])
    assert h.mgr.take_events() == [stored([S0_INT, S1_INT], None, [7] * 8, [None, None])]
    h.free(a)
    assert h.mgr.take_events() == []
    hit, n, _ = h.lookup(h.req([7] * 12 + [1]))
    assert (hit, n) == ([1, 2], 8)


def test_c03_cancelling_token_edits_change_the_hash(apc, impl):
    blocks = [
        [100, 200, 300, 400], [131, 199, 300, 400], [100, 231, 299, 400],
        [100, 200, 331, 399], [200, 100, 300, 400],
    ]
    for algo in ALGOS:
        fn = impl.hashing.get_hash_fn_by_name(algo)
        impl.hashing.init_none_hash(fn)
        digests = {impl.hashing.hash_block_tokens(fn, None, block, None) for block in blocks}
        assert len(digests) == 5, algo

    h = apc(10, 4)
    a = h.req([100, 200, 300, 400, 5])
    h.admit(a)
    h.free(a)
    assert h.lookup(h.req([131, 199, 300, 400, 5]))[1] == 0
    assert h.lookup(h.req([100, 200, 300, 400, 5]))[1] == 4


def test_c04_lora_identity(apc):
    h = apc(10, 4)
    p = rng(1, 9)
    l1, l2 = LoRARequest("x", 1, "/a"), LoRARequest("x", 2, "/b")
    l3, l4 = LoRARequest("y", 3, "/c"), LoRARequest("x", 2, "/a")
    a = h.req(p, lora_request=l1)
    h.admit(a)
    h.free(a)
    assert h.lookup(h.req(p))[1] == 0
    assert h.lookup(h.req(p, lora_request=l3))[1] == 0
    assert h.lookup(h.req(p, lora_request=l1))[1] == 8
    assert h.lookup(h.req(p, lora_request=l2))[1] == 0
    assert h.lookup(h.req(p, lora_request=l4))[1] == 8  # same name and path: shared (0.33.0)

    assert extra_keys_of(a, 4) == [(("lora", "x", "/a"),)] * 2
    h0 = {name: h.req(p, lora_request=lora).block_hashes[0]
          for name, lora in (("none", None), ("l1", l1), ("l2", l2), ("l3", l3), ("l4", l4))}
    assert len({h0["none"], h0["l1"], h0["l2"], h0["l3"]}) == 4
    assert h0["l4"] == h0["l1"]


def test_c05_cache_salt_separates_the_whole_chain(apc):
    h = apc(10, 4)
    p = rng(1, 13)
    s1 = h.req(p, cache_salt="s1")
    h.admit(s1)
    h.free(s1)
    assert h.lookup(h.req(p, cache_salt="s2"))[1] == 0
    assert h.lookup(h.req(p))[1] == 0
    assert h.lookup(h.req(p, cache_salt="s1"))[1] == 12

    assert extra_keys_of(s1, 4) == [(("cache_salt", "s1"),), None, None]
    s2, plain = h.req(p, cache_salt="s2"), h.req(p)
    for i in range(3):
        assert s1.block_hashes[i] != s2.block_hashes[i]
        assert s1.block_hashes[i] != plain.block_hashes[i]

    h.admit(plain)
    h.free(plain)
    assert h.lookup(h.req(p))[1] == 12
    assert h.lookup(h.req(p, cache_salt="s1"))[1] == 12
    assert h.free_count() == 9


@pytest.mark.parametrize("salt", ["", 123, b"x", "a" * 129, "a@b", "a/b", "a\\b", "a\0b"])
def test_c06_invalid_cache_salt_is_rejected(apc, salt):
    h = apc(10, 4)
    calls = []
    # a salt that is not a str is a TypeError naming cache_salt; a bad str a ValueError
    with pytest.raises(ValueError if isinstance(salt, str) else TypeError, match="^cache_salt: "):
        Request("r", rng(1, 8), cache_salt=salt, block_hasher=lambda r: calls.append(r) or [])
    assert calls == []  # rejected before any hashing
    assert h.req(rng(1, 8), cache_salt="s1").cache_salt == "s1"


def test_c06_engine_behaviour_without_validation(apc):
    """vLLM 0.33.0's engine core: ``""`` hashes exactly like no salt (the defect C06 names),
    and non-str salts are hashed as given."""
    h = apc(10, 4)
    plain = h.req(rng(1, 8)).block_hashes
    assert h.req(rng(1, 8), cache_salt="", validate_cache_salt=False).block_hashes == plain
    for salt in (123, b"x"):
        salted = h.req(rng(1, 8), cache_salt=salt, validate_cache_salt=False).block_hashes
        assert len(salted) == 2 and salted[0] != plain[0]


def test_c07_different_images_behind_identical_placeholders(apc):
    h = apc(10, 4)
    p = [1, 2, 99, 99, 99, 99, 99, 3, 4, 5, 6, 7, 8]
    a = h.req(p, mm_features=[("imgA", 2, 5)])
    h.admit(a)
    h.free(a)
    assert h.lookup(h.req(p, mm_features=[("imgB", 2, 5)]))[1] == 0
    assert h.lookup(h.req(p, mm_features=[("imgA", 2, 5)]))[1] == 12

    assert extra_keys_of(a, 4) == [(("mm", "imgA", 2),), (("mm", "imgA", -2),), None]
    b = h.req(p, mm_features=[("imgB", 2, 5)])
    assert all(a.block_hashes[i] != b.block_hashes[i] for i in range(3))

    q = [1, 2, 3, 4, 99, 99, 99, 99, 5, 6, 7, 8, 9]
    q_img, q_plain = h.req(q, mm_features=[("imgA", 4, 4)]), h.req(q)
    assert extra_keys_of(q_img, 4) == [None, (("mm", "imgA", 0),), None]
    assert q_img.block_hashes[0] == q_plain.block_hashes[0]
    assert q_img.block_hashes[1] != q_plain.block_hashes[1]

    x = h.req(p, mm_features=[("0" * 60 + "abcd", 2, 5)])
    y = h.req(p, mm_features=[("f" * 60 + "abcd", 2, 5)])
    assert x.block_hashes[0] != y.block_hashes[0]


# -- Hit length ------------------------------------------------------------------------------------


def test_c08_block_aligned_prompt_recomputes_its_last_block(apc):
    h = apc(10, 4)
    a = h.req(rng(1, 8))
    assert h.admit(a) == ([], [1, 2])
    h.free(a)
    assert h.queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]

    b = h.req(rng(1, 8))
    hit, n, blocks = h.lookup(b)
    assert (hit, n) == ([1], 4)
    assert ids(h.mgr.allocate_slots(b, 4, 4, blocks)) == [3]
    assert h.table(b) == [1, 3]
    assert h.free_count() == 7
    assert h.queue() == [4, 5, 6, 7, 8, 9, 2]
    b.num_computed_tokens = 8
    b.status = RequestStatus.RUNNING

    assert h.admit(h.req(rng(100, 127)))[1] == [4, 5, 6, 7, 8, 9, 2]
    assert h.free_count() == 0
    assert h.lookup(h.req(rng(1, 9)))[:2] == ([1, 3], 8)


def test_c08_control_and_block_size_16(apc):
    h = apc(10, 4)
    a = h.req(rng(1, 8))
    h.admit(a)
    h.free(a)
    assert h.lookup(h.req(rng(1, 9)))[:2] == ([1, 2], 8)

    h16 = apc(10, 16)
    p = rng(1, 32)
    a16 = h16.req(p)
    h16.admit(a16)
    h16.free(a16)
    assert h16.lookup(h16.req(p))[1] == 16
    assert h16.lookup(h16.req(p + [33]))[1] == 32


def test_c09_hit_stops_at_first_missing_block(apc):
    h = apc(4, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 12))
    assert a.block_hashes == [H0, H1, H2]
    pool = h.pool
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    pool.cache_full_blocks(a, blocks, 0, 3, 4, 0)
    assert h.map_size() == 3
    assert [pool.get_cached_block(x, [0])[0].block_id for x in (H0, H1, H2)] == [1, 2, 3]
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[2], blocks[1]])
    assert h.queue() == [1, 3, 2]

    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert h.mgr.take_events()[-1] == removed(H0_INT)
    assert h.map_size() == 2
    assert pool.get_cached_block(H1, [0])[0].block_id == 2

    b = h.req(rng(1, 13))
    assert h.lookup(b)[:2] == ([], 0)
    h.mgr.record_prefix_cache_stats(b, 0)
    assert h.mgr.make_prefix_cache_stats().hits == 0


# -- Allocation and reference counts -------------------------------------------------------------


def _c10_setup(h):
    a = h.req([1, 2, 3, 4])
    assert h.admit(a)[1] == [1]
    h.free(a)
    assert h.queue() == [2, 3, 1]
    c = h.req(rng(20, 27))
    assert h.admit(c)[1] == [2, 3]
    assert h.queue() == [1]
    b = h.req([1, 2, 3, 4, 9])
    assert h.lookup(b)[:2] == ([1], 4)
    return b, c


def test_c10_free_hit_block_cannot_double_as_the_new_block(apc):
    h = apc(4, 4)
    b, c = _c10_setup(h)
    _, _, blocks = h.lookup(b)
    assert h.mgr.allocate_slots(b, 1, 4, blocks) is None
    assert h.free_count() == 1
    assert h.block(1).ref_cnt == 0
    assert h.block(1).block_hash == make_block_hash_with_group_id(H0, 0)
    assert h.queue() == [1]
    assert h.table(b) == []

    h.free(c)
    assert h.queue() == [1, 3, 2]
    _, _, blocks = h.lookup(b)
    assert ids(h.mgr.allocate_slots(b, 1, 4, blocks)) == [3]
    assert h.table(b) == [1, 3]
    assert h.free_count() == 1


def test_c11_failed_allocations_leave_no_trace(apc):
    h = apc(4, 4)
    b, c = _c10_setup(h)
    for _ in range(3):
        _, _, blocks = h.lookup(b)
        assert h.mgr.allocate_slots(b, 1, 4, blocks) is None
        assert h.free_count() == 1
        assert h.block(1).ref_cnt == 0
        assert 1 in h.queue()
    h.free(c)
    h.admit(b)
    assert h.table(b) == [1, 3]
    h.free(b)
    assert h.free_count() == 3
    assert h.block(1).ref_cnt == 0
    assert h.queue() == [3, 2, 1]


def test_c12_oversized_pops_fail_atomically(apc, impl):
    pool = impl.BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=4)
    queue = pool.free_block_queue

    def queue_ids():
        return [b.block_id for b in queue.get_all_free_blocks()]

    with pytest.raises(ValueError):
        queue.popleft_n(5)
    assert queue.num_free_blocks == 3 and queue_ids() == [1, 2, 3]
    with pytest.raises(ValueError, match="Cannot get 5 free blocks from the pool"):
        pool.get_new_blocks(5)
    assert pool.get_num_free_blocks() == 3 and queue_ids() == [1, 2, 3]
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()

    h = apc(4, 4)
    r = h.req(rng(1, 20))
    _, n, blocks = h.lookup(r)
    assert n == 0
    assert h.mgr.allocate_slots(r, 20, 0, blocks) is None
    assert h.free_count() == 3
    assert h.table(r) == []


# -- Eviction order ------------------------------------------------------------------------------


def test_c13_freeing_a_chain_evicts_its_deepest_block_first(apc):
    h = apc(4, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 12))
    assert h.admit(a)[1] == [1, 2, 3]
    h.free(a)
    assert h.queue() == [3, 2, 1]
    assert h.admit(h.req([50, 51, 52]))[1] == [3]
    assert h.mgr.take_events()[-1] == removed(H2_INT)
    assert h.lookup(h.req(rng(1, 13)))[:2] == ([1, 2], 8)


def test_c14_eviction_follows_last_use(apc):
    h = apc(4, 4)
    for lo in (1, 5, 9):
        r = h.req(rng(lo, lo + 3))
        h.admit(r)
        h.free(r)
    assert h.queue() == [1, 2, 3]
    a2 = h.req([1, 2, 3, 4, 99])
    assert h.admit(a2) == ([1], [2])
    h.free(a2)
    assert h.queue() == [2, 3, 1]
    assert h.admit(h.req(rng(200, 207)))[1] == [2, 3]
    assert h.queue() == [1]
    assert h.lookup(h.req([1, 2, 3, 4, 77]))[1] == 4
    assert h.lookup(h.req([9, 10, 11, 12, 5]))[1] == 0


def test_c15_recycled_block_loses_its_old_key(apc):
    h = apc(3, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 5))
    assert h.admit(a)[1] == [1, 2]
    h.free(a)
    assert h.queue() == [2, 1]
    b = h.req(rng(9, 16))
    assert h.admit(b)[1] == [2, 1]
    h.free(b)
    assert h.lookup(h.req(rng(1, 5)))[1] == 0
    assert h.map_size() == 2
    assert h.pool.get_cached_block(G0, [0])[0].block_id == 2
    assert h.pool.get_cached_block(G1, [0])[0].block_id == 1
    assert h.block(1).block_hash == make_block_hash_with_group_id(G1, 0)
    assert h.mgr.take_events() == [
        stored([H0_INT], None, [1, 2, 3, 4], [None]),
        removed(H0_INT),
        stored([G0_INT, G1_INT], None, rng(9, 16), [None, None]),
    ]


# -- Stats -------------------------------------------------------------------------------------


def test_c16_preempted_rereading_is_not_a_prefix_hit(apc):
    h = apc(10, 4)
    a = h.req(rng(1, 8))
    h.admit(a)
    h.sample(a, 101)
    for t in (102, 103, 104):
        h.decode(a, t)
    assert (a.num_tokens, a.num_computed_tokens, h.table(a)) == (12, 11, [1, 2, 3])
    h.preempt(a)
    hit, n, blocks = h.lookup(a)
    assert (hit, n) == ([1, 2], 8)
    assert h.mgr.allocate_slots(a, 4, 8, blocks) is not None
    h.mgr.record_prefix_cache_stats(a, 8)
    s = h.mgr.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits, s.hit_rate) == (1, 8, 0, 0.0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 12, 8)


def test_c17_prompt_logprobs_skip_reading_but_still_write(apc):
    h = apc(10, 4)
    a = h.req(rng(1, 9))
    assert h.admit(a)[1] == [1, 2, 3]
    h.free(a)
    assert h.queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    b = h.req(rng(1, 9), sampling_params=SamplingParams(prompt_logprobs=1))
    assert b.skip_reading_prefix_cache
    assert h.lookup(b)[:2] == ([], 0)
    assert h.admit(b)[1] == [3, 4, 5]
    assert h.free_count() == 6
    h.free(b)
    assert h.queue() == [5, 6, 7, 8, 9, 2, 1, 4, 3]
    assert h.admit(h.req(rng(1, 9))) == ([1, 2], [5])
    s = h.mgr.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 18, 8)


# -- Reset ---------------------------------------------------------------------------------------


def test_c18_reset_prefix_cache_is_all_or_nothing(apc):
    h = apc(10, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 9))
    assert h.admit(a)[1] == [1, 2, 3]
    b = h.req(rng(20, 28))
    assert h.admit(b)[1] == [4, 5, 6]
    h.free(b)
    assert h.map_size() == 4
    h.mgr.take_events()

    assert h.mgr.reset_prefix_cache() is False
    assert h.lookup(h.req(rng(20, 27) + [29]))[1] == 8
    assert h.map_size() == 4
    assert h.mgr.take_events() == []

    h.free(a)
    assert h.mgr.reset_prefix_cache() is True
    assert h.map_size() == 0
    assert all(block.block_hash is None for block in h.pool.blocks)
    assert h.lookup(h.req(rng(1, 9)))[1] == 0
    assert h.lookup(h.req(rng(20, 27) + [29]))[1] == 0
    assert h.free_count() == 9
    assert h.mgr.take_events() == [AllBlocksCleared()]
    assert h.mgr.make_prefix_cache_stats().reset is True


# -- KV events -------------------------------------------------------------------------------------


def test_c19_block_stored_names_the_preceding_hash_as_parent(apc):
    h = apc(10, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 9))
    h.admit(a)
    first = h.mgr.take_events()
    assert first == [stored([H0_INT, H1_INT], None, rng(1, 8), [None, None])]
    h.free(a)
    assert h.mgr.take_events() == []
    assert h.admit(h.req(rng(1, 13))) == ([1, 2], [3, 4])
    second = h.mgr.take_events()
    assert second == [stored([H2_INT], H1_INT, rng(9, 12), [None])]

    known: set[int] = set()
    for event in first + second:
        assert event.parent_block_hash is None or event.parent_block_hash in known
        known.update(event.block_hashes)
    assert known == {H0_INT, H1_INT, H2_INT}


def test_c20_event_order_draining_and_reset(apc):
    h = apc(3, 4, enable_kv_cache_events=True)
    a = h.req(rng(1, 5))
    h.admit(a)
    assert h.mgr.take_events() == [stored([H0_INT], None, [1, 2, 3, 4], [None])]
    h.free(a)
    b = h.req(rng(9, 16))
    h.admit(b)
    assert h.mgr.take_events() == [
        removed(H0_INT),
        stored([G0_INT, G1_INT], None, rng(9, 16), [None, None]),
    ]
    assert h.mgr.take_events() == []
    h.free(b)
    assert h.mgr.reset_prefix_cache() is True
    assert h.mgr.take_events() == [AllBlocksCleared()]


def test_c20_events_carry_the_lora_identity(apc):
    h = apc(3, 4, enable_kv_cache_events=True)
    lora = LoRARequest("x", 7, "/a")
    r = h.req(rng(1, 5), lora_request=lora)
    h.admit(r)
    (event,) = h.mgr.take_events()
    h0 = block_hash_to_event_int(r.block_hashes[0])
    assert event == stored([h0], None, [1, 2, 3, 4], [("x",)], lora=lora)


def test_c20_stored_event_spans_skipped_null_blocks(apc):
    """A cached range holding a null block (a sliding-window block outside the window): the
    event's token ids cover the whole range while its hashes and extra keys skip the null
    block, as vLLM's ``cache_full_blocks`` does. Found by the long lockstep run."""
    h = apc(5, 4, enable_kv_cache_events=True)
    lora = LoRARequest("x", 7, "/a")
    r = h.req(rng(1, 12), lora_request=lora)
    pool = h.pool
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, [pool.null_block, a, b], 0, 3, 4, 0)
    hs = [block_hash_to_event_int(x) for x in r.block_hashes]
    pool_event = dict(kv_cache_spec_kind=None)  # the pool's events carry no group spec
    want = stored(hs[1:], None, rng(1, 12), [("x",), ("x",)], lora=lora)
    assert pool.take_events() == [msgspec.structs.replace(want, **pool_event)]
    c = pool.get_new_blocks(1)[0]
    r2 = h.req(rng(21, 32))
    pool.cache_full_blocks(r2, [c, pool.null_block, pool.null_block], 0, 3, 4, 0)
    h2 = block_hash_to_event_int(r2.block_hashes[0])
    want = stored([h2], None, rng(21, 32), [None])
    assert pool.take_events() == [msgspec.structs.replace(want, **pool_event)]


# -- Sliding window ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_flight", [1, 0])
def test_c21_in_flight_step_keeps_its_window_block(apc, in_flight):
    h = apc(10, 4, sliding_window=8)
    r = h.req(rng(1, 10))
    h.admit(r)
    assert h.table(r) == [1, 2, 3] and h.free_count() == 6
    h.sample(r, 500)
    assert ids(h.mgr.allocate_slots(r, 1)) == []
    assert h.table(r) == [1, 2, 3]

    r.num_computed_tokens = 11
    r.num_in_flight_tokens = in_flight
    h.sample(r, 501)
    assert ids(h.mgr.allocate_slots(r, 1)) == []
    if in_flight:
        assert h.table(r) == [1, 2, 3] and h.free_count() == 6
        assert h.block(1).ref_cnt == 1 and 1 not in h.queue()
        r.num_in_flight_tokens = 0
        h.mgr.remove_skipped_blocks(r.request_id, 11)
    # Without the in-flight count, block 1 is freed at once: the defect C21 describes.
    assert h.table(r) == [0, 2, 3] and h.free_count() == 7


# -- Performance and resources (deterministic forms) ---------------------------------------------


class CountingHash:
    """A hash function wrapper that counts calls and the largest serialized input."""

    def __init__(self, fn):
        self.fn, self.calls, self.max_input = fn, 0, 0

    def __call__(self, obj):
        self.calls += 1
        self.max_input = max(self.max_input, len(pickle.dumps(obj, protocol=5)))
        return self.fn(obj)


@pytest.mark.parametrize("algo", ALGOS)
def test_c23_hashing_work_is_linear_in_prompt_length(impl, seed_env, algo):
    seed_env(None)
    fn = impl.hashing.get_hash_fn_by_name(algo)
    impl.hashing.init_none_hash(fn)
    gen = random.Random(23)
    work = {}
    for n in (8192, 65536):
        counter = CountingHash(fn)
        hasher = impl.hashing.get_request_block_hasher(16, counter)
        r = Request(f"r{n}", [gen.randrange(128000) for _ in range(n)], block_hasher=hasher)
        assert len(r.block_hashes) == n // 16
        work[n] = counter.calls
        assert counter.max_input < 200  # a fixed-size parent digest plus 16 tokens per call
        if n == 65536:
            counter.calls = 0
            r.append_output_token_ids([gen.randrange(128000) for _ in range(16)])
            assert counter.calls == 1 and len(r.block_hashes) == 4097
    assert work == {8192: 512, 65536: 4096}  # ratio 8, not 64


@pytest.mark.parametrize("impl", [IMPLS["reference"]], ids=["reference"])
def test_c23_miss_at_block_zero_probes_the_map_once(apc, impl):
    """Counts probes through the reference pool's Python ``get_cached_block``."""
    h = apc(64, 16)
    probes = []
    lookup = h.pool.get_cached_block

    def counting_lookup(block_hash, group_ids):
        probes.append(block_hash)
        return lookup(block_hash, group_ids)

    h.pool.get_cached_block = counting_lookup
    r = h.req(list(range(65536)))
    assert h.lookup(r)[1] == 0
    assert probes == [r.block_hashes[0]]


def test_c24_state_stays_bounded_under_sustained_load(apc, impl):
    iterations, checkpoint = 100_000, 20_000
    h = apc(64, 4, log_stats=False)
    gen = random.Random(24)
    max_map_size = 0
    for i in range(iterations):
        if i == checkpoint:
            tracemalloc.start()
        r = h.req([gen.randrange(1 << 30) for _ in range(8)], request_id=f"r{i}")
        h.admit(r)
        h.free(r)
        max_map_size = max(max_map_size, h.map_size())
        if i % 997 == 0:
            assert h.table(r) == []
            if impl.name == "reference":
                assert not h.mgr.req_to_blocks and not h.mgr.num_cached_block
            assert h.mgr.take_events() == []
    growth, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert max_map_size == 63 and h.map_size() == 63
    assert growth < 1_000_000


# -- The design document's example ---------------------------------------------------------------


def test_c25_design_doc_walkthrough(apc):
    h = apc(10, 4)
    a = rng(100, 114)
    r0 = h.req(a)
    assert h.admit(r0) == ([], [1, 2, 3, 4])
    assert h.map_size() == 3
    assert h.queue() == [5, 6, 7, 8, 9]
    assert h.decode(r0, 115) == []
    assert h.decode(r0, 116) == [5]
    assert h.table(r0) == [1, 2, 3, 4, 5] and h.map_size() == 4

    r1 = h.req(a[:10] + rng(200, 203))
    assert h.admit(r1) == ([1, 2], [6, 7])
    assert h.queue() == [8, 9]
    h.free(r0)
    assert h.queue() == [5, 8, 9, 4, 3]
    h.free(r1)
    assert h.queue() == [7, 5, 8, 9, 4, 3, 6, 2, 1]

    r2 = h.req(a[:12] + rng(300, 316))
    assert h.admit(r2) == ([1, 2, 3], [7, 5, 8, 9, 4])
    assert h.table(r2) == [1, 2, 3, 7, 5, 8, 9, 4]
    assert h.queue() == [6]
