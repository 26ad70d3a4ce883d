"""Token ids held in an int32 buffer (vLLM 0.34's ``TokenBuffer``, an ``array('i')``
subclass) hash and report exactly as the same ids in a list (issue 31).

The Rust request hasher, ``hash_requests``, ``hash_blocks`` and the manager's KV events read
such a buffer in place, without a Python int per token; a buffer of another integer type gives
the same digests, one of floats a ``TypeError``, never a different digest.
"""

from __future__ import annotations

from array import array

import pytest

from kvblock import _core
from kvblock import hashing as H
from kvblock.replay import peer_workload as W
from kvblock.request import Request as KRequest

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def _tokens(n: int, stream: int = 3) -> list[int]:
    return W.tokens(stream, 0, n)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("typecode", ["i", "l", "q", "h", "I"])
def test_hash_blocks_buffer_matches_list(algo, typecode):
    fn = H.HashFunction(algo)
    toks = [t % 30000 for t in _tokens(16 * 9 + 5)]
    want = H.hash_blocks(toks, 16, algo=fn)
    assert H.hash_blocks(array(typecode, toks), 16, algo=fn) == want
    assert _core.hash_blocks(fn, array(typecode, toks), 16, H.none_hash_for(fn), None, 32, 16 * 8) == \
        _core.hash_blocks(fn, toks, 16, H.none_hash_for(fn), None, 32, 16 * 8)


@pytest.mark.parametrize("typecode", ["d", "f"])
def test_float_buffer_is_a_type_error(typecode):
    fn = H.HashFunction("sha256")
    with pytest.raises(TypeError, match="float"):
        H.hash_blocks(array(typecode, [1.0] * 32), 16, algo=fn)


def _request(tokens, hasher, rid="r"):
    r = KRequest(rid, list(tokens), max_tokens=8)
    r.attach_block_hasher(hasher, hash_now=False)
    return r


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("memo", [0, 1024])
def test_request_hasher_buffer_matches_list(block_size, memo):
    fn = H.HashFunction("sha256")
    h = H.get_request_block_hasher(block_size, fn, digest_memo_blocks=memo)
    toks = _tokens(block_size * 12 + 3)
    for rnd in range(3):  # the third round is served from the memo when there is one
        as_list = _request(toks, h)
        as_buf = _request(toks, h)
        as_buf._all_token_ids = array("i", as_buf._all_token_ids)
        want = h(as_list)
        assert len(want) == 12
        assert h(as_buf) == want, rnd
        # decode blocks: from the last hash on
        as_buf.block_hashes.extend(want[:5])
        assert h(as_buf) == want[5:]


def test_request_hasher_other_buffers():
    fn = H.HashFunction("sha256")
    h = H.get_request_block_hasher(16, fn, digest_memo_blocks=64)
    toks = _tokens(16 * 4)
    want = h(_request(toks, h))
    for typecode in ("q", "l", "I", "h"):
        r = _request([t % 30000 for t in toks], h)
        plain = h(r)
        r._all_token_ids = array(typecode, r._all_token_ids)
        assert h(r) == plain, typecode
    r = _request(toks, h)
    r._all_token_ids = array("d", r._all_token_ids)
    with pytest.raises(TypeError):
        h(r)
    assert want == h(_request(toks, h))


def test_hash_requests_buffer_matches_list():
    fn = H.HashFunction("sha256")
    h = H.get_request_block_hasher(16, fn, digest_memo_blocks=256)
    prompts = [_tokens(16 * n + 7, stream=10 + n) for n in (1, 4, 40)]
    lists = [_request(p, h, f"l{i}") for i, p in enumerate(prompts)]
    bufs = [_request(p, h, f"b{i}") for i, p in enumerate(prompts)]
    for r in bufs:
        r._all_token_ids = array("i", r._all_token_ids)
    assert H.hash_requests(lists) == H.hash_requests(bufs) == 45
    assert [r.block_hashes for r in lists] == [r.block_hashes for r in bufs]


# -- vLLM 0.34's own Request, whose token ids are a TokenBuffer ---------------------------------


def _vllm_with_token_buffer():
    vllm = pytest.importorskip("vllm")
    try:
        from vllm.v1.token_buffer import TokenBuffer
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} keeps request token ids in lists")
    return TokenBuffer


@pytest.mark.parametrize("block_size", [16, 64])
def test_vllm_request_hashes_match_stock(block_size):
    TokenBuffer = _vllm_with_token_buffer()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    import kvblock.vllm.plugin as plugin
    from vllm_oracle import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    stock = get_request_block_hasher(block_size, sha256)
    ours = plugin.get_request_block_hasher(block_size, H.HashFunction("sha256"))
    assert isinstance(ours, _core.RequestBlockHasher)
    prompt = _tokens(block_size * 10 + 1)
    for rnd in range(3):  # later rounds: kvblock serves the prompt from its digest memo
        rs = Request(f"s{rnd}", prompt, SamplingParams(max_tokens=64), None, block_hasher=stock)
        rk = Request(f"k{rnd}", prompt, SamplingParams(max_tokens=64), None, block_hasher=ours)
        assert type(rk._all_token_ids) is TokenBuffer
        assert len(rk.block_hashes) == 10
        assert rk.block_hashes == rs.block_hashes
        for t in range(block_size * 2):  # two blocks completed by outputs
            rs.append_output_token_ids(1000 + t)
            rk.append_output_token_ids(1000 + t)
        assert len(rk.block_hashes) == 12
        assert rk.block_hashes == rs.block_hashes


def test_vllm_request_events_match_stock():
    _vllm_with_token_buffer()
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_oracle import A, both, request

    v, k = both([FullAttentionSpec(block_size=4, **A)], 64, 4, 4, enable_kv_cache_events=True)
    for m in (v, k):
        for rid, toks in (("a", list(range(1, 19))), ("b", list(range(1, 11)) + [50, 51, 52])):
            r = request(rid, toks, 4)
            blocks, hit, _ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            for t in range(6):
                r.append_output_token_ids(900 + t)
                assert m.allocate_slots(r, 1, num_lookahead_tokens=0) is not None
                r.num_computed_tokens += 1
    ev, ek = v.take_events(), k.take_events()
    assert ev and ek == ev
    assert any(len(e.token_ids) for e in ek if hasattr(e, "token_ids"))
