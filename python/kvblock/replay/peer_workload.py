"""The built-in ``apc-peer-v1`` workload: its token ids and its end-to-end scheduler loop.

The workload is generated in code, bit for bit equal to the shared definition
(``workload/README.md`` and ``apc_workload.py``): token ids come from ``splitmix64``
(vectorised here with numpy ``uint64`` arithmetic, which wraps modulo 2**64 like the spec).
:func:`run_e2e` replays the README's §3 scheduler loop literally against any manager with
vLLM 0.33.0's ``KVCacheManager`` API and returns the per-call records, the block-id
fingerprint, the prefix-cache counters and the manager / hashing times.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..request import Request, RequestStatus, SamplingParams

__all__ = [
    "DECODE_TOKENS",
    "E2EResult",
    "NAME",
    "NUM_REQUESTS",
    "PYTHONHASHSEED",
    "commit_and_sample",
    "e2e_request_tokens",
    "hashing_prompt",
    "run_e2e",
    "splitmix64",
    "token_array",
    "tokens",
]

#: Workload name.
NAME = "apc-peer-v1"
#: Generator seed and vocabulary size.
SEED = 1234567
VOCAB_SIZE = 128000
#: ``PYTHONHASHSEED`` in force when the workload's root hash is initialised.
PYTHONHASHSEED = "0"
#: End-to-end loop: request count, prompt length, shared system-prompt length, outputs per
#: request, concurrency, and the manager configuration (spec'd in README §2).
NUM_REQUESTS = 1000
PROMPT_LEN = 2048
SHARED_PREFIX_LEN = 1536
DECODE_TOKENS = 128
MAX_RUNNING = 64
BLOCK_SIZE = 16
NUM_BLOCKS = 16384
MAX_MODEL_LEN = 8192
HASH_ALGO = "sha256"
#: The hashing micro-benchmark prompt: its stream and length.
HASHING_TOKEN_STREAM = 1048000
HASHING_PROMPT_LEN = 4096

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` of every element of a ``uint64`` array (arithmetic modulo 2**64)."""
    x = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (x ^ (x >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def token_array(
    stream: int, start: int, end: int, seed: int = SEED, vocab_size: int = VOCAB_SIZE
) -> np.ndarray:
    """Token ids ``token(seed, stream, idx)`` for ``idx`` in ``[start, end)``, as an int64
    numpy array (same values as :func:`tokens`, without the Python-int conversion)."""
    base = ((seed & 0xFFFFFF) << 40) | ((stream & 0xFFFFF) << 20)
    idx = np.arange(start, end, dtype=np.uint64) & np.uint64(0xFFFFF)
    return (splitmix64(np.uint64(base) | idx) % np.uint64(vocab_size)).astype(np.int64)


def tokens(stream: int, start: int, end: int, seed: int = SEED, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """Token ids ``token(seed, stream, idx)`` for ``idx`` in ``[start, end)``, as Python ints.

    ``token = splitmix64(((seed & 0xFFFFFF) << 40) | ((stream & 0xFFFFF) << 20)
    | (idx & 0xFFFFF)) % vocab_size``.
    """
    return token_array(stream, start, end, seed, vocab_size).tolist()


def e2e_request_tokens(i: int) -> tuple[list[int], list[int]]:
    """``(prompt, outputs)`` of end-to-end request ``i`` (request id ``f"req-{i}"``).

    Requests with ``i % 4 != 3`` start with the shared 1536-token system prompt (stream 0);
    everything else comes from stream ``1 + i``; the 128 outputs are that stream's tokens
    at ``2048 + j``.
    """
    if i % 4 != 3:
        prompt = tokens(0, 0, SHARED_PREFIX_LEN) + tokens(1 + i, SHARED_PREFIX_LEN, PROMPT_LEN)
    else:
        prompt = tokens(1 + i, 0, PROMPT_LEN)
    outputs = tokens(1 + i, PROMPT_LEN, PROMPT_LEN + DECODE_TOKENS)
    return prompt, outputs


def hashing_prompt() -> list[int]:
    """The 4096-token prompt of the hashing micro-benchmarks (stream 1048000)."""
    return tokens(HASHING_TOKEN_STREAM, 0, HASHING_PROMPT_LEN)


@dataclass
class E2EResult:
    """The outcome of :func:`run_e2e`.

    Attributes:
        records: one dict per manager call, with the trace file's fields (``step``, ``op``,
            ``rid``, and ``hit_tokens`` / ``hit`` / ``new`` where they apply); empty when
            recording was off.
        fingerprint: SHA-256 hex digest of the block-id messages (README §5.1).
        hits, queries: from ``make_prefix_cache_stats()`` after the run (tokens).
        requests: requests recorded in those stats.
        steps: scheduler steps run.
        free_blocks: ``block_pool.get_num_free_blocks()`` at the end.
        map_size: ``len(block_pool.cached_block_hash_to_block)`` at the end.
        manager_ns: time in ``get_computed_blocks`` / ``allocate_slots`` / ``free`` calls.
        lookup_ns, prefill_alloc_ns, decode_alloc_ns, free_ns: that time split by call kind.
        hashing_ns: time hashing prompts and the blocks that outputs complete.
        num_decode_calls: decode ``allocate_slots`` calls.
    """

    records: list[dict[str, Any]]
    fingerprint: str
    hits: int
    queries: int
    requests: int
    steps: int
    free_blocks: int
    map_size: int
    manager_ns: int
    lookup_ns: int
    prefill_alloc_ns: int
    decode_alloc_ns: int
    free_ns: int
    hashing_ns: int
    num_decode_calls: int

    @property
    def hit_rate(self) -> float:
        """``hits / queries``."""
        return self.hits / self.queries if self.queries else 0.0


def commit_and_sample(scheduled: list[tuple[Any, list[int], int]]) -> None:
    """The model step of README §3 before hashing: for each ``(request, outputs, k)`` in
    order, ``num_computed_tokens += k`` and the request's next output token is appended to
    its output and all-token lists (vLLM's and kvblock's ``Request`` alike); the caller then
    times ``update_block_hashes``."""
    for req, outputs, k in scheduled:
        req.num_computed_tokens += k
        token = outputs[len(req._output_token_ids)]
        req._output_token_ids.append(token)
        req._all_token_ids.append(token)


def _default_hashing_module(manager: Any) -> Any:
    """The hashing module whose ``NONE_HASH`` the manager's request hasher reads."""
    from .. import hashing as kv_hashing
    from ..reference import hashing as ref_hashing

    if isinstance(manager.hash_fn, kv_hashing.HashFunction):
        return kv_hashing
    return ref_hashing


class _RootSeed:
    """Re-initialise a hashing module's ``NONE_HASH`` with ``PYTHONHASHSEED`` set, and put
    the previous root and environment back afterwards."""

    def __init__(self, module: Any, hash_fn: Any, seed: str) -> None:
        self.module, self.hash_fn, self.seed = module, hash_fn, seed

    def __enter__(self) -> None:
        self.saved_env = os.environ.get("PYTHONHASHSEED")
        self.saved_root = self.module._root_state()
        os.environ["PYTHONHASHSEED"] = self.seed
        self.module.init_none_hash(self.hash_fn)

    def __exit__(self, *exc: Any) -> None:
        if self.saved_env is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = self.saved_env
        self.module._restore_root_state(self.saved_root)


def run_e2e(
    manager_factory: Callable[[], Any],
    *,
    num_requests: int = NUM_REQUESTS,
    max_running: int = MAX_RUNNING,
    record: bool = True,
    timer: Callable[[], int] | None = None,
    hashing_module: Any = None,
    batch: bool = False,
) -> E2EResult:
    """Replay the workload's end-to-end scheduler loop (README §3) on a fresh manager.

    Args:
        manager_factory: returns a fresh manager configured as README §2 says (one
            full-attention group, block size 16, 16384 blocks, max_model_len 8192, caching
            and ``log_stats`` on, sha256). It must expose vLLM 0.33.0's ``KVCacheManager``
            methods plus ``hash_fn``, ``request_block_hasher`` and ``block_pool``.
        num_requests: requests to run (the first ``num_requests`` of the workload).
        max_running: concurrency limit of the loop.
        record: keep one record per manager call (for trace comparison).
        timer: a clock in nanoseconds (default ``time.perf_counter_ns``).
        hashing_module: the module whose ``NONE_HASH`` the manager's hasher reads (default:
            ``kvblock.hashing`` for kvblock hash functions, else ``kvblock.reference.hashing``).
            Its root is set with ``PYTHONHASHSEED="0"`` for the run and restored afterwards.
        batch: use kvblock's batch step API: per step one ``admit_batch`` call for the
            admissions (lookups and allocations), one ``allocate_slots_batch`` call for the
            decodes and ``kvblock.hashing.hash_requests`` calls for the hashing (new prompts
            hashed together, on several threads). Same results.

    Timing: the clock is read around whole phases, not single calls — each step's decode
    loop, each admission's lookup and allocation, each step's frees, each step's hashing
    (``Request.attach_block_hasher`` for new prompts, ``update_block_hashes`` after the
    outputs are appended) — so its own cost stays out of the figures.

    Returns:
        An :class:`E2EResult`.

    Raises:
        RuntimeError: a decode ``allocate_slots`` returned None (it never does in this
            workload) or an admission could not be made with nothing running.
    """
    clock = timer if timer is not None else time.perf_counter_ns
    mgr = manager_factory()
    module = hashing_module if hashing_module is not None else _default_hashing_module(mgr)
    with _RootSeed(module, mgr.hash_fn, PYTHONHASHSEED):
        if getattr(mgr, "none_hash", None) not in (None, module.none_hash_for(mgr.hash_fn)):
            mgr = manager_factory()  # a manager keeps the root it was built with: build it seeded
        return _run_loop(mgr, num_requests, max_running, record, clock, batch)


def _ids(blocks: Any) -> list[int]:
    return blocks.get_block_ids()[0]


def _run_loop(
    mgr: Any, num_requests: int, max_running: int, record: bool, clock: Callable[[], int], batch: bool
) -> E2EResult:
    fingerprint = hashlib.sha256()
    records: list[dict[str, Any]] = []
    lookup_ns = prefill_ns = decode_ns = free_ns = hashing_ns = 0
    num_decode_calls = 0
    hasher = mgr.request_block_hasher
    allocate_slots, get_computed_blocks, free = mgr.allocate_slots, mgr.get_computed_blocks, mgr.free
    if batch:
        from ..hashing import hash_requests

        allocate_batch, admit_batch = mgr.allocate_slots_batch, mgr.admit_batch
    waiting = deque(range(num_requests))
    running: list[tuple[Any, list[int]]] = []
    step = 0
    while waiting or running:
        scheduled: list[tuple[Any, list[int], int]] = []

        # (1) Decode every running request, in admission order.
        reqs = [req for req, _ in running]
        if batch and reqs:
            t0 = clock()
            counts, flat = allocate_batch(reqs)
            decode_ns += clock() - t0
            counts, flat = counts.tolist(), flat.tolist()
            if -1 in counts:
                raise RuntimeError("decode allocate_slots_batch returned -1")
            new_ids, k = [], 0
            for c in counts:
                new_ids.append(flat[k : k + c])
                k += c
        elif reqs:
            t0 = clock()
            results = [allocate_slots(req, 1) for req in reqs]
            decode_ns += clock() - t0
            if any(r is None for r in results):
                raise RuntimeError("decode allocate_slots returned None")
            new_ids = [_ids(r) for r in results]
        else:
            new_ids = []
        num_decode_calls += len(reqs)
        for (req, outputs), ids in zip(running, new_ids):
            fingerprint.update(("d" + ",".join(map(str, ids))).encode())
            if record:
                records.append({"step": step, "op": "decode", "rid": req.request_id, "new": ids})
            scheduled.append((req, outputs, 1))

        # (2) Admit waiting requests while fewer than max_running run. The prompts of this
        # step's candidates are hashed first (together, in batch mode).
        n_admit = min(len(waiting), max_running - len(running))
        candidates = []
        for i in list(waiting)[:n_admit]:
            prompt, outputs = e2e_request_tokens(i)
            candidates.append((Request(f"req-{i}", prompt, sampling_params=SamplingParams(max_tokens=DECODE_TOKENS)), outputs))
        if candidates:
            t0 = clock()
            if batch:
                for req, _ in candidates:
                    req.attach_block_hasher(hasher, hash_now=False)
                hash_requests([req for req, _ in candidates])
            else:
                for req, _ in candidates:
                    req.attach_block_hasher(hasher)
            hashing_ns += clock() - t0
        if batch and candidates:
            t1 = clock()
            n_adm, hit_tokens, new_counts, hit_flat, new_flat = admit_batch([req for req, _ in candidates])
            lookup_ns += clock() - t1  # one call does the lookups and the allocations
            if n_adm == 0 and not running:
                raise RuntimeError(f"cannot admit {candidates[0][0].request_id} into an idle pool")
            hit_flat, new_flat = hit_flat.tolist(), new_flat.tolist()
            admissions, h, k = [], 0, 0
            for (req, outputs), n_hit, c in zip(candidates, hit_tokens.tolist(), new_counts.tolist()):
                nb = n_hit // mgr.block_size
                admissions.append((req, outputs, n_hit, hit_flat[h : h + nb], new_flat[k : k + c]))
                h, k = h + nb, k + c
        else:
            admissions = []
            for req, outputs in candidates:
                t1 = clock()
                hit_blocks, n_hit, _ = get_computed_blocks(req)
                t2 = clock()
                new = allocate_slots(req, req.num_tokens - n_hit, n_hit, hit_blocks)
                t3 = clock()
                lookup_ns += t2 - t1
                prefill_ns += t3 - t2
                if new is None:
                    if not running:
                        raise RuntimeError(f"cannot admit {req.request_id} into an idle pool")
                    break
                admissions.append((req, outputs, n_hit, _ids(hit_blocks), _ids(new)))
        for req, outputs, n_hit, hit_ids, new_ids_ in admissions:
            mgr.record_prefix_cache_stats(req, n_hit)
            fingerprint.update(("h" + ",".join(map(str, hit_ids))).encode())
            fingerprint.update(("n" + ",".join(map(str, new_ids_))).encode())
            if record:
                records.append(
                    {"step": step, "op": "prefill", "rid": req.request_id,
                     "hit_tokens": n_hit, "hit": hit_ids, "new": new_ids_}
                )
            waiting.popleft()
            req.status = RequestStatus.RUNNING
            running.append((req, outputs))
            req.num_computed_tokens = n_hit
            scheduled.append((req, outputs, req.num_tokens - n_hit))

        # (3) Model step: commit the computed tokens, append one sampled token each, then
        # bring the block hashes up to date (the hashing append_output_token_ids triggers).
        commit_and_sample(scheduled)
        if scheduled:
            t0 = clock()
            if batch:
                hash_requests([req for req, _, _ in scheduled])
            else:
                for req, _, _ in scheduled:
                    req.update_block_hashes()
            hashing_ns += clock() - t0

        # (4) Finish the requests that produced all their outputs, in running order.
        done = [(req, o) for req, o in running if req.num_output_tokens == DECODE_TOKENS]
        if done:
            t0 = clock()
            for req, _ in done:
                free(req)
            free_ns += clock() - t0
            if record:
                for req, _ in done:
                    records.append({"step": step, "op": "free", "rid": req.request_id})
            running = [(req, o) for req, o in running if req.num_output_tokens != DECODE_TOKENS]
        step += 1

    stats = mgr.make_prefix_cache_stats()
    return E2EResult(
        records=records,
        fingerprint=fingerprint.hexdigest(),
        hits=stats.hits,
        queries=stats.queries,
        requests=stats.requests,
        steps=step,
        free_blocks=mgr.block_pool.get_num_free_blocks(),
        map_size=len(mgr.block_pool.cached_block_hash_to_block),
        manager_ns=lookup_ns + prefill_ns + decode_ns + free_ns,
        lookup_ns=lookup_ns,
        prefill_alloc_ns=prefill_ns,
        decode_alloc_ns=decode_ns,
        free_ns=free_ns,
        hashing_ns=hashing_ns,
        num_decode_calls=num_decode_calls,
    )
