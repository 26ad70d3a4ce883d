"""Verify on hit (``KVCacheManager(verify_hits=True)``): a collision of the chained block hash
can never hand a request another prompt's KV.

Real 128-bit collisions cannot be produced, so these tests force them with deliberately weak
block hashers (a hash of each block's own tokens without its parent, one that ignores the
tokens, one that ignores extra keys). Each collision case runs with verify off too, where the
foreign blocks *are* handed out: the same assertion fails there, so the test can fail. The
pure-Python reference implements the same semantics and is checked against the Rust manager
here and in ``tests/test_retention_lockstep.py``.
"""

from __future__ import annotations

import hashlib
import random

import pytest

import kvblock
from kvblock import hashing as kv_hashing
from kvblock.reference.manager import KVCacheManager as RefManager
from kvblock.request import Request, RequestStatus
from kvblock.specs import FullAttentionSpec, SlidingWindowSpec


def unchained(bs: int):
    """Each block hashed from its own tokens only: blocks with equal tokens collide whatever
    comes before them (a collision of the chain, not of the block)."""

    def h(req):
        toks = req.all_token_ids
        return [
            hashlib.sha256(repr(tuple(toks[i * bs:(i + 1) * bs])).encode()).digest()
            for i in range(len(req.block_hashes), len(toks) // bs)
        ]

    h.block_size = bs
    return h


def positional(bs: int):
    """Block ``i`` hashes to a constant of ``i``: every prompt collides with every other."""

    def h(req):
        return [hashlib.sha256(b"pos%d" % i).digest() for i in range(len(req.block_hashes), req.num_tokens // bs)]

    h.block_size = bs
    return h


def admit(mgr, req):
    blocks, n, _ = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    return blocks.get_block_ids()[0] if n else [], n


@pytest.mark.parametrize("verify", [False, True])
def test_a_foreign_parent_is_refused(verify):
    """B = C's first block + A's second block's tokens. Under the unchained hasher both of B's
    hashes are cached; B's block 1 has B's tokens but was computed after A's block 0, not
    C's: its parent id differs. Token comparison alone would let it through."""
    hs = unchained(2)
    mgr = kvblock.KVCacheManager(16, 2, verify_hits=verify)
    a = Request("A", [1, 2, 5, 6, 9], block_hasher=hs)
    c = Request("C", [3, 4, 8], block_hasher=hs)
    admit(mgr, a)
    admit(mgr, c)
    (a0, a1, _), (c0, _) = mgr.get_block_ids("A")[0], mgr.get_block_ids("C")[0]
    b = Request("B", [3, 4, 5, 6, 7], block_hasher=hs)
    blocks, n, _ = mgr.get_computed_blocks(b)
    hit = blocks.get_block_ids()[0]
    assert mgr.probe(b) == n
    if verify:
        assert (hit, n) == ([c0], 2)
        assert mgr.hit_verification_failures == 1
    else:
        # the foreign block A1 (KV of [1, 2, 5, 6]) is handed to B: what verify prevents
        assert (hit, n) == ([c0, a1], 4)
        assert mgr.hit_verification_failures == 0


@pytest.mark.parametrize("verify", [False, True])
def test_colliding_tokens_are_refused_and_nothing_is_touched(verify):
    hs = positional(4)
    mgr = kvblock.KVCacheManager(32, 4, verify_hits=verify, log_stats=True)
    a = Request("A", list(range(100, 113)), block_hasher=hs)
    admit(mgr, a)
    a_cached = mgr.get_block_ids("A")[0][:3]
    mgr.free(a)
    pool = mgr.block_pool
    before = ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()], pool.get_num_free_blocks())
    b = Request("B", list(range(200, 213)), block_hasher=hs)
    assert b.block_hashes == a.block_hashes[: len(b.block_hashes)]  # the forced collision
    blocks, n, _ = mgr.get_computed_blocks(b)
    # a lookup touches nothing (no LRU move) either way
    assert ([x.block_id for x in pool.free_block_queue.get_all_free_blocks()], pool.get_num_free_blocks()) == before
    if verify:
        assert n == 0 and mgr.hit_verification_failures == 1
        assert mgr.probe(b) == 0 and mgr.hit_verification_failures == 1  # probe counts nothing
        got, _ = admit(mgr, b)
        assert got == []
        # B computed its own blocks: none of A's cached ones is in its table
        assert not set(mgr.get_block_ids("B")[0]) & set(a_cached)
    else:
        assert n == 12 and mgr.hit_verification_failures == 0


def test_verified_hits_still_hit():
    """Without collisions verify changes no hit: the same prompt, a shared prefix, EAGLE."""
    for use_eagle in (False, True):
        mgr = kvblock.KVCacheManager(64, 4, verify_hits=True, use_eagle=use_eagle)
        plain = kvblock.KVCacheManager(64, 4, use_eagle=use_eagle)
        for m in (mgr, plain):
            h = m.request_block_hasher
            admit(m, Request("A", list(range(21)), block_hasher=h))
        for m in (mgr, plain):
            h = m.request_block_hasher
            admit(m, Request("B", list(range(16)) + [99] * 5, block_hasher=h))
        assert mgr.get_block_ids("B") == plain.get_block_ids("B")
        assert mgr.hit_verification_failures == 0


def test_extra_keys_are_compared():
    """A hasher that ignores the cache salt (and LoRA) lets salted prompts collide; the records
    keep the extra keys, so the other salt's blocks are refused."""
    base = kv_hashing.get_request_block_hasher(4, kv_hashing.get_hash_fn_by_name("sha256"))

    def saltless(req):
        salt, req.cache_salt = req.cache_salt, None
        try:
            return base(req)
        finally:
            req.cache_salt = salt

    saltless.block_size = 4
    for verify in (False, True):
        mgr = kvblock.KVCacheManager(32, 4, verify_hits=verify)
        admit(mgr, Request("A", list(range(13)), cache_salt="alice", block_hasher=saltless))
        b = Request("B", list(range(13)), cache_salt="bob", block_hasher=saltless)
        same = Request("A2", list(range(13)), cache_salt="alice", block_hasher=saltless)
        assert b.block_hashes == same.block_hashes
        assert mgr.get_computed_blocks(b)[1] == (0 if verify else 12)
        assert mgr.get_computed_blocks(same)[1] == 12


def test_evicted_and_recached_blocks_get_new_records():
    """A's blocks are evicted and reused by B (colliding hashes, other tokens), which caches
    them: A's lookup now finds B's blocks under its hashes and is refused; B's own hits pass."""
    hs = positional(2)
    mgr = kvblock.KVCacheManager(4, 2, verify_hits=True)  # 3 usable blocks
    a = Request("A", [1, 2, 3, 4, 5], block_hasher=hs)
    admit(mgr, a)
    mgr.free(a)
    b = Request("B", [7, 8, 9, 10, 11], block_hasher=hs)
    blocks, n, _ = mgr.get_computed_blocks(b)
    assert n == 0 and mgr.hit_verification_failures == 1
    admit(mgr, b)  # looks up again: a second refusal
    mgr.free(b)
    assert mgr.get_computed_blocks(Request("A'", [1, 2, 3, 4, 5], block_hasher=hs))[1] == 0
    assert mgr.hit_verification_failures == 3
    assert mgr.get_computed_blocks(Request("B'", [7, 8, 9, 10, 11], block_hasher=hs))[1] == 4


def test_admit_batch_verifies():
    hs = positional(2)
    for verify in (False, True):
        mgr = kvblock.KVCacheManager(32, 2, verify_hits=verify)
        admit(mgr, Request("A", [1, 2, 3, 4, 5], block_hasher=hs))
        reqs = [Request("B", [6, 7, 8, 9, 0], block_hasher=hs), Request("C", [1, 2, 3, 4, 0], block_hasher=hs)]
        n, hit_tokens, _, hit_ids, _ = mgr.admit_batch(reqs)
        assert n == 2
        assert hit_tokens.tolist() == ([0, 4] if verify else [4, 4])
        assert mgr.hit_verification_failures == (1 if verify else 0)


def test_hybrid_full_attention_groups():
    """Two full-attention groups (looked up together): each group's chain is verified."""
    hs = positional(4)
    for verify in (False, True):
        mgr = kvblock.KVCacheManager(64, kv_cache_groups=[FullAttentionSpec(4), FullAttentionSpec(4)], verify_hits=verify)
        admit(mgr, Request("A", list(range(9)), block_hasher=hs))
        admit(mgr, Request("B", list(range(8)) + [5], block_hasher=hs))  # true prefix: hits
        blocks, n, _ = mgr.get_computed_blocks(Request("C", list(range(50, 59)), block_hasher=hs))
        assert n == (0 if verify else 8)
        assert mgr.get_block_ids("B")[0][:2] == mgr.get_block_ids("A")[0][:2]


def test_tokens_beyond_int64_never_verify():
    big = 2**64 + 5
    mgr = kvblock.KVCacheManager(16, 2, verify_hits=True)
    h = mgr.request_block_hasher
    admit(mgr, Request("A", [1, 2, big, 4, 5], block_hasher=h))
    blocks, n, _ = mgr.get_computed_blocks(Request("B", [1, 2, big, 4, 5], block_hasher=h))
    assert n == 2  # block 0 verifies, block 1 holds a token beyond int64: not provable
    assert mgr.hit_verification_failures == 1


def test_layouts_it_cannot_verify_are_refused():
    for kw in (
        dict(block_size=4, sliding_window=8),
        dict(kv_cache_groups=[FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8)]),
        dict(kv_cache_groups=[FullAttentionSpec(8), FullAttentionSpec(4)], hash_block_size=4),
    ):
        with pytest.raises(ValueError, match="verify_hits"):
            kvblock.KVCacheManager(16, verify_hits=True, **kw)
    with pytest.raises(ValueError, match="verify_hits"):
        RefManager(16, 4, sliding_window=8, verify_hits=True)


def test_bad_requests_change_nothing():
    mgr = kvblock.KVCacheManager(16, 2, verify_hits=True)
    h = mgr.request_block_hasher
    admit(mgr, Request("A", [1, 2, 3, 4, 5], block_hasher=h))
    pool = mgr.block_pool
    snap = lambda: ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],  # noqa: E731
                    [pool.blocks[i].ref_cnt for i in range(16)], mgr.num_requests, mgr.hit_verification_failures)
    before = snap()

    class NoTokens:
        request_id = "X"
        num_computed_tokens = 0
        num_tokens = 5
        block_hashes = Request("Y", [1, 2, 3, 4, 5], block_hasher=h).block_hashes
        skip_reading_prefix_cache = False
        status = RequestStatus.WAITING

    with pytest.raises(TypeError, match="_all_token_ids"):
        mgr.get_computed_blocks(NoTokens())
    with pytest.raises(TypeError, match="_all_token_ids"):
        mgr.allocate_slots(NoTokens(), 5)
    bad = Request("Z", [1, 2, 3, 4, 5], block_hasher=h)
    bad.mm_features = ["not a feature"]  # the extra-keys function raises on it
    with pytest.raises(Exception):
        mgr.allocate_slots(bad, 5)
    assert snap() == before
    # lookups by hashes alone cannot verify: refused
    with pytest.raises(ValueError, match="verify_hits"):
        mgr._find_longest_cache_hit(list(bad.block_hashes), 4)


def test_verify_matches_the_reference_under_collisions():
    """A random workload under a colliding hasher: the Rust manager and the reference agree
    on every hit, table and failure count, and no hit block is ever foreign (its true prefix,
    tracked here, equals the request's)."""
    rng = random.Random(7)
    for hasher in (unchained, positional):
        for verify in (True, False):
            fast = kvblock.KVCacheManager(24, 2, verify_hits=verify)
            ref = RefManager(24, 2, verify_hits=verify)
            hs = hasher(2)
            truth: dict[int, tuple[int, tuple[int, ...]]] = {}
            foreign = 0
            live = []
            for i in range(150):
                prompt = [rng.randrange(3) for _ in range(rng.randrange(2, 9))]
                a, b = (Request(f"r{i}", prompt, block_hasher=hs) for _ in range(2))
                fb, fn, _ = fast.get_computed_blocks(a)
                rb, rn, _ = ref.get_computed_blocks(b)
                ids = fb.get_block_ids()[0] if fn else []
                assert (ids, fn) == ([x.block_id for x in rb.blocks[0]] if rn else [], rn)
                pool = fast.block_pool
                for j, blk in enumerate(ids):
                    if truth.get(blk) != (pool.block_generation(blk), tuple(prompt[: (j + 1) * 2])):
                        foreign += 1
                na = fast.allocate_slots(a, a.num_tokens - fn, fn, fb)
                nb = ref.allocate_slots(b, b.num_tokens - rn, rn, rb)
                assert (na is None) == (nb is None)
                if na is not None:
                    for j, blk in enumerate(fast.get_block_ids(a.request_id)[0]):
                        if (j + 1) * 2 <= len(prompt) and truth.get(blk, (None,))[0] != pool.block_generation(blk):
                            truth[blk] = (pool.block_generation(blk), tuple(prompt[: (j + 1) * 2]))
                    live.append((a, b))
                while live and (na is None or rng.random() < 0.5):
                    x, y = live.pop(rng.randrange(len(live)))
                    fast.free(x)
                    ref.free(y)
                    na = 0
                assert fast.hit_verification_failures == ref.hit_verification_failures
            if verify:
                assert foreign == 0 and fast.hit_verification_failures > 0
            else:
                assert foreign > 0  # the colliding hasher does hand out foreign KV without verify

