"""The continuous-batching simulator of ``kvblock replay``.

The built-in workload run with the scheduler loop and settings of the shared workload README
§2–3 must give vLLM 0.33.0's result, block id for block id; the other tests check the loop's
rules (token budget, chunked prefill, max running, preemption, arrivals, unservable requests),
the eviction count against the pool's own KV events, and kvblock against the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvblock import Request
from kvblock import hashing as kv_hashing
from kvblock.replay import (
    Replayer, ReplayError, SimConfig, Trace, TraceRequest, builtin_workload, get_impl, replay,
)
from kvblock.replay.expand import expand_block_tokens, synthetic_output_tokens
from kvblock.replay.report import compare_results
from kvblock.replay.workloads import ChatParams, chat_workload, shared_prompt_workload

VLLM_FINGERPRINT = "e1adc1cd1c42a40f37d245eccd477680bf3e4bffd3257b00fe1db5613e488fb4"


def token_trace(specs: list[tuple[Any, ...]], name: str = "t") -> Trace:
    """specs: (prompt tokens, output_len[, arrival_ms[, output tokens]])."""
    reqs = []
    for i, spec in enumerate(specs):
        prompt, n_out = np.asarray(spec[0], dtype=np.int64), spec[1]
        arrival = spec[2] if len(spec) > 2 else 0.0
        outputs = None if len(spec) < 4 else np.asarray(spec[3], dtype=np.int64)
        reqs.append(TraceRequest(index=i, request_id=f"req-{i}", arrival_ms=arrival, prompt_len=len(prompt),
                                 output_len=n_out, prompt_tokens=prompt, output_tokens=outputs))
    reqs.sort(key=lambda r: r.arrival_ms)
    return Trace(name=name, source=name, requests=reqs)


def toks(stream: int, n: int, start: int = 0) -> np.ndarray:
    return expand_block_tokens(np.array([stream]), 4096)[0][start:start + n]


class Recorder:
    """A manager proxy recording the scheduler's calls; step ends are marked by the one
    ``get_num_free_blocks`` read per step."""

    def __init__(self, mgr: Any) -> None:
        self._mgr = mgr
        self.calls: list[tuple] = []
        self.block_pool = self
        self.freed: dict[str, tuple[int, list]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mgr, name)

    def get_num_free_blocks(self) -> int:
        self.calls.append(("step",))
        return self._mgr.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, req):
        return self._mgr.get_computed_blocks(req)

    def allocate_slots(self, req, k, n_hit=0, hit=None):
        new = self._mgr.allocate_slots(req, k, n_hit, hit)
        self.calls.append(("alloc", req.request_id, k, n_hit, new is not None))
        return new

    def free(self, req):
        self.calls.append(("free", req.request_id))
        self.freed[req.request_id] = (req.num_tokens, list(req.block_hashes))
        return self._mgr.free(req)

    def steps(self) -> list[list[tuple]]:
        out, cur = [], []
        for c in self.calls:
            if c[0] == "step":
                out.append(cur)
                cur = []
            else:
                cur.append(c)
        return out


def recording(impl: str = "kvblock", **kwargs):
    managers: list[Any] = []
    base = get_impl(impl)

    def make(num_blocks, block_size, algo):
        m = Recorder(base.make_manager(num_blocks, block_size, algo))
        managers.append(m)
        return m

    return dataclasses.replace(base, make_manager=make), managers


def run(trace: Trace, impl: Any = "kvblock", **cfg) -> Any:
    config = SimConfig(impl=impl if isinstance(impl, str) else impl.name, **cfg)
    return Replayer(impl, config.block_size, config.hash_algo).run(trace, config)


# -- the built-in workload ----------------------------------------------------------------------

def test_builtin_workload_reproduces_vllm():
    """README §2–3 settings: 16384 blocks, max 64 running, no budget, no chunking, no preemption."""
    trace = builtin_workload("shared-prompt")
    cfg = SimConfig(fingerprint=True).with_defaults(trace.defaults, set())
    assert (cfg.num_blocks, cfg.block_size, cfg.max_running, cfg.token_budget, cfg.chunked_prefill, cfg.asap) == (
        16384, 16, 64, None, False, True)
    r = replay(trace, cfg)
    assert (r.hits, r.queries, r.requests_recorded) == (1_150_464, 2_048_000, 1000)
    assert r.fingerprint == VLLM_FINGERPRINT
    assert (r.steps, r.preemptions, r.served, r.unservable) == (2048, 0, 1000, [])
    assert (r.lookup_calls, r.admit_alloc_calls, r.step_alloc_calls, r.free_calls) == (1000, 1000, 127_000, 1000)
    assert r.blocks_hit == 749 * 96 and r.blocks_queried == 1000 * 128
    # first wave: req-0 misses (128 blocks), 47 shared requests hit the 96-block system prompt
    # (32 new blocks each), 16 unique ones miss: 3680 blocks, so the first decode block is 3681
    assert r.usage[0] == 128 + 47 * 32 + 16 * 128 == 3680
    assert r.usage[-1] == 0


def test_builtin_workload_on_the_reference_slice():
    trace = shared_prompt_workload(130)
    cfg = SimConfig(fingerprint=True).with_defaults(trace.defaults, set())
    kv, ref = replay(trace, cfg), replay(trace, dataclasses.replace(cfg, impl="reference"))
    cmp = compare_results(kv, ref)
    assert cmp.identical, cmp.mismatches
    assert kv.hits == 97 * 1536  # 98 of 130 requests share the system prompt; the first misses


def test_eviction_count_matches_the_pools_events():
    """The simulator's O(1) eviction count equals the BlockRemoved events of the pool."""
    base = get_impl("kvblock")
    managers = []

    def make(num_blocks, block_size, algo):
        from kvblock.manager import KVCacheManager

        m = KVCacheManager(num_blocks, block_size, hash_algo=algo, log_stats=True, enable_kv_cache_events=True)
        managers.append(m)
        return m

    impl = dataclasses.replace(base, make_manager=make)
    trace = shared_prompt_workload(300)
    cfg = SimConfig(impl="kvblock", num_blocks=3000, max_running=16, token_budget=None, chunked_prefill=False, asap=True)
    r = Replayer(impl, 16, "sha256").run(trace, cfg)
    removed = sum(1 for e in managers[0].block_pool.take_raw_events() if e.kind == "removed")
    assert r.evictions == removed > 0


# -- the scheduler's rules -----------------------------------------------------------------------

def test_chunked_prefill_and_token_budget():
    trace = token_trace([(toks(1, 2000), 5)])
    assert run(trace, token_budget=512, chunked_prefill=True, asap=True).steps == 4 + 4
    assert run(trace, token_budget=None, asap=True).steps == 1 + 4
    r = run(trace, token_budget=512, chunked_prefill=False, asap=True)
    assert r.served == 0 and len(r.unservable) == 1
    assert "exceed the token budget 512 without chunked prefill" in r.unservable[0].reason


def test_budget_and_max_running_are_respected():
    impl, managers = recording()
    specs = [(np.concatenate([toks(0, 300), toks(10 + i, 200 + 37 * i)]), 20 + i) for i in range(24)]
    r = run(token_trace(specs), impl, num_blocks=4000, max_running=5, token_budget=700, asap=True)
    assert r.served == 24 and r.preemptions == 0
    running: set[str] = set()
    for step in managers[0].steps():
        assert sum(c[2] for c in step if c[0] == "alloc" and c[4]) <= 700
        for c in step:
            if c[0] == "alloc" and c[4]:
                running.add(c[1])
                assert len(running) <= 5
            elif c[0] == "free":
                running.discard(c[1])
    assert r.hits > 0


def test_preemption_requeues_and_resumes():
    """A cache too small for all decodes: the last running request is preempted, freed and
    re-admitted later, its re-admission counted apart (vLLM's preempted_* stats)."""
    specs = [(np.concatenate([toks(0, 256), toks(100 + i, 300)]), 400) for i in range(6)]
    trace = token_trace(specs)
    cfg = dict(num_blocks=160, max_running=6, token_budget=4096, asap=True, fingerprint=True)
    kv = run(trace, **cfg)
    ref = run(trace, "reference", **cfg)
    assert kv.preemptions > 0 and kv.served == 6
    assert kv.preempted_requests == kv.preemptions and kv.preempted_queries > 0
    assert kv.requests_recorded == 6 and kv.queries == 6 * 556
    cmp = compare_results(kv, ref)
    assert cmp.identical, cmp.mismatches
    assert kv.peak_blocks_in_use <= 159


def test_preemption_frees_the_last_running_request():
    impl, managers = recording()
    specs = [(toks(i, 160), 200) for i in range(3)]
    r = run(token_trace(specs), impl, num_blocks=40, max_running=3, token_budget=None, asap=True)
    assert r.preemptions > 0 and r.served == 3
    calls = managers[0].calls
    first_fail = next(i for i, c in enumerate(calls) if c[0] == "alloc" and not c[4])
    assert calls[first_fail][1] == "req-0"
    assert calls[first_fail + 1] == ("free", "req-2")  # the last admitted, not the one allocating


def test_prompt_only_requests_finish_after_prefill():
    """output_length 0: the request leaves when its prompt is computed, sampling nothing."""
    r = run(token_trace([(toks(1, 40), 0), (toks(1, 40), 0)]), asap=True, max_running=1)
    assert r.served == 2 and r.steps == 2 and r.step_alloc_calls == 0
    assert r.hits == 32  # the second prompt hits the first's two full blocks (last token recomputed)


def test_arrivals_follow_timestamps_and_the_clock_jumps_when_idle():
    specs = [(toks(1, 100), 10, 0.0), (toks(2, 100), 10, 10_000.0)]
    r = run(token_trace(specs), step_ms=20.0)
    assert r.steps == 20 and r.sim_time_s == pytest.approx(10.0 + 10 * 0.02)
    squeezed = run(token_trace(specs), step_ms=20.0, time_scale=0.001)
    assert squeezed.steps == 11 and squeezed.sim_time_s == pytest.approx(0.22)
    assert run(token_trace(specs), asap=True).steps == 10


def test_outputs_are_cached_and_hit_by_the_next_turn():
    x, y, z = toks(1, 100), toks(2, 60), toks(3, 50)
    specs = [(x, 60, 0.0, y), (np.concatenate([x, y, z]), 1, 5_000.0)]
    r = run(token_trace(specs), step_ms=20.0)
    # the first request computed 159 tokens (its last output is never fed back): 9 full blocks
    assert r.hits == 9 * 16
    ideal = run(token_trace(specs), ideal=True)
    assert ideal.hits == 6 * 16  # prompts only: the 100-token prompt has 6 full blocks


def test_block_hashes_follow_the_outputs(seed_env):
    """At free time a request's block_hashes equal vLLM's request hasher over prompt + outputs
    (hash-id trace, memoised prompt digests, synthetic output tokens)."""
    seed_env("0")
    kv_hashing.init_none_hash(kv_hashing.sha256)
    impl, managers = recording()
    reqs = [
        TraceRequest(index=i, request_id=f"req-{i}", arrival_ms=0.0, prompt_len=n, output_len=o,
                     hash_ids=np.array(ids, dtype=np.int64))
        for i, (n, o, ids) in enumerate([(1500, 70, [0, 1, 2]), (1100, 33, [0, 1, 7]), (1024, 16, [0, 1])])
    ]
    trace = Trace(name="h", source="h", requests=reqs, trace_block_size=512, format="mooncake")
    run(trace, impl, num_blocks=1000, asap=True)
    hasher = kv_hashing.get_request_block_hasher(16, kv_hashing.sha256)
    for tr in reqs:
        num_tokens, hashes = managers[0].freed[tr.request_id]
        prompt = expand_block_tokens(tr.hash_ids, 512).reshape(-1)[: tr.prompt_len]
        tokens = np.concatenate([prompt, synthetic_output_tokens(tr.index, tr.output_len)])
        assert num_tokens == tr.prompt_len + tr.output_len
        assert hashes == Request(tr.request_id, tokens.tolist(), block_hasher=hasher).block_hashes


def test_unservable_requests_are_reported_not_hung():
    specs = [(toks(1, 100), 5), (toks(2, 1000), 200), (toks(3, 100), 5)]
    r = run(token_trace(specs), num_blocks=60, asap=True)
    assert r.served == 2 and [u.request_id for u in r.unservable] == ["req-1"]
    u = r.unservable[0]
    assert u.blocks_needed == -(-1199 // 16) and "59 usable blocks" in u.reason
    ideal = run(token_trace(specs), num_blocks=60, ideal=True)
    assert ideal.served == 2 and ideal.unservable[0].blocks_needed == -(-1000 // 16)


def test_ideal_mode_holds_one_request_at_a_time():
    specs = [(toks(i % 3, 100 + 50 * i), 7) for i in range(10)]
    r = run(token_trace(specs), ideal=True, num_blocks=500)
    assert r.usage.tolist() == [-(-(100 + 50 * i) // 16) for i in range(10)]
    assert r.steps == r.served == 10 and r.step_alloc_calls == 0


def test_chat_workload_hits_its_answers():
    params = ChatParams(conversations=30, max_turns=4)
    a, b = chat_workload(params), chat_workload(params)
    assert [r.prompt_tokens.tolist() for r in a.requests] == [r.prompt_tokens.tolist() for r in b.requests]
    turns = [r for r in a.requests if r.request_id.endswith("turn-1")]
    assert turns, "some conversation has a second turn"
    scheduled = run(a, num_blocks=None)
    ideal = run(a, num_blocks=None, ideal=True)
    assert scheduled.served == ideal.served == len(a.requests)
    assert scheduled.hits > ideal.hits > 0


def test_invalid_settings_raise_replay_errors():
    trace = token_trace([(toks(1, 10), 1)])
    for bad, message in [
        (dict(num_blocks=1), "^num_blocks must be >= 2"),
        (dict(block_size=0), "^block_size must be > 0"),
        (dict(max_running=0), "^max_running must be >= 1"),
        (dict(token_budget=0), "^token_budget must be >= 1"),
        (dict(step_ms=0.0), "^step_ms must be a finite number > 0"),
        (dict(time_scale=-1.0), "^time_scale must be a finite number > 0"),
        (dict(hash_algo="md5"), "^unknown hash_algo 'md5'"),
        (dict(impl="vllm"), "^unknown impl 'vllm'; choose from kvblock, reference"),
    ]:
        # refused when the config is built (new-user finding L7: it used to be built, and
        # replay() then raised errors worded for the command line)
        with pytest.raises(ReplayError, match=message):
            replay(trace, SimConfig(**bad))
    with pytest.raises(ReplayError, match="unknown --impl"):
        get_impl("fast")
    with pytest.raises(ReplayError, match="unknown workload 'nope'"):
        builtin_workload("nope")


@pytest.mark.parametrize(
    "bad, exc_field, message",
    [
        (dict(num_blocks=-1), "num_blocks", r"^num_blocks must be >= 2 \(block 0 is vLLM's null block\), got -1$"),
        (dict(block_size=0), "block_size", r"^block_size must be > 0, got 0$"),
        (dict(step_ms=-1.0), "step_ms", r"^step_ms must be a finite number > 0, got -1.0$"),
        (dict(num_blocks="5"), "num_blocks", r"^num_blocks must be an int or None, got str$"),
        (dict(block_size=True), "block_size", r"^block_size must be an int, got bool$"),
        (dict(step_ms="20"), "step_ms", r"^step_ms must be a number, got str$"),
        (dict(asap=1), "asap", r"^asap must be a bool, got int$"),
        (dict(retention="lfu"), "retention", r"^unknown retention 'lfu'"),
        (dict(ttl_s=0.0, retention="ttl"), "ttl_s", r"^ttl_s must be > 0, got 0.0$"),
    ],
)
def test_simconfig_checks_its_fields_when_built(bad, exc_field, message):
    """SimConfig refuses a bad field when it is built (``__post_init__``, also through
    ``dataclasses.replace``) with a SettingError (a ReplayError and a ValueError) naming the
    field; the ``kvblock`` command names the option instead."""
    from dataclasses import replace

    from kvblock.replay import SettingError

    with pytest.raises(SettingError, match=message) as info:
        SimConfig(**bad)
    assert isinstance(info.value, ValueError) and info.value.field == exc_field
    assert info.value.option_message.startswith(("--" + exc_field.replace("_", "-"), "unknown --"))
    with pytest.raises(SettingError, match=message):
        replace(SimConfig(), **bad)
