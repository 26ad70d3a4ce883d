"""kvblock's own API for hybrid models (issue 12): ``KVCacheManager(kv_cache_groups=[...])`` with
kvblock.specs, one block table per group, slot mappings per group, and the inputs it refuses
(ValueError / TypeError naming the argument, nothing built or changed).

Equivalence with vLLM 0.33.0's own manager is proven by tests/test_vllm_lockstep.py; these
tests pin the public API and its checks."""

from __future__ import annotations

import pytest

from conftest import require_module

import kvblock
from kvblock.hashing import get_hash_fn_by_name, get_request_block_hasher
from kvblock.request import Request
from kvblock.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _state(mgr, ids):
    pool = mgr.block_pool
    return (
        pool.get_num_free_blocks(),
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(pool.blocks[i].ref_cnt, pool.blocks[i].block_hash) for i in range(pool.num_gpu_blocks)],
        [mgr.get_block_ids(i) for i in ids],
    )


def _run(mgr, rid, tokens):
    req = Request(rid, tokens, block_hasher=mgr.request_block_hasher)
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return req, hit


def test_gpt_oss_like_two_groups_share_a_prefix():
    """Full attention + a 32-token window, 16-token blocks: one table per group; the second
    request hits the same 48 tokens in both groups, the window group keeping only the blocks
    its window needs (null block 0 before them)."""
    mgr = kvblock.KVCacheManager(64, kv_cache_groups=[FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=32)])
    assert mgr.num_kv_cache_groups == 2 and mgr.hash_block_size == 16 and mgr.scheduler_block_size == 16
    a, _ = _run(mgr, "a", list(range(70)))
    full, window = mgr.get_block_ids("a")
    assert len(full) == 5 and len(window) == 5
    assert set(full).isdisjoint(window) and 0 not in full
    b, hit = _run(mgr, "b", list(range(64)) + [999] * 10)
    assert hit == 64
    bfull, bwin = mgr.get_block_ids("b")
    assert bfull[:4] == full[:4]
    # the window group hits only the blocks covering the window before the first new token
    assert bwin[:2] == [0, 0] and bwin[2:4] == window[2:4]
    mgr.free(a)
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 63


def test_qwen3_next_like_mamba_and_full_attention():
    """Three Mamba groups (align mode) and one full-attention group: a prefix hit is
    granted only where every Mamba group kept a state (block boundaries)."""
    groups = [MambaSpec(16, mamba_cache_mode="align") for _ in range(3)] + [FullAttentionSpec(16)]
    mgr = kvblock.KVCacheManager(200, kv_cache_groups=groups, max_model_len=1024)
    a, _ = _run(mgr, "a", list(range(64)))
    ids = mgr.get_block_ids("a")
    assert len(ids) == 4 and len(ids[3]) == 4
    mgr.free(a)
    # as vLLM: a Mamba state cached in this step cannot be a hit before the next step
    b = Request("b", list(range(64)) + [7] * 20, block_hasher=mgr.request_block_hasher)
    blocks, hit, _ = mgr.get_computed_blocks(b)
    assert hit == 64 and mgr.allocate_slots(b, 20, hit, blocks) is None
    mgr.new_step_starts()
    b, hit = _run(mgr, "b", list(range(64)) + [7] * 20)
    assert hit == 64
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 199


def test_block_tables_and_slot_mappings_per_group():
    """get_block_ids() feeds a MultiGroupBlockTable row; each group's slot mapping follows
    its own table (window blocks outside the window map to the null block's slots)."""
    torch = require_module("torch")
    from kvblock.worker.block_table import MultiGroupBlockTable, slot_mapping_reference

    mgr = kvblock.KVCacheManager(64, kv_cache_groups=[FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=32)])
    a, _ = _run(mgr, "a", list(range(70)))
    ids = mgr.get_block_ids("a")
    mg = MultiGroupBlockTable([16, 16], 2, 256, 128, "cpu")
    mg.add_row(ids, 0)
    mg.commit_block_table(1)
    positions = torch.arange(60, 70, dtype=torch.int64)
    qsl = torch.tensor([0, 10], dtype=torch.int32)
    slots = mg.compute_slot_mapping(qsl, positions)
    for g, s in enumerate(slots):
        want = [ids[g][p // 16] * 16 + p % 16 for p in range(60, 70)]
        assert s[:10].tolist() == want
        ref = slot_mapping_reference([ids[g]], 16, [0, 10], positions.tolist(), 128)
        assert s.tolist() == list(ref)


@pytest.mark.parametrize(
    "groups, exc, match",
    [
        ([], ValueError, "kv_cache_groups: empty"),
        ("full", TypeError, "kv_cache_groups: expected a list"),
        ([object()], TypeError, r"kv_cache_groups\[0\]: expected a kvblock.specs spec"),
    ],
)
def test_bad_group_lists_are_refused(groups, exc, match):
    with pytest.raises(exc, match=match):
        kvblock.KVCacheManager(32, kv_cache_groups=groups)


def test_incompatible_configurations_are_refused():
    """What vLLM 0.33.0's coordinator refuses, kvblock refuses as a ValueError naming the
    argument: context parallelism with a sliding-window group, a retention interval on a
    model with nothing to retain, a hash block size that does not divide."""
    hybrid = [FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=64)]
    with pytest.raises(ValueError, match=r"kv_cache_groups\[1\]: PCP only supports full attention"):
        kvblock.KVCacheManager(64, kv_cache_groups=hybrid, pcp_world_size=2)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        kvblock.KVCacheManager(64, 16, prefix_cache_retention_interval=32)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        kvblock.KVCacheManager(64, kv_cache_groups=hybrid, prefix_cache_retention_interval=24)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: FullAttentionSpec(0), ValueError, "block_size: must be > 0"),
        (lambda: FullAttentionSpec(True), TypeError, "block_size: expected int"),
        (lambda: SlidingWindowSpec(16, sliding_window=0), ValueError, "sliding_window: must be > 0"),
        (lambda: ChunkedLocalAttentionSpec(16, attention_chunk_size=-4), ValueError, "attention_chunk_size"),
        (lambda: MambaSpec(16, mamba_cache_mode="all"), ValueError, "mamba_cache_mode"),
        (lambda: MambaSpec(16, num_speculative_blocks=-1), ValueError, "num_speculative_blocks"),
    ],
)
def test_bad_specs_are_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_hash_block_size_must_divide_and_be_given_consistently():
    with pytest.raises(ValueError, match="hash_block_size: 12 must divide"):
        kvblock.KVCacheManager(32, kv_cache_groups=[FullAttentionSpec(16), SlidingWindowSpec(32, sliding_window=64)],
                               hash_block_size=12)
    mgr = kvblock.KVCacheManager(32, kv_cache_groups=[FullAttentionSpec(16), SlidingWindowSpec(32, sliding_window=64)])
    assert (mgr.hash_block_size, mgr.scheduler_block_size) == (16, 32)
    with pytest.raises(ValueError, match="hash_block_size: with one KV-cache group"):
        kvblock.KVCacheManager(32, 16, hash_block_size=8)


@pytest.mark.parametrize("hasher_block_size", [8, 32])
def test_request_hashed_at_another_block_size_is_refused(hasher_block_size):
    """Issue 12 item 3: a request hashed at block size 8 on a 16-token manager used to hit
    16 tokens while sharing 8. Now a ValueError naming request.block_hashes, nothing changed."""
    mgr = kvblock.KVCacheManager(32, 16)
    good, _ = _run(mgr, "good", list(range(40)))
    before = _state(mgr, ["good"])
    hasher = get_request_block_hasher(hasher_block_size, get_hash_fn_by_name("sha256"))
    req = Request("bad", list(range(40)), block_hasher=hasher)
    with pytest.raises(ValueError, match=rf"request.block_hashes: .*{hasher_block_size}-token blocks.*hash_block_size is 16"):
        mgr.get_computed_blocks(req)
    with pytest.raises(ValueError, match="request.block_hashes"):
        mgr.allocate_slots(req, 40)
    assert _state(mgr, ["good", "bad"])[:3] == before[:3]
    assert mgr.get_block_ids("bad") == ([],) and mgr.num_requests == 1


def test_foreign_request_with_too_many_hashes_is_refused():
    """A request object kvblock did not build (no hasher block size to read): more hashes
    than num_tokens // hash_block_size means a smaller block size, refused."""
    mgr = kvblock.KVCacheManager(32, 16)
    src = Request("src", list(range(40)), block_hasher=get_request_block_hasher(8, get_hash_fn_by_name("sha256")))

    class Foreign:
        request_id = "f"
        all_token_ids = list(range(40))
        num_tokens = 40
        num_computed_tokens = 0
        block_hashes = list(src.block_hashes)  # 5 hashes of 8-token blocks
        lora_request = None
        cache_salt = None
        mm_features: list = []
        prompt_embeds = None
        skip_reading_prefix_cache = False
        num_in_flight_tokens = 0
        status = kvblock.RequestStatus.WAITING

    with pytest.raises(ValueError, match="5 hashes for 40 tokens"):
        mgr.get_computed_blocks(Foreign())
    assert mgr.block_pool.get_num_free_blocks() == 31


def test_cross_attention_group_allocates_for_encoder_tokens():
    """An encoder-decoder model: the cross-attention group gets blocks for the encoder
    tokens (num_encoder_tokens), never cached."""
    mgr = kvblock.KVCacheManager(
        32, kv_cache_groups=[FullAttentionSpec(16), CrossAttentionSpec(16)], enable_caching=False
    )
    req = Request("a", list(range(20)), block_hasher=mgr.request_block_hasher)
    assert mgr.allocate_slots(req, 20, num_encoder_tokens=40) is not None
    dec, cross = mgr.get_block_ids("a")
    assert len(dec) == 2 and len(cross) == 3
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 31


def test_group_spec_wrapper_and_eagle_flag():
    g = KVCacheGroupSpec(FullAttentionSpec(16), is_eagle_group=True)
    mgr = kvblock.KVCacheManager(32, kv_cache_groups=[g], use_eagle=True)
    assert mgr.kv_cache_groups[0].is_eagle_group
    a, _ = _run(mgr, "a", list(range(48)))
    mgr.free(a)
    b, hit = _run(mgr, "b", list(range(48)) + [1])
    # EAGLE drops the last hit block (it recomputes it): 48 -> 32
    assert hit == 32


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: kvblock.KVCacheManager(100, kv_cache_groups=[FullAttentionSpec(16), FullAttentionSpec(32)],
                                        hash_block_size=0), ValueError, "hash_block_size: must be > 0"),
        (lambda: kvblock.KVCacheManager(100, kv_cache_groups=[FullAttentionSpec(16), FullAttentionSpec(32)],
                                        hash_block_size="8"), TypeError, "hash_block_size: expected int"),
        (lambda: kvblock.KVCacheManager(100, 16, pcp_world_size=0), ValueError, "pcp_world_size: must be > 0"),
        (lambda: kvblock.KVCacheManager(100, 16, dcp_world_size=0), ValueError, "dcp_world_size: must be > 0"),
        (lambda: kvblock.KVCacheManager(100, 16, max_model_len=-5), ValueError, "max_model_len: must be > 0, got -5"),
        (lambda: kvblock.KVCacheManager(100, 16, max_model_len=0), ValueError, "max_model_len: must be > 0, got 0"),
        (lambda: FullAttentionSpec(2**63), ValueError, "block_size: at most 2147483647 tokens per block"),
        (lambda: kvblock.KVCacheManager(40, kv_cache_groups=[FullAttentionSpec(16), CrossAttentionSpec(16)]),
         ValueError, r"kv_cache_groups\[1\]: cross attention is never prefix-cached; .*enable_caching=False"),
    ],
)
def test_constructor_arguments_are_named(make, exc, match):
    """Each bad argument is refused by name, with the argument's own rule (found by a fresh
    user: hash_block_size=0 was a ZeroDivisionError, pcp_world_size=0 named dcp_world_size,
    a huge block size blamed hash_block_size, and cross attention with caching on was built
    and then failed on every call, keeping blocks)."""
    with pytest.raises(exc, match=match):
        make()


def test_decode_context_parallelism_in_kvblocks_own_api():
    """dcp_world_size=2: a block spans 2 x 16 tokens (vLLM's resolve_dcp_kv_block_size), the
    request is hashed at 32 tokens, and a second request hits the first one's full blocks
    (the constructor used to refuse every DCP configuration)."""
    mgr = kvblock.KVCacheManager(100, 16, dcp_world_size=2)
    assert (mgr.hash_block_size, mgr.scheduler_block_size) == (32, 32)
    a, hit = _run(mgr, "a", list(range(100)))
    assert hit == 0 and mgr.get_block_ids("a") == ([1, 2, 3, 4],)
    mgr.free(a)
    b, hit = _run(mgr, "b", list(range(100)))
    assert hit == 96 and mgr.get_block_ids("b")[0][:3] == [1, 2, 3]
    hybrid = kvblock.KVCacheManager(100, kv_cache_groups=[FullAttentionSpec(16), MambaSpec(32, mamba_cache_mode="align")],
                                    dcp_world_size=2)
    assert (hybrid.hash_block_size, hybrid.scheduler_block_size) == (32, 32)

