"""Hybrid models (issue 12 item 5): manager time per scheduler step, vLLM 0.33.0's own
``KVCacheManager`` vs ``kvblock.vllm.KVCacheManager`` (vLLM's API on kvblock's Rust
coordinator) and ``kvblock.KVCacheManager(kv_cache_groups=...)`` (kvblock's own API, on
``kvblock.Request``), in one run, same call sequence, results asserted identical.

The workloads are the shared one (../shared/workload/README.md §3: 1,000 requests of 2,048
tokens, 75% behind a 1,536-token system prompt, 128 outputs each, 64 running, 16,384 blocks of
16 tokens) on two hybrid models' KV-cache groups:

* gpt-oss-like: a full-attention group and a 128-token sliding-window group (vLLM groups
  gpt-oss's alternating layers so);
* Qwen3-Next-like: three Mamba groups (``mamba_cache_mode="align"``, the mode vLLM uses for
  prefix caching of Mamba layers) and one full-attention group.

The loop is §3's, plus ``new_step_starts()`` at each step (vLLM's scheduler calls it; Mamba's
align mode needs it). The clock runs around each manager call only; the request hashing
(each new prompt, then the blocks outputs complete) is timed apart. A request's block hashes
are one chain whatever the group count (``block_hashes`` holds ``num_tokens // 16`` of them
for 1, 2 or 4 groups), so hashing is the same as for one group; the summary shows it.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from kvblock.replay import peer_workload as W

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import kvblock  # noqa: E402
from kvblock import specs as kspecs  # noqa: E402
import kvblock.vllm as kv  # noqa: E402
import vllm_sched as S  # noqa: E402
from vllm_baseline import end_of_step  # noqa: E402
from kvblock.vllm.manager import VllmKVCacheManager  # noqa: E402

REPS = int(os.environ.get("KVBLOCK_BENCH_HYBRID_REPS", "3"))


def _vllm_specs(model: str) -> list[Any]:
    if model == "gpt-oss":
        return [
            FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32),
            SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=128),
        ]
    mamba = [MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
             for _ in range(3)]
    return mamba + [FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)]


def _kvblock_specs(model: str) -> list[Any]:
    if model == "gpt-oss":
        return [kspecs.FullAttentionSpec(16), kspecs.SlidingWindowSpec(16, sliding_window=128)]
    return [kspecs.MambaSpec(16, mamba_cache_mode="align") for _ in range(3)] + [kspecs.FullAttentionSpec(16)]


@dataclass
class HybridRun:
    fingerprint: str
    steps: int
    manager_ns: int
    hashing_ns: int
    hits: int
    hashes_per_request: set[int]


def _ids(blocks: Any) -> str:
    return "|".join(",".join(map(str, g)) for g in blocks.get_block_ids())


def run_hybrid(make_manager: Callable[[], Any], make_request: Callable[[int], tuple[Any, list[int]]],
               hashing: str) -> HybridRun:
    """§3's loop on ``make_manager()``; ``make_request(i)`` gives request ``i`` (its prompt
    hashed) and its outputs."""
    mgr = make_manager()
    clock = time.perf_counter_ns
    fp = hashlib.sha256()
    manager_ns = hashing_ns = 0
    waiting, running, step = deque(range(W.NUM_REQUESTS)), [], 0
    per_request: set[int] = set()
    while waiting or running:
        scheduled = []
        t0 = clock()
        mgr.new_step_starts()
        results = [mgr.allocate_slots(req, 1) for req, _ in running]
        manager_ns += clock() - t0
        for (req, outputs), new in zip(running, results):
            assert new is not None
            fp.update(("d" + _ids(new)).encode())
            scheduled.append((req, outputs, 1))
        candidates = []
        n_new = min(len(waiting), W.MAX_RUNNING - len(running))
        for i in list(waiting)[:n_new]:
            t0 = clock()
            req, outputs = make_request(i)
            hashing_ns += clock() - t0
            per_request.add(len(req.block_hashes))
            candidates.append((req, outputs))
        for req, outputs in candidates:
            t1 = clock()
            hit, n_hit = mgr.get_computed_blocks(req)[:2]
            new = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
            manager_ns += clock() - t1
            assert new is not None
            mgr.record_prefix_cache_stats(req, n_hit)
            fp.update(("h" + _ids(hit)).encode())
            fp.update(("n" + _ids(new)).encode())
            waiting.popleft()
            req.status = S_RUNNING
            running.append((req, outputs))
            req.num_computed_tokens = n_hit
            scheduled.append((req, outputs, req.num_tokens - n_hit))
        h_ns, m_ns, running = end_of_step(mgr, scheduled, running, clock)
        hashing_ns += h_ns
        manager_ns += m_ns
        step += 1
    stats = mgr.make_prefix_cache_stats()
    assert mgr.block_pool.get_num_free_blocks() == W.NUM_BLOCKS - 1
    return HybridRun(fp.hexdigest(), step, manager_ns, hashing_ns, stats.hits, per_request)


from vllm.v1.request import RequestStatus  # noqa: E402

S_RUNNING = RequestStatus.RUNNING


def _vllm_side(impl: str, model: str, eng: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[int], Any]]:
    config = KVCacheConfig(num_blocks=W.NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], s)
                                            for g, s in enumerate(_vllm_specs(model))])
    cls = VllmKVCacheManager if impl == "vllm" else kv.KVCacheManager

    def make_manager() -> Any:
        m = cls(config, max_model_len=W.MAX_MODEL_LEN, scheduler_block_size=W.BLOCK_SIZE,
                hash_block_size=W.BLOCK_SIZE, enable_caching=True, log_stats=True)
        assert type(m) is cls
        return m

    def make_request(i: int) -> Any:
        prompt, outputs = W.e2e_request_tokens(i)
        return S.make_request(eng, S.RequestSpec(f"req-{i}", prompt, outputs)), outputs

    return make_manager, make_request


def _kvblock_own(model: str) -> tuple[Callable[[], Any], Callable[[int], Any]]:
    box: list[Any] = []

    def make_manager() -> Any:
        m = kvblock.KVCacheManager(W.NUM_BLOCKS, kv_cache_groups=_kvblock_specs(model),
                                   max_model_len=W.MAX_MODEL_LEN, log_stats=True)
        box[:] = [m]
        return m

    def make_request(i: int) -> Any:
        prompt, outputs = W.e2e_request_tokens(i)
        return kvblock.Request(f"req-{i}", prompt, block_hasher=box[0].request_block_hasher), outputs

    return make_manager, make_request


IMPLS = ("vllm", "kvblock.vllm", "kvblock")
_RUNS: dict[str, dict[str, list[HybridRun]]] = {}


def _one(impl: str, model: str) -> HybridRun:
    gc.collect()
    gc.freeze()
    try:
        if impl == "kvblock":
            saved = os.environ.get("PYTHONHASHSEED")
            os.environ["PYTHONHASHSEED"] = W.PYTHONHASHSEED
            try:
                kvblock.hashing.init_none_hash(kvblock.hashing.get_hash_fn_by_name("sha256"))
            finally:
                if saved is None:
                    os.environ.pop("PYTHONHASHSEED", None)
                else:
                    os.environ["PYTHONHASHSEED"] = saved
            return run_hybrid(*_kvblock_own(model), "kvblock")
        with S.engine("vllm" if impl == "vllm" else "kvblock") as eng:
            return run_hybrid(*_vllm_side(impl, model, eng), impl)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("model", ["gpt-oss", "qwen3-next"])
def test_hybrid_manager(record_measured, report_line, model):
    if vllm.__version__ != S.VLLM_VERSION:
        pytest.skip(f"needs vLLM {S.VLLM_VERSION}, found {vllm.__version__}")
    runs: dict[str, list[HybridRun]] = {i: [] for i in IMPLS}
    for rep in range(REPS):
        order = IMPLS if rep % 2 == 0 else IMPLS[::-1]
        for impl in order:
            runs[impl].append(_one(impl, model))
    every = [r for rs in runs.values() for r in rs]
    assert len({r.fingerprint for r in every}) == 1, "the managers handed out different block ids"
    assert len({(r.steps, r.hits) for r in every}) == 1
    assert {n for r in every for n in r.hashes_per_request} == {W.PROMPT_LEN // W.BLOCK_SIZE}
    r0 = every[0]
    groups = len(_vllm_specs(model))
    group = f"hybrid manager time per scheduler step [{model}-like, {groups} groups]"
    for impl, rs in runs.items():
        samples = [r.manager_ns / r.steps / 1e9 for r in rs]
        if impl == "kvblock.vllm":
            record_measured(group, "kvblock", samples)
        elif impl == "kvblock":
            record_measured(group + " [kvblock's own API]", "kvblock", samples)
        else:
            record_measured(group, "vllm", samples)
            record_measured(group + " [kvblock's own API]", "vllm", samples)
        record_measured(f"hybrid request hashing, whole run [{model}-like]",
                        {"vllm": "vllm", "kvblock.vllm": "kvblock"}.get(impl, "kvblock-own"),
                        [r.hashing_ns / 1e9 for r in rs])
    med = {impl: sorted(r.manager_ns / r.steps for r in rs)[len(rs) // 2] for impl, rs in runs.items()}
    hashing = {impl: sorted(r.hashing_ns for r in rs)[len(rs) // 2] / 1e6 for impl, rs in runs.items()}
    report_line(f"hybrid [{model}-like, {groups} groups]: {r0.steps} steps, prefix hits {r0.hits} tokens, "
                f"fingerprint {r0.fingerprint[:16]} (identical in all {len(every)} runs); "
                f"{W.PROMPT_LEN // W.BLOCK_SIZE} block hashes per 2,048-token request (one chain, any group count)")
    report_line(f"  manager µs/step (median): vLLM {med['vllm'] / 1e3:.1f}, kvblock.vllm "
                f"{med['kvblock.vllm'] / 1e3:.1f} ({med['vllm'] / med['kvblock.vllm']:.1f}x), kvblock own API "
                f"{med['kvblock'] / 1e3:.1f} ({med['vllm'] / med['kvblock']:.1f}x); target >= 20x")
    report_line(f"  request hashing, whole run (median ms): vLLM {hashing['vllm']:.0f}, kvblock.vllm "
                f"{hashing['kvblock.vllm']:.0f}, kvblock own API {hashing['kvblock']:.0f}")
