"""Replay of the built-in ``apc-peer-v1`` workload against vLLM 0.33.0's recorded trace.

Every implementation in ``tests/impls.py`` must return the same block ids as vLLM for each of
the trace's 129,000 manager calls and reproduce the headline results of the workload's
README §5. The workload generator itself is checked against the shared ``apc_workload.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import pytest

from impls import IMPLS
from kvblock.replay import peer_workload as W

FINGERPRINT = "e1adc1cd1c42a40f37d245eccd477680bf3e4bffd3257b00fe1db5613e488fb4"


def manager_factory(impl):
    return lambda: impl.KVCacheManager(
        W.NUM_BLOCKS, W.BLOCK_SIZE, max_model_len=W.MAX_MODEL_LEN, log_stats=True, hash_algo=W.HASH_ALGO
    )


@pytest.fixture(scope="module", params=sorted(IMPLS) + ["kvblock-batch"])
def replay(request):
    """The full workload run once per implementation (and once through kvblock's batch step
    API: ``allocate_slots_batch`` + ``hash_requests``)."""
    batch = request.param == "kvblock-batch"
    impl = IMPLS["kvblock" if batch else request.param]
    made = []
    factory = manager_factory(impl)
    result = W.run_e2e(lambda: made.append(factory()) or made[-1], hashing_module=impl.hashing, batch=batch)
    result.manager = made[-1]  # the one run (built again under the seeded root), for the digest memo's counters
    result.impl_name = request.param
    return result


def test_every_record_matches_the_vllm_trace(replay, vllm_trace):
    assert len(replay.records) == len(vllm_trace) == 129_000
    for i, (ours, theirs) in enumerate(zip(replay.records, vllm_trace)):
        assert ours == theirs, f"record {i} differs"


def test_headline_results(replay):
    assert replay.fingerprint == FINGERPRINT
    assert (replay.hits, replay.queries, replay.requests) == (1_150_464, 2_048_000, 1000)
    assert round(replay.hit_rate, 4) == 0.5617
    assert replay.steps == 2048
    assert replay.free_blocks == 16_383
    assert replay.map_size == 16_343
    assert replay.num_decode_calls == 127_000
    assert replay.manager_ns == (
        replay.lookup_ns + replay.prefill_alloc_ns + replay.decode_alloc_ns + replay.free_ns
    )
    assert replay.manager_ns > 0 and replay.hashing_ns > 0


def test_digest_memo_serves_the_system_prompt(replay):
    """The 96-block system prompt of 750 requests is kept on its second hashing and served
    to the 748 after; nothing else repeats (outputs and unique prompts are hashed)."""
    hasher = replay.manager.request_block_hasher
    if not hasattr(hasher, "digest_memo_info"):
        pytest.skip("the reference hashes every block")
    hits, stores, held = hasher.digest_memo_info()
    if replay.impl_name == "kvblock":
        assert (hits, stores, held) == (748 * 96, 96, 96)
    else:  # batch: prompts hashed on worker threads (3+) are looked up before any is stored
        assert 700 * 96 <= hits <= 748 * 96 and held == 96


def test_trace_fingerprint_recomputed_from_the_file(vllm_trace):
    """README §5.1: the fingerprint can be recomputed from the trace alone."""
    fp = hashlib.sha256()
    for rec in vllm_trace:
        if rec["op"] == "decode":
            fp.update(("d" + ",".join(map(str, rec["new"]))).encode())
        elif rec["op"] == "prefill":
            fp.update(("h" + ",".join(map(str, rec["hit"]))).encode())
            fp.update(("n" + ",".join(map(str, rec["new"]))).encode())
    assert fp.hexdigest() == FINGERPRINT


@pytest.mark.parametrize("impl_name", sorted(IMPLS))
def test_small_run_options_and_timing_accounting(impl_name):
    """10 requests, 4 at a time, no records, a fake clock that ticks once per reading."""
    impl = IMPLS[impl_name]
    env, root = os.environ.get("PYTHONHASHSEED"), impl.hashing.NONE_HASH
    ticks = itertools.count()
    result = W.run_e2e(
        manager_factory(impl), num_requests=10, max_running=4, record=False,
        timer=lambda: next(ticks), hashing_module=impl.hashing,
    )
    assert result.records == []
    assert result.steps == 3 * 128
    assert (result.hits, result.queries) == (7 * 1536, 10 * 2048)  # 8 shared, the first misses
    # the clock is read around phases: one tick per admission lookup / allocation, per step
    # with decodes, per step with frees, per step with hashing (new prompts, then outputs)
    assert (result.lookup_ns, result.prefill_alloc_ns) == (10, 10)
    assert result.num_decode_calls == 10 * 127
    steps_with_decodes = 3 * 127  # each wave: 127 decode steps after its prefill step
    assert result.decode_alloc_ns == steps_with_decodes
    assert result.free_ns == 3  # one finishing step per wave
    assert result.hashing_ns == 3 + 3 * 128  # a prompt batch per wave + one update per step
    assert os.environ.get("PYTHONHASHSEED") == env and impl.hashing.NONE_HASH == root


@pytest.mark.parametrize("i", [0, 1, 2, 3, 4, 517, 998, 999])
def test_generator_matches_shared_module(workload_module, i):
    wl = workload_module.load()
    spec = workload_module.e2e_request(wl, i)
    assert W.e2e_request_tokens(i) == (spec.prompt, spec.outputs)
    assert W.SEED == wl["seed"] and W.VOCAB_SIZE == wl["vocab_size"]


def test_generator_constants_and_spot_values(workload_module):
    wl = workload_module.load()
    e2e, hashing = wl["e2e"], wl["hashing"]
    assert (W.NUM_REQUESTS, W.PROMPT_LEN, W.SHARED_PREFIX_LEN) == (
        e2e["num_requests"], e2e["prompt_len"], e2e["shared_prefix_len"]
    )
    assert (W.DECODE_TOKENS, W.MAX_RUNNING, W.NUM_BLOCKS, W.MAX_MODEL_LEN, W.HASH_ALGO) == (
        e2e["decode_tokens"], e2e["max_running"], e2e["num_blocks"], e2e["max_model_len"], e2e["hash_algo"]
    )
    assert (W.BLOCK_SIZE, W.PYTHONHASHSEED) == (wl["block_size"], wl["pythonhashseed"])
    assert (W.HASHING_TOKEN_STREAM, W.HASHING_PROMPT_LEN) == (
        hashing["token_stream"], hashing["prompt_len"]
    )
    assert W.hashing_prompt() == workload_module.hashing_prompt(wl)
    assert W.hashing_prompt()[:4] == [119855, 89781, 101546, 13958]
    prompt1, outputs1 = W.e2e_request_tokens(1)
    assert prompt1[:4] == [125946, 98504, 9850, 47441] == W.tokens(0, 0, 4)
    assert outputs1[:3] == [123595, 114322, 50376]
    assert W.e2e_request_tokens(3)[0][:4] == [37218, 33448, 59559, 58215]
    keys = [0, 1, 2**63, 2**64 - 1, 0x123456789ABCDEF]
    assert W.splitmix64(keys).tolist() == [workload_module.splitmix64(k) for k in keys]
