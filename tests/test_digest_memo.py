"""The request hasher's digest memo: served digests are exactly the reference's, whatever the
memo holds (tiny memos that evict constantly included), on the per-request and the batch
path; blocks are kept on their second hashing; extra keys bypass it; bad sizes are refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblock import hashing as H
from kvblock.reference import hashing as R
from kvblock.request import LoRARequest, Request

BS = 4


@pytest.fixture
def roots(seed_env):
    seed_env("0")
    H.init_none_hash(H.sha256)
    R.init_none_hash(R.sha256)


def test_kept_on_second_hashing_then_served_as_the_same_objects(roots):
    hasher = H.get_request_block_hasher(BS, H.sha256)
    assert hasher.digest_memo_blocks == H.DEFAULT_DIGEST_MEMO_BLOCKS
    prompt = list(range(100, 133))  # 8 full blocks and one token
    a = Request("a", prompt, block_hasher=hasher)
    assert hasher.digest_memo_info() == (0, 0, 0)  # first sighting: nothing kept
    b = Request("b", prompt, block_hasher=hasher)
    assert hasher.digest_memo_info() == (0, 8, 8)
    c = Request("c", prompt + [5, 6, 7], block_hasher=hasher)
    assert hasher.digest_memo_info() == (8, 8, 8)  # the 8 shared blocks; the 9th is new
    assert a.block_hashes == b.block_hashes == c.block_hashes[:8]
    assert all(x is y for x, y in zip(b.block_hashes, c.block_hashes))
    ref = R.get_request_block_hasher(BS, R.sha256)
    assert c.block_hashes == Request("r", prompt + [5, 6, 7], block_hasher=ref).block_hashes
    hasher.clear_digest_memo()
    assert hasher.digest_memo_info() == (8, 8, 0)
    Request("d", prompt, block_hasher=hasher)
    assert hasher.digest_memo_info()[0] == 8  # forgotten: no new hits


def test_output_blocks_are_hashed_straight_away(roots):
    hasher = H.get_request_block_hasher(BS, H.sha256)
    ref = R.get_request_block_hasher(BS, R.sha256)
    # one full prompt block (memoized on r1, served to r2), outputs complete the next ones
    rs = [Request(f"r{i}", [1, 2, 3, 4, 5], block_hasher=hasher) for i in range(3)]
    refs = [Request(f"r{i}", [1, 2, 3, 4, 5], block_hasher=ref) for i in range(3)]
    for _ in range(2):
        for r, f in zip(rs, refs):
            for t in (6, 7, 8, 9):
                r.append_output_token_ids(t)
                f.append_output_token_ids(t)
            assert r.block_hashes == f.block_hashes
    assert hasher.digest_memo_info() == (1, 1, 1)  # the same output blocks, never memoized


def test_off_and_bad_sizes(roots):
    off = H.get_request_block_hasher(BS, H.sha256, digest_memo_blocks=0)
    for _ in range(3):
        Request("a", list(range(40)), block_hasher=off)
    assert off.digest_memo_blocks == 0 and off.digest_memo_info() == (0, 0, 0)
    assert H.get_request_block_hasher(BS, H.sha256, digest_memo_blocks=5).digest_memo_blocks == 8
    for bad in (-1, 2**24 + 1, 2**70):
        with pytest.raises(ValueError, match="digest_memo_blocks"):
            H.get_request_block_hasher(BS, H.sha256, digest_memo_blocks=bad)
    for bad in (True, "16", 1.5):
        with pytest.raises(TypeError, match="digest_memo_blocks"):
            H.get_request_block_hasher(BS, H.sha256, digest_memo_blocks=bad)
        with pytest.raises(TypeError, match="digest_memo_blocks"):  # checked for any hash function
            H.get_request_block_hasher(BS, R.sha256, digest_memo_blocks=bad)
    with pytest.raises(ValueError, match="digest_memo_blocks"):
        H.get_request_block_hasher(BS, R.sha256, digest_memo_blocks=-1)


def test_the_default_memo_is_for_small_blocks_only(roots):
    assert H.default_digest_memo_blocks(16) == H.DEFAULT_DIGEST_MEMO_BLOCKS == 16384
    assert H.default_digest_memo_blocks(1) == 16384
    for bs in (17, 32, 64, 100, 1024, 1 << 19):  # a lookup costs what the digest it saves does
        assert H.default_digest_memo_blocks(bs) == 0
    with pytest.raises(ValueError, match="block_size"):
        H.default_digest_memo_blocks(0)
    for bs in (16, 64, 1024, 1 << 19, 1 << 40):
        assert H.get_request_block_hasher(bs, H.sha256).digest_memo_blocks == H.default_digest_memo_blocks(bs)


def test_large_blocks_can_ask_for_a_memo(roots):
    big = H.get_request_block_hasher(1024, H.sha256, digest_memo_blocks=1024)
    prompt = list(range(3000))
    ref = Request("r", prompt, block_hasher=R.get_request_block_hasher(1024, R.sha256)).block_hashes
    for _ in range(3):
        assert Request("r", prompt, block_hasher=big).block_hashes == ref
    assert big.digest_memo_info() == (2, 2, 2)
    # asked for explicitly: refused when the keys would pass 1 GiB, not attempted
    with pytest.raises(ValueError, match="digest_memo_blocks.*1024 MiB"):
        H.get_request_block_hasher(1 << 16, H.sha256, digest_memo_blocks=1 << 14)


def test_extra_keys_bypass_the_memo(roots):
    hasher = H.get_request_block_hasher(BS, H.sha256)
    ref = R.get_request_block_hasher(BS, R.sha256)
    prompt = list(range(24))
    kws = [dict(cache_salt="s"), dict(lora_request=LoRARequest("l", 1, "/p")), dict(mm_features=[("img", 2, 5)])]
    for kw in kws:
        for _ in range(3):
            r = Request("r", prompt, block_hasher=hasher, **kw)
            assert r.block_hashes == Request("r", prompt, block_hasher=ref, **kw).block_hashes
    assert hasher.digest_memo_info() == (0, 0, 0)
    lookahead = H.get_request_block_hasher(BS, H.sha256, 2)
    for _ in range(3):
        Request("r", prompt, block_hasher=lookahead)
    assert lookahead.digest_memo_info() == (0, 0, 0)


def test_a_new_root_is_a_new_key(seed_env):
    """Re-initialising NONE_HASH must not serve digests chained from the old root."""
    hasher = H.get_request_block_hasher(BS, H.sha256)
    prompt = list(range(16))
    for seed in ("0", "1", "0"):
        seed_env(seed)
        H.init_none_hash(H.sha256)
        R.init_none_hash(R.sha256)
        for _ in range(3):
            got = Request("r", prompt, block_hasher=hasher).block_hashes
            assert got == Request("r", prompt, block_hasher=R.get_request_block_hasher(BS, R.sha256)).block_hashes
    assert hasher.digest_memo_info()[0] > 0


_prefixes = [list(range(1000, 1000 + 4 * BS)), list(range(2000, 2000 + 3 * BS)), [7] * (2 * BS)]
_request = st.tuples(
    st.sampled_from(range(len(_prefixes))),
    st.integers(0, 4 * BS),  # how much of the prefix
    st.lists(st.integers(0, 9), max_size=3 * BS),  # suffix (few values: suffixes repeat too)
    st.sampled_from([None, "salt"]),
    st.lists(st.integers(0, 5), max_size=2 * BS),  # outputs appended one by one
)


# seed_env only sets the same PYTHONHASHSEED for every example (and restores the roots after)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(_request, min_size=1, max_size=12),
    memo_blocks=st.sampled_from([4, 8, 64, 16384]),
    algo=st.sampled_from(H.ALGORITHMS),
    batch=st.booleans(),
)
def test_memoized_hashes_equal_the_reference(seed_env, reqs, memo_blocks, algo, batch):
    seed_env("0")
    fn, rfn = H.get_hash_fn_by_name(algo), R.get_hash_fn_by_name(algo)
    H.init_none_hash(fn)
    R.init_none_hash(rfn)
    hasher = H.get_request_block_hasher(BS, fn, digest_memo_blocks=memo_blocks)
    ref_hasher = R.get_request_block_hasher(BS, rfn)
    made = []
    for i, (p, n, suffix, salt, outputs) in enumerate(reqs):
        prompt = (_prefixes[p][:n] + suffix) or [1]
        r = Request(f"r{i}", prompt, cache_salt=salt)
        ref = Request(f"r{i}", prompt, cache_salt=salt, block_hasher=ref_hasher)
        r.attach_block_hasher(hasher, hash_now=not batch)
        made.append((r, ref, outputs))
    if batch:
        H.hash_requests([r for r, _, _ in made])
    for r, ref, outputs in made:
        assert r.block_hashes == ref.block_hashes
    for r, ref, outputs in made:
        for t in outputs:
            if batch:
                r._output_token_ids.append(t)
                r._all_token_ids.append(t)
                H.hash_requests([r])
            else:
                r.append_output_token_ids(t)
            ref.append_output_token_ids(t)
            assert r.block_hashes == ref.block_hashes


@pytest.mark.parametrize("algo", H.ALGORITHMS)
def test_batch_of_long_prompts(seed_env, algo):
    """Long prompts go through hash_requests' deferred (parallel when large) path: memoized
    prefixes, salted prompts and plain ones in one call, then per-request updates."""
    seed_env("0")
    fn, rfn = H.get_hash_fn_by_name(algo), R.get_hash_fn_by_name(algo)
    H.init_none_hash(fn)
    R.init_none_hash(rfn)
    hasher = H.get_request_block_hasher(BS, fn, digest_memo_blocks=256)
    ref_hasher = R.get_request_block_hasher(BS, rfn)
    shared = list(range(5000, 5000 + 60 * BS))
    for wave in range(3):
        made = []
        for i in range(12):
            prompt = shared[: (20 + 3 * i) * BS] + [wave, i] * (10 + i)
            salt = "s" if i % 4 == 3 else None
            r = Request(f"w{wave}-{i}", prompt, cache_salt=salt)
            r.attach_block_hasher(hasher, hash_now=False)
            made.append((r, Request(r.request_id, prompt, cache_salt=salt, block_hasher=ref_hasher)))
        assert H.hash_requests([r for r, _ in made]) == sum(len(f.block_hashes) for _, f in made)
        for r, f in made:
            assert r.block_hashes == f.block_hashes
    hits, stores, held = hasher.digest_memo_info()
    assert hits > 0 and 0 < held <= 256


def test_a_long_prompt_hashed_without_the_gil(roots):
    """1,100 new blocks: the rest after the memoized run is hashed with the GIL released."""
    hasher = H.get_request_block_hasher(BS, H.sha256)
    prompt = list(range(1100 * BS))
    ref = Request("r", prompt, block_hasher=R.get_request_block_hasher(BS, R.sha256)).block_hashes
    for n in range(3):
        got = Request("r", prompt, block_hasher=hasher).block_hashes
        assert got == ref
    assert hasher.digest_memo_info() == (1100, 1100, 1100)
    longer = Request("r", prompt + list(range(5000, 5000 + 1030 * BS)), block_hasher=hasher)
    assert longer.block_hashes[:1100] == ref and hasher.digest_memo_info()[0] == 2200
    assert longer.block_hashes == Request(
        "r", longer.prompt_token_ids, block_hasher=R.get_request_block_hasher(BS, R.sha256)).block_hashes


def test_manager_memo_size(seed_env):
    import numpy as np

    from kvblock import KVCacheManager

    seed_env("0")
    assert KVCacheManager(64, 16).request_block_hasher.digest_memo_blocks == 16384
    assert KVCacheManager(64, 16, digest_memo_blocks=0).request_block_hasher.digest_memo_blocks == 0
    assert KVCacheManager(64, 16, digest_memo_blocks=np.int64(100)).request_block_hasher.digest_memo_blocks == 128
    before = (H.NONE_HASH, H._NONE_HASH_ALGO)
    with pytest.raises(ValueError, match="digest_memo_blocks"):
        KVCacheManager(64, 16, hash_algo="xxhash", digest_memo_blocks=-1)
    assert (H.NONE_HASH, H._NONE_HASH_ALGO) == before  # a refused manager changes nothing


def test_batch_on_worker_threads():
    """With 3+ worker threads, hash_requests hashes a step's prompts on them (not on a 2-vCPU
    machine's default): run in a subprocess with RAYON_NUM_THREADS=4 and compare."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os
        from kvblock import _core, hashing as H
        from kvblock.reference import hashing as R
        from kvblock.request import Request
        assert _core.hashing_threads() == 4
        for algo in H.ALGORITHMS:
            fn, rfn = H.get_hash_fn_by_name(algo), R.get_hash_fn_by_name(algo)
            H.init_none_hash(fn); R.init_none_hash(rfn)
            hasher = H.get_request_block_hasher(4, fn, digest_memo_blocks=512)
            ref = R.get_request_block_hasher(4, rfn)
            shared = list(range(7000, 7000 + 4 * 50))
            for wave in range(3):
                prompts = [shared[: 4 * (30 + i)] + [wave, i] * (8 + 2 * i) for i in range(16)]
                salts = [None if i % 5 else "s" for i in range(16)]
                reqs = [Request(f"r{i}", p, cache_salt=s) for i, (p, s) in enumerate(zip(prompts, salts))]
                for r in reqs:
                    r.attach_block_hasher(hasher, hash_now=False)
                n = H.hash_requests(reqs)
                refs = [Request(f"r{i}", p, cache_salt=s, block_hasher=ref) for i, (p, s) in enumerate(zip(prompts, salts))]
                assert n == sum(len(f.block_hashes) for f in refs) >= 512
                assert [r.block_hashes for r in reqs] == [f.block_hashes for f in refs], algo
            assert hasher.digest_memo_info()[0] > 0
        print("ok")
    """)
    env = dict(os.environ, RAYON_NUM_THREADS="4", PYTHONHASHSEED="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_defaults_and_argument_types(roots):
    import numpy as np

    # an XXH3 digest costs about what a lookup does: no memo by default for xxhash*
    assert H.get_request_block_hasher(16, H.xxhash).digest_memo_blocks == 0
    assert H.get_request_block_hasher(16, H.xxhash_cbor).digest_memo_blocks == 0
    assert H.get_request_block_hasher(16, H.sha256_cbor).digest_memo_blocks == 16384
    assert H.get_request_block_hasher(16, H.xxhash, digest_memo_blocks=64).digest_memo_blocks == 64
    assert H.default_digest_memo_blocks(16, "xxhash") == 0
    # ints, numpy ints included, for every count; bools and others are TypeErrors naming it
    assert H.get_request_block_hasher(np.int64(16), H.sha256, np.int32(0)).block_size == 16
    for kw in (dict(block_size=True), dict(block_size=16.0), dict(num_hash_lookahead_tokens="1")):
        args = dict(block_size=16, caching_hash_fn=H.sha256, num_hash_lookahead_tokens=0) | kw
        with pytest.raises(TypeError, match=next(iter(kw))):
            H.get_request_block_hasher(**args)
    with pytest.raises(ValueError, match="num_hash_lookahead_tokens"):
        H.get_request_block_hasher(16, H.sha256, -1)


def test_a_long_prompt_with_overflowing_sets_stays_mostly_served(roots):
    """A shared prompt of half the memo's slots overflows some 4-way sets; their blocks miss
    on every request, but the walk goes on past them. It used to stop after 4 misses in a
    row and hash the rest: this 8,000-block prompt (a fresh user's case) was served 184
    blocks per request."""
    import numpy as np

    hasher = H.get_request_block_hasher(16, H.sha256)
    prompt = np.random.default_rng(100).integers(0, 150000, 8000 * 16).tolist()
    ref = Request("r", prompt, block_hasher=R.get_request_block_hasher(16, R.sha256)).block_hashes
    served = []
    for _ in range(5):
        before = hasher.digest_memo_info()[0]
        assert Request("r", prompt, block_hasher=hasher).block_hashes == ref
        served.append(hasher.digest_memo_info()[0] - before)
    assert served[:2] == [0, 0] and min(served[2:]) >= 0.85 * 8000, served
