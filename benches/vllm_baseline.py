"""vLLM 0.33.0 itself on the workload's end-to-end loop (../shared/workload/README.md §3).

vLLM's own ``KVCacheManager``, ``Request`` and request block hasher run the same loop as
:func:`kvblock.replay.peer_workload.run_e2e`, and the clock is read around the same phases: each step's
decode loop, each admission's ``get_computed_blocks`` and ``allocate_slots``, each step's
frees, and the hashing (a new request's prompt when its hasher is attached, then
``update_block_hashes`` after each step's outputs are appended). So its manager and hashing
times compare directly with kvblock's and the reference's. Only ``benches/test_bench_vllm.py``
uses it, when vLLM is installed.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass

from kvblock.replay import peer_workload as W

VLLM_VERSION = "0.33.0"


@dataclass
class VllmRun:
    fingerprint: str
    hits: int
    steps: int
    manager_ns: int
    hashing_ns: int


def end_of_step(mgr, scheduled: list, running: list, clock) -> tuple[int, int, list]:
    """The end of one step of the workload's loop (§3): commit the step's tokens and sample,
    bring the scheduled requests' block hashes up to date, free the finished requests.
    Returns ``(hashing_ns, manager_ns, still_running)``."""
    W.commit_and_sample(scheduled)
    t0 = clock()
    for req, _, _ in scheduled:
        req.update_block_hashes()
    hashing_ns = clock() - t0
    done = [req for req, _ in running if req.num_output_tokens == W.DECODE_TOKENS]
    t0 = clock()
    for req in done:
        mgr.free(req)
    manager_ns = clock() - t0
    return hashing_ns, manager_ns, [(req, o) for req, o in running if req.num_output_tokens != W.DECODE_TOKENS]


def run_vllm_e2e() -> VllmRun:
    """One replay of the loop with vLLM's objects (sha256, ``PYTHONHASHSEED=0`` root)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    saved = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = W.PYTHONHASHSEED
    try:
        init_none_hash(sha256)
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    spec = FullAttentionSpec(block_size=W.BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=W.NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    mgr = KVCacheManager(
        config,
        max_model_len=W.MAX_MODEL_LEN,
        scheduler_block_size=W.BLOCK_SIZE,
        hash_block_size=W.BLOCK_SIZE,
        enable_caching=True,
        log_stats=True,
    )
    hasher = get_request_block_hasher(W.BLOCK_SIZE, sha256)
    clock = time.perf_counter_ns
    fingerprint = hashlib.sha256()
    manager_ns = hashing_ns = 0
    waiting, running, step = deque(range(W.NUM_REQUESTS)), [], 0
    while waiting or running:
        scheduled = []
        t0 = clock()
        results = [mgr.allocate_slots(req, 1) for req, _ in running]
        manager_ns += clock() - t0
        for (req, outputs), new in zip(running, results):
            fingerprint.update(("d" + ",".join(map(str, new.get_block_ids()[0]))).encode())
            scheduled.append((req, outputs, 1))
        candidates = []
        for i in list(waiting)[: min(len(waiting), W.MAX_RUNNING - len(running))]:
            prompt, outputs = W.e2e_request_tokens(i)
            sp = SamplingParams(max_tokens=W.DECODE_TOKENS)
            candidates.append((Request(f"req-{i}", prompt, sp, None), outputs))
        t0 = clock()
        for req, _ in candidates:
            req._block_hasher = hasher
            req.update_block_hashes()
        hashing_ns += clock() - t0
        for req, outputs in candidates:
            t1 = clock()
            hit, n_hit = mgr.get_computed_blocks(req)[:2]
            new = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
            manager_ns += clock() - t1
            mgr.record_prefix_cache_stats(req, n_hit)
            fingerprint.update(("h" + ",".join(map(str, hit.get_block_ids()[0]))).encode())
            fingerprint.update(("n" + ",".join(map(str, new.get_block_ids()[0]))).encode())
            waiting.popleft()
            req.status = RequestStatus.RUNNING
            running.append((req, outputs))
            req.num_computed_tokens = n_hit
            scheduled.append((req, outputs, req.num_tokens - n_hit))
        h_ns, m_ns, running = end_of_step(mgr, scheduled, running, clock)
        hashing_ns += h_ns
        manager_ns += m_ns
        step += 1
    stats = mgr.make_prefix_cache_stats()
    return VllmRun(fingerprint.hexdigest(), stats.hits, step, manager_ns, hashing_ns)
