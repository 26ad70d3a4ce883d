"""The hashing API: vLLM names, NONE_HASH seed rules, input types, bad input, the request
hasher (incremental, resumable, EAGLE lookahead) and the coarse-block view."""

from __future__ import annotations

import array
import pickle
import subprocess
import sys

import numpy as np
import pytest

import kvblock
from kvblock import hashing as H
from kvblock.request import Request
from kvblock.reference import hashing as R

ROOT = bytes(range(32))


def test_get_hash_fn_by_name_errors():
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        H.get_hash_fn_by_name("md5")
    with pytest.raises(ValueError):
        kvblock.hash_blocks([1, 2], 1, algo="builtin")
    assert H.get_hash_fn_by_name("xxhash") is H.xxhash
    assert pickle.loads(pickle.dumps(H.sha256_cbor)) == H.sha256_cbor
    assert repr(H.xxhash_cbor) == "HashFunction('xxhash_cbor')"


@pytest.mark.parametrize(
    "tokens",
    [
        list(range(64)),
        tuple(range(64)),
        range(64),
        np.arange(64, dtype=np.int64),
        np.arange(64, dtype=np.int32),
        np.arange(64, dtype=np.uint32),
        np.arange(64, dtype=np.uint64),
        np.arange(128, dtype=np.int64)[::2] // 2,  # non-contiguous view
        array.array("q", range(64)),
        array.array("i", range(64)),
        array.array("l", range(64)),
        [np.int64(i) for i in range(64)],
    ],
)
def test_token_input_types_agree(tokens):
    want = R.hash_blocks(list(range(64)), 16, algo="sha256", parent=ROOT)
    assert kvblock.hash_blocks(tokens, 16, parent=ROOT) == want


def test_large_and_negative_tokens():
    toks = [2**64 - 1, 2**64, -(2**64), -1, -(2**31) - 1, 2**100, -(2**100), 0]
    for algo in H.ALGORITHMS:
        assert kvblock.hash_blocks(toks, 4, algo=algo, parent=ROOT) == R.hash_blocks(toks, 4, algo=algo, parent=ROOT)
    big = np.array([2**63 + 5, 1, 2, 3], dtype=np.uint64)
    assert kvblock.hash_blocks(big, 4, parent=ROOT) == R.hash_blocks([int(x) for x in big], 4, parent=ROOT)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: kvblock.hash_blocks([1, 2], 0), ValueError, "block_size"),
        (lambda: kvblock.hash_blocks([1, 2], -3), ValueError, "block_size"),
        (lambda: kvblock.hash_blocks([1, 2.5], 1), TypeError, r"token_ids\[1\]"),
        (lambda: kvblock.hash_blocks([1, "2"], 1), TypeError, r"token_ids\[1\]"),
        (lambda: kvblock.hash_blocks([1, True], 1), TypeError, r"token_ids\[1\]"),
        (lambda: kvblock.hash_blocks(np.zeros((2, 4), dtype=np.int64), 1), ValueError, "1-D"),
        (lambda: kvblock.hash_blocks(np.zeros(4, dtype=np.float32), 1), TypeError, "float"),
        (lambda: kvblock.hash_blocks(np.zeros(4, dtype=bool), 1), TypeError, "bool"),
        (lambda: kvblock.hash_blocks("abcd", 1), TypeError, "token_ids"),
        (lambda: kvblock.hash_blocks(42, 1), TypeError, "token_ids"),
        (lambda: kvblock.hash_blocks([1, 2], 1, parent="abc"), TypeError, "parent"),
        (lambda: kvblock.hash_blocks([1, 2], 1, extra_keys=[None]), ValueError, "extra_keys"),
        (lambda: kvblock.hash_blocks([1, 2], 1, extra_keys=[None, [1]]), TypeError, "extra_keys"),
        (lambda: kvblock.hash_blocks([1, 2], 1, extra_keys=[None, (1.5,)]), TypeError, r"extra_keys\[1\]"),
        (lambda: kvblock.hash_blocks([1, 2], 1, extra_keys=[None, ({},)]), TypeError, "dict"),
        (lambda: kvblock.hash_blocks([1, 2], 1.0), TypeError, "block_size"),
        (lambda: H.hash_block_tokens(H.sha256, "p", [1]), TypeError, "parent_block_hash"),
        (lambda: H.hash_block_tokens(H.sha256, ROOT, [1], [("lora",)]), TypeError, "extra_keys"),
        # anything pickle cannot serialize (vLLM's sha256 pickles what it is given)
        (lambda: H.sha256((lambda: 0,)), (pickle.PicklingError, AttributeError), "pickle"),
        (lambda: H.HashFunction("sha1"), ValueError, "valid algorithms"),
    ],
)
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


_ANY_OBJECTS = [(), ("abc",), (None,), {"a": 1}, 3.5, [1, (2, "x")]]


@pytest.mark.parametrize(
    "name,obj",
    [(n, o) for n in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor") for o in _ANY_OBJECTS]
    # a type object pickles (vLLM's own test hashes one) but has no CBOR form
    + [("sha256", (None, bool, [1, 2, 3])), ("xxhash", (None, bool, [1, 2, 3]))],
)
def test_hash_functions_hash_any_object_as_vllm_does(name, obj):
    """Beyond block-hash shapes, kvblock's hash functions serialize what vLLM's would
    (pickle protocol 5, or canonical CBOR) and digest the same bytes."""
    import hashlib
    import pickle

    import cbor2
    import xxhash

    fn = H.get_hash_fn_by_name(name)
    if name.endswith("cbor"):
        data = cbor2.dumps(obj, canonical=True)
    else:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    want = hashlib.sha256(data).digest() if name.startswith("sha256") else xxhash.xxh3_128_digest(data)
    assert fn(obj) == want


def test_any_parent_bytes_and_falsy_parent(seed_env):
    seed_env(None)
    H.init_none_hash(H.sha256)
    # a falsy parent means NONE_HASH, as in vLLM
    assert kvblock.hash_blocks([1, 2, 3, 4], 4, parent=b"") == kvblock.hash_blocks([1, 2, 3, 4], 4)
    for n in (1, 7, 33, 300):
        p = bytes(range(256))[:n] if n <= 256 else b"z" * n
        assert kvblock.hash_blocks([5] * 8, 4, parent=p) == R.hash_blocks([5] * 8, 4, parent=p)


def _none_hash_in_subprocess(algo: str, env_seed: str | None) -> str:
    code = (
        "import kvblock.hashing as H;"
        f"H.init_none_hash(H.get_hash_fn_by_name({algo!r}));"
        "print(H.NONE_HASH.hex(), H.get_none_hash_seed())"
    )
    import os

    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_c01_same_seed_same_hash_in_every_process():
    """CASES.md C01: seed rules across processes."""
    want0 = {
        "sha256": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        "sha256_cbor": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
        "xxhash": "6fb31cc38bba6066183f7f2104b9c051",
        "xxhash_cbor": "1ebe36576dcb573f26b99533a20aaeca",
    }
    for algo, h in want0.items():
        assert _none_hash_in_subprocess(algo, "0").split()[0] == h
    assert _none_hash_in_subprocess("sha256", None).split() == [
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "vllm-none-hash",
    ]
    assert _none_hash_in_subprocess("sha256_cbor", None).split()[0] == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    for algo in ("xxhash", "xxhash_cbor"):
        a, b = _none_hash_in_subprocess(algo, None), _none_hash_in_subprocess(algo, None)
        assert a != b and len(a.split()[1]) == 64 and "vllm-none-hash" not in a


C01_BLOCKS = {
    "0": {
        "sha256": ("762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
                   "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b"),
        "sha256_cbor": ("c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
                        "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6"),
        "xxhash": ("f3856cedd7e636094750c4546e855397", "0c9832567b17003b126077f57e0bb670"),
        "xxhash_cbor": ("0a8577df5ee3430515a8cc1f6e3ac52e", "d152782cb4d753bde718a811a3b75e23"),
    },
    "1": {
        "sha256": ("47bb6bbe6d46d3d305186275131f2909c00ec057f2a260162a2b5ef1961ab88f",
                   "82a3329666db5a8ddc010059d43a7d4850141f5f2fa6a245e1520edcf71f23a8"),
        "sha256_cbor": ("961532873decc0acec6e279db2db001fc3140589b85062781d3f386402e96b66",
                        "4dda8afa18813d8fa155ced5dc29b3e1a1858f7d2b03537acac6caf352c7d542"),
        "xxhash": ("fbbb2183047843b0fe12698bce97f152", "86163bc8d3f11ee9177c3ecf306e870d"),
        "xxhash_cbor": ("0f62b1c201118b936dee18c48a5dc1c4", "da3198bb2d7cf89f7cd65f41ab6ac69f"),
    },
    None: {
        "sha256": ("52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
                   "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde"),
        "sha256_cbor": ("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
                        "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"),
    },
}


@pytest.mark.parametrize("seed", ["0", "1", None])
def test_c01_request_block_hashes(seed_env, seed):
    seed_env(seed)
    for algo, want in C01_BLOCKS[seed].items():
        fn = H.get_hash_fn_by_name(algo)
        H.init_none_hash(fn)
        r = Request("r", list(range(1, 9)), block_hasher=H.get_request_block_hasher(4, fn))
        assert tuple(h.hex() for h in r.block_hashes) == want
        assert H.hash_block_tokens(fn, None, [1, 2, 3, 4]) == H.hash_block_tokens(fn, None, [1, 2, 3, 4])


def test_c03_cancelling_edits_differ():
    blocks = [[100, 200, 300, 400], [131, 199, 300, 400], [100, 231, 299, 400], [100, 200, 331, 399],
              [200, 100, 300, 400]]
    for algo in H.ALGORITHMS:
        fn = H.get_hash_fn_by_name(algo)
        assert len({H.hash_block_tokens(fn, ROOT, b) for b in blocks}) == 5


def test_request_hasher_incremental_equals_batch(seed_env):
    seed_env("0")
    for algo in H.ALGORITHMS:
        fn = H.get_hash_fn_by_name(algo)
        H.init_none_hash(fn)
        R.init_none_hash(R.get_hash_fn_by_name(algo))
        prompt = list(range(1000, 1037))
        feats = [("img", 3, 10), ("vid", 20, 17)]  # the second ends at the prompt's end (37)
        kw = dict(lora_request=kvblock.LoRARequest("l", 1, "/p"), cache_salt="s", mm_features=feats)
        r = Request("r", prompt, block_hasher=H.get_request_block_hasher(8, fn), **kw)
        ref = Request("r", prompt, block_hasher=R.get_request_block_hasher(8, R.get_hash_fn_by_name(algo)), **kw)
        assert r.block_hashes == ref.block_hashes
        for t in range(40):
            r.append_output_token_ids(7 + t)
            ref.append_output_token_ids(7 + t)
            assert r.block_hashes == ref.block_hashes
        r.append_output_token_ids(list(range(30)))
        ref.append_output_token_ids(list(range(30)))
        assert r.block_hashes == ref.block_hashes
        whole = Request("w", r.all_token_ids, block_hasher=H.get_request_block_hasher(8, fn), **kw)
        assert whole.block_hashes == r.block_hashes
        assert len(r.block_hashes) == r.num_tokens // 8


def test_request_hasher_with_foreign_hash_fn(seed_env):
    """A plain callable (vLLM's or the reference's) works through the same hasher."""
    seed_env("0")
    H.init_none_hash(H.sha256)
    a = Request("a", list(range(40)), block_hasher=H.get_request_block_hasher(16, R.sha256))
    b = Request("b", list(range(40)), block_hasher=H.get_request_block_hasher(16, H.sha256))
    assert a.block_hashes == b.block_hashes


def test_eagle_lookahead_hasher(seed_env):
    seed_env("0")
    H.init_none_hash(H.sha256)
    R.init_none_hash(R.sha256)
    for L in (1, 3):
        kw = dict(mm_features=[("img", 5, 6)], cache_salt="abc")
        r = Request("r", list(range(17)), block_hasher=H.get_request_block_hasher(4, H.sha256, L), **kw)
        ref = Request("r", list(range(17)), block_hasher=R.get_request_block_hasher(4, R.sha256, L), **kw)
        assert len(r.block_hashes) == (17 - L) // 4
        assert r.block_hashes == ref.block_hashes
        for t in range(9):
            r.append_output_token_ids(t)
            ref.append_output_token_ids(t)
            assert r.block_hashes == ref.block_hashes


def test_coarse_block_view():
    fine = kvblock.hash_blocks(list(range(64)), 4, parent=ROOT)
    view = H.BlockHashListWithBlockSize(fine, 4, 16)
    assert len(view) == 4
    assert list(view) == [fine[3], fine[7], fine[11], fine[15]]
    assert view[-1] == fine[15] and view[1:3] == [fine[7], fine[11]]
    assert H.resolve_block_hashes(fine, 4, 4) is fine
    assert isinstance(H.resolve_block_hashes(fine, 4, 16), H.BlockHashListWithBlockSize)
    assert H.resolve_block_hashes(view, 4, 16) is view
    assert H.resolve_block_hashes(fine, 4, 16, supports_fine_grained_hash_lookup=True, alignment_tokens=4) is fine
    with pytest.raises(ValueError):
        H.resolve_block_hashes(view, 4, 32)
    with pytest.raises(ValueError):
        H.BlockHashListWithBlockSize(fine, 4, 10)
    fine.extend(kvblock.hash_blocks(list(range(16)), 4, parent=fine[-1]))
    assert len(view) == 5


def test_hash_blocks_releases_gil_and_is_thread_safe():
    import threading

    toks = np.arange(16 * 512, dtype=np.int64)
    want = R.hash_blocks(toks.tolist(), 16, algo="xxhash_cbor", parent=ROOT)
    results = []

    def work():
        for _ in range(3):
            results.append(kvblock.hash_blocks(toks, 16, algo="xxhash_cbor", parent=ROOT))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and all(r == want for r in results)
