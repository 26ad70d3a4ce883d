"""Request hashing from int32 token buffers (issue 31): kvblock's request hasher on a prompt
held in a list vs in an ``array('i')`` (vLLM 0.34's ``TokenBuffer`` is one), and, where
vLLM 0.34 is installed, vLLM's own hasher vs kvblock's on a real ``Request`` (whose token ids
are a ``TokenBuffer``).

Each round hashes the 128 (block size 16) or 32 (64) full blocks of 16 fresh 2,048-token
prompts, with no digest memo (every block hashed: what is measured is reading the ids and
hashing them); the hasher does not change the request, so the same requests serve every
round. Times are per request.
"""

from __future__ import annotations

from array import array

import pytest

from kvblock import hashing as H
from kvblock.replay import peer_workload as W
from kvblock.request import Request as KRequest

BATCH = 16
SIZES = (16, 64)


def _prompts() -> list[list[int]]:
    return [W.tokens(910_000 + j, 0, W.PROMPT_LEN) for j in range(BATCH)]


def _kvblock_requests(kind: str, block_size: int):
    h = H.get_request_block_hasher(block_size, H.HashFunction("sha256"), digest_memo_blocks=0)
    reqs = []
    for j, p in enumerate(_prompts()):
        r = KRequest(f"r{j}", p, max_tokens=8)
        if kind == "array":
            r._all_token_ids = array("i", r._all_token_ids)
        reqs.append(r)
    return h, reqs


def _hash_all(h, reqs) -> int:
    n = 0
    for r in reqs:
        n += len(h(r))
    return n


_TIMES: dict[tuple[str, int], float] = {}


@pytest.mark.parametrize("block_size", SIZES)
@pytest.mark.parametrize("kind", ["list", "array"])
def test_kvblock_hasher_list_vs_array(benchmark, report_line, kind, block_size):
    h, reqs = _kvblock_requests(kind, block_size)
    assert _hash_all(h, reqs) == BATCH * W.PROMPT_LEN // block_size
    benchmark.group = f"kvblock request hasher, 2,048-token prompt, block size {block_size}: list vs array('i')"
    benchmark.extra_info["impl"] = kind
    benchmark.pedantic(_hash_all, args=(h, reqs), rounds=200, iterations=1, warmup_rounds=5)
    _TIMES[(kind, block_size)] = benchmark.stats.stats.median / BATCH
    if kind == "array" and ("list", block_size) in _TIMES:
        lst, arr = _TIMES[("list", block_size)], _TIMES[("array", block_size)]
        report_line(f"kvblock request hasher, block size {block_size}: list {lst * 1e6:.1f} µs, array('i') "
                    f"{arr * 1e6:.1f} µs per 2,048-token request (medians): array/list time {arr / lst:.2f}")


def _vllm_token_buffer_requests(block_size: int):
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    try:
        from vllm.v1.token_buffer import TokenBuffer
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} keeps request token ids in lists")
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing as vhash
    from vllm.v1.core import kv_cache_utils as vku
    from vllm.v1.request import Request

    from kvblock.vllm.originals import original

    stock_factory = original(vku, "get_request_block_hasher")
    init = original(vku, "init_none_hash")
    init(vhash.sha256)
    hashers = {
        "vllm": stock_factory(block_size, vhash.sha256),
        # vLLM's root; no memo, as vLLM has none: every block is hashed each round
        "kvblock": H.get_request_block_hasher(block_size, H.HashFunction("sha256"), digest_memo_blocks=0,
                                              none_hash=bytes(vku.NONE_HASH)),
    }
    params = SamplingParams(max_tokens=8)
    reqs = [Request(f"v{j}", p, params, None) for j, p in enumerate(_prompts())]
    assert type(reqs[0]._all_token_ids) is TokenBuffer
    return hashers, reqs


@pytest.mark.parametrize("block_size", SIZES)
@pytest.mark.parametrize("impl", ["vllm", "kvblock"])
def test_vllm034_hasher_on_token_buffer(record, impl, block_size):
    hashers, reqs = _vllm_token_buffer_requests(block_size)
    want = [hashers["vllm"](r) for r in reqs]
    assert [hashers["kvblock"](r) for r in reqs] == want
    h = hashers[impl]
    record(f"vLLM 0.34 Request (TokenBuffer), 2,048-token prompt, block size {block_size}: request hasher",
           impl, _hash_all, h, reqs, per=BATCH, rounds=60 if impl == "vllm" else 200)
