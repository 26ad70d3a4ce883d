"""Property tests: the Rust serializers equal ``pickle`` / ``cbor2`` byte for byte, and Rust
chains equal the pure-Python reference on random tokens (0…2^64, negatives, beyond 64 bits),
block sizes 1, 4, 16, and random extra keys (LoRA, 1–3 multimodal items with negative offsets,
long unicode salts, prompt-embeds digests), including repeated objects that pickle memoizes."""

from __future__ import annotations

import pickle

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvblock
from kvblock import hashing as H
from kvblock.reference import hashing as R

ALGOS = list(H.ALGORITHMS)
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

token_ints = st.one_of(
    st.integers(0, 255),
    st.integers(0, 2**17),
    st.integers(-(2**31), 2**31),
    st.integers(0, 2**64),
    st.integers(-(2**64), 2**64),
    st.integers(-(2**80), 2**80),
)

# Objects that pickle memoizes are drawn from a small pool, so one block can hold the same
# str / bytes object twice (a BINGET in pickle), as a LoRA name reused as a salt would.
strings = st.one_of(st.text(max_size=8), st.text(min_size=200, max_size=400), st.sampled_from(["a", "lora", "mm", "x/y"]))


@st.composite
def extra_keys_for_block(draw, pool):
    keys = []
    if draw(st.booleans()):
        keys.append(("lora", draw(st.sampled_from(pool)), draw(st.sampled_from(pool))))
    for _ in range(draw(st.integers(0, 3))):
        keys.append(("mm", draw(st.sampled_from(pool)), draw(st.integers(-2000, 2000))))
    if draw(st.booleans()):
        keys.append(("cache_salt", draw(st.sampled_from(pool))))
    if draw(st.booleans()):
        keys.append(("prompt_embeds", draw(st.binary(min_size=32, max_size=32))))
    return tuple(keys) if keys else None


@st.composite
def chains(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    tokens = draw(st.lists(token_ints, max_size=70))
    n = len(tokens) // block_size
    pool = draw(st.lists(strings, min_size=1, max_size=4))
    extras = None
    if draw(st.booleans()):
        extras = [draw(extra_keys_for_block(pool)) for _ in range(n)]
    parent = draw(st.one_of(st.none(), st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32),
                            st.binary(min_size=1, max_size=40)))
    return tokens, block_size, extras, parent


@pytest.fixture(autouse=True)
def _profile():
    settings.load_profile("long" if __import__("os").environ.get("KVBLOCK_LONG") else "ci")


@pytest.mark.parametrize("algo", ALGOS)
@given(case=chains())
@settings(max_examples=250, deadline=None)
def test_chain_matches_reference(algo, case):
    tokens, block_size, extras, parent = case
    root = bytes(range(32)) if parent is None else parent
    got = kvblock.hash_blocks(tokens, block_size, algo=algo, parent=root, extra_keys=extras)
    want = R.hash_blocks(tokens, block_size, algo=algo, parent=root, extra_keys=extras)
    assert got == want
    assert len(got) == len(tokens) // block_size


values = st.recursive(
    st.one_of(st.none(), st.booleans(), token_ints, st.text(max_size=20), st.binary(max_size=40)),
    lambda children: st.lists(children, max_size=5).map(tuple),
    max_leaves=25,
)


@given(v=values)
@settings(max_examples=400, deadline=None)
def test_serializers_match_pickle_and_cbor2(v):
    assert H.sha256.serialize(v) == pickle.dumps(v, protocol=5)
    assert H.sha256_cbor.serialize(v) == cbor2.dumps(v, canonical=True)
    assert H.xxhash(v) == R.xxhash(v)
    assert H.sha256_cbor(v) == R.sha256_cbor(v)


@given(pool=st.lists(strings, min_size=1, max_size=3), data=st.data())
@settings(max_examples=300, deadline=None)
def test_pickle_memo_by_identity(pool, data):
    """Repeated objects become BINGET back-references exactly where CPython's pickler puts them."""
    shared_bytes = data.draw(st.binary(max_size=8))
    items = []
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["str", "bytes", "tuple"]))
        if kind == "str":
            items.append(data.draw(st.sampled_from(pool)))
        elif kind == "bytes":
            items.append(shared_bytes)
        else:
            items.append(tuple(data.draw(st.lists(st.sampled_from(pool), max_size=3))))
    if items and data.draw(st.booleans()):
        items.append(items[0])  # the very same object again
    obj = (b"\x01" * 32, (1, 2, 3, 4), tuple(items))
    assert H.sha256.serialize(obj) == pickle.dumps(obj, protocol=5)
    assert H.sha256(obj) == R.sha256(obj)


def test_memo_of_repeated_tag_literal():
    keys = (("mm", "img-a", -13), ("mm", "img-b", 12))
    assert keys[0][0] is keys[1][0]
    obj = (b"\x00" * 32, tuple(range(16)), keys)
    data = H.sha256.serialize(obj)
    assert data == pickle.dumps(obj, protocol=5)
    assert b"h" in data[data.index(b"img-a"):]  # the second "mm" is a BINGET


def test_many_memo_entries_use_long_binget():
    strs = [str(i) * 3 for i in range(300)]
    obj = (b"p" * 32, (), tuple(("mm", s, i) for i, s in enumerate(strs)) + (("mm", strs[299], 1),))
    assert H.sha256.serialize(obj) == pickle.dumps(obj, protocol=5)


@pytest.mark.parametrize("n_tokens", [13100, 13106, 13107, 13108, 20000, 30000])
def test_frames_split_at_64k(n_tokens):
    """Blocks whose pickle exceeds 64 KiB are framed exactly as CPython frames them."""
    toks = tuple(range(70000, 70000 + n_tokens))
    obj = (b"x" * 32, toks, None)
    assert H.sha256.serialize(obj) == pickle.dumps(obj, protocol=5)
    assert kvblock.hash_blocks(list(toks), n_tokens, algo="xxhash", parent=b"x" * 32) == [R.xxhash(obj)]


@pytest.mark.parametrize("size", [255, 256, 65535, 65536, 70000])
def test_large_str_and_bytes_bypass_frames(size):
    s = "é" * (size // 2) + "a" * (size % 2)
    obj = (b"x" * 16, (1, 2), (("cache_salt", s), ("prompt_embeds", b"\x07" * size)))
    assert H.sha256.serialize(obj) == pickle.dumps(obj, protocol=5)
    assert H.sha256_cbor.serialize(obj) == cbor2.dumps(obj, canonical=True)


def test_surrogates_pickle_but_not_cbor():
    s = "a\ud800b"
    obj = (b"x" * 32, (1,), (("cache_salt", s),))
    assert H.sha256.serialize(obj) == pickle.dumps(obj, protocol=5)
    with pytest.raises(ValueError):
        H.sha256_cbor(obj)
    with pytest.raises(Exception):
        cbor2.dumps(obj, canonical=True)


@pytest.mark.parametrize("algo", ALGOS)
def test_parent_object_reused_in_extra_keys(algo):
    """A parent that is the very same object as an extra key pickles as a back-reference."""
    for parent in (b"\x00" * 32, b"\x07", bytes(16)):
        extras = [(("prompt_embeds", parent),), None]
        got = kvblock.hash_blocks([0] * 8, 4, algo=algo, parent=parent, extra_keys=extras)
        assert got == R.hash_blocks([0] * 8, 4, algo=algo, parent=parent, extra_keys=extras)
        fn = H.get_hash_fn_by_name(algo)
        assert H.hash_block_tokens(fn, parent, [0] * 4, extras[0]) == R.hash_block_tokens(
            R.get_hash_fn_by_name(algo), parent, [0] * 4, extras[0]
        )


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n_blocks", [1023, 1024, 1500])
def test_gil_held_and_released_paths_agree(algo, n_blocks):
    """Below 1024 blocks hash_blocks keeps the GIL and builds the bytes while it hashes; from
    1024 it hashes without the GIL. Both give the reference's digests, with plain blocks and
    blocks with extra keys mixed, and ids of every width."""
    import random

    rng = random.Random(n_blocks)
    bs = 4
    widths = [0, 23, 255, 65535, 2**31 - 1, 2**31, 2**63 - 1, -1, -(2**31), -(2**63)]
    toks = [rng.choice(widths) + rng.randrange(-2, 3) for _ in range(n_blocks * bs + 3)]
    toks = [max(min(t, 2**63 - 1), -(2**63)) for t in toks]
    extras = [None] * n_blocks
    for i in rng.sample(range(n_blocks), 40):
        extras[i] = (("lora", 7),) if i % 2 else (("cache_salt", "s" * (i % 5 + 1)),)
    parent = bytes(range(32))
    got = kvblock.hash_blocks(toks, bs, algo=algo, parent=parent, extra_keys=extras)
    assert got == R.hash_blocks(toks, bs, algo=algo, parent=parent, extra_keys=extras)
    arr = np.array(toks, dtype=np.int64)
    assert kvblock.hash_blocks(arr, bs, algo=algo, parent=parent) == R.hash_blocks(toks, bs, algo=algo, parent=parent)
