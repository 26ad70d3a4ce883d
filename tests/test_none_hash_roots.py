"""Each manager and hasher carries its own root hash (issue 34, item 1).

Building a manager with one algorithm after one with another used to re-initialise the
process-wide ``NONE_HASH`` that the first manager's request hasher read at each call: its hits
on the same prompt dropped from 192 tokens to 0, silently. The process-wide root now serves
vLLM's API only; managers chain from their algorithm's root, fixed when they are built.
"""

from __future__ import annotations

import pytest

from impls import IMPLS
from kvblock.request import Request

PROMPT = list(range(1000, 1200))  # 200 tokens: 12 full blocks of 16, 192 hit tokens


@pytest.fixture(autouse=True)
def restore_roots():
    """Tests here build managers and call init_none_hash: put every root back afterwards."""
    saved = {name: impl.hashing._root_state() for name, impl in IMPLS.items()}
    yield
    for name, impl in IMPLS.items():
        impl.hashing._restore_root_state(saved[name])


def cache_prompt(mgr, rid: str) -> None:
    req = Request(rid, PROMPT, block_hasher=mgr.request_block_hasher)
    blocks, hit, *_ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    mgr.free(req)


def hit_tokens(mgr, rid: str) -> int:
    req = Request(rid, PROMPT, block_hasher=mgr.request_block_hasher)
    return mgr.get_computed_blocks(req)[1]


@pytest.mark.parametrize("impl_name", sorted(IMPLS))
@pytest.mark.parametrize("first", ["sha256", "xxhash"])
@pytest.mark.parametrize("other", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_another_algorithms_manager_keeps_a_managers_hits(impl_name, first, other):
    impl = IMPLS[impl_name]
    a = impl.KVCacheManager(64, 16, hash_algo=first)
    cache_prompt(a, "r0")
    assert hit_tokens(a, "r1") == 192
    b = impl.KVCacheManager(64, 16, hash_algo=other)
    cache_prompt(b, "r2")
    assert hit_tokens(a, "r3") == 192
    assert hit_tokens(b, "r4") == 192


@pytest.mark.parametrize("impl_name", sorted(IMPLS))
def test_init_none_hash_for_another_algorithm_keeps_a_managers_hits(impl_name):
    impl = IMPLS[impl_name]
    a = impl.KVCacheManager(64, 16, hash_algo="sha256")
    cache_prompt(a, "r0")
    impl.hashing.init_none_hash(impl.hashing.get_hash_fn_by_name("xxhash"))
    assert hit_tokens(a, "r1") == 192


@pytest.mark.parametrize("impl_name", sorted(IMPLS))
@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
def test_a_managers_root_is_its_algorithms_and_leaves_none_hash_alone(impl_name, algo):
    h = IMPLS[impl_name].hashing
    h.init_none_hash(h.get_hash_fn_by_name("sha256_cbor"))
    before = h.NONE_HASH
    a = IMPLS[impl_name].KVCacheManager(64, 16, hash_algo=algo)
    b = IMPLS[impl_name].KVCacheManager(64, 16, hash_algo=algo)
    assert h.NONE_HASH == before  # the process-wide root is vLLM's, managers do not set it
    # every manager of one algorithm shares its root (a fleet's hashes agree), which is what
    # hash_blocks chains from, and xxhash's root is 16 bytes, not sha256_cbor's 32
    assert a.none_hash == b.none_hash == h.none_hash_for(h.get_hash_fn_by_name(algo))
    assert len(a.none_hash) == (32 if algo == "sha256" else 16)
    req = Request("r", PROMPT, block_hasher=a.request_block_hasher)
    assert req.block_hashes == h.hash_blocks(PROMPT, 16, algo=algo)


@pytest.mark.parametrize("impl_name", sorted(IMPLS))
def test_init_none_hash_sets_the_root_of_managers_built_after(impl_name, seed_env):
    """vLLM's engine calls init_none_hash first: a manager built after chains from that root."""
    h = IMPLS[impl_name].hashing
    seed_env("7")
    fn = h.get_hash_fn_by_name("xxhash")
    h.init_none_hash(fn)
    mgr = IMPLS[impl_name].KVCacheManager(64, 16, hash_algo="xxhash")
    assert mgr.none_hash == h.NONE_HASH == fn("7")
    vllm_style = Request("v", PROMPT, block_hasher=h.get_request_block_hasher(16, fn))
    assert Request("m", PROMPT, block_hasher=mgr.request_block_hasher).block_hashes == vllm_style.block_hashes


def test_vllm_api_hasher_still_reads_the_process_wide_root(seed_env):
    """kvblock.hashing.get_request_block_hasher without none_hash is vLLM's: init_none_hash
    changes what it makes; with none_hash it keeps its own root."""
    from kvblock import hashing as H

    seed_env("0")
    H.init_none_hash(H.sha256)
    vllm_style = H.get_request_block_hasher(16, H.sha256)
    own = H.get_request_block_hasher(16, H.sha256, none_hash=H.NONE_HASH)
    assert vllm_style.none_hash is None and own.none_hash == H.NONE_HASH
    first = Request("a", PROMPT, block_hasher=vllm_style).block_hashes
    assert Request("b", PROMPT, block_hasher=own).block_hashes == first
    seed_env("1")
    H.init_none_hash(H.sha256)
    assert Request("c", PROMPT, block_hasher=vllm_style).block_hashes != first
    assert Request("d", PROMPT, block_hasher=own).block_hashes == first


@pytest.mark.parametrize("bad", [b"", "root", 3])
def test_bad_none_hash_is_a_type_error(bad):
    from kvblock import _core
    from kvblock import hashing as H

    with pytest.raises(TypeError, match="none_hash"):
        H.get_request_block_hasher(16, H.sha256, none_hash=bad)
    with pytest.raises(TypeError, match="root"):
        _core.RequestBlockHasher(16, H.sha256, 0, H._request_extra_keys, bad)
