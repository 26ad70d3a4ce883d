"""A continuous-batching scheduler simulator driving a KV cache manager (vLLM 0.33.0's
call pattern).

Per step, as vLLM's v1 ``Scheduler.schedule`` does:

1. **Running requests**, in order, each get ``min(num_tokens - num_computed_tokens,
   budget)`` new tokens (a decode step is 1 token; a chunked prefill continues) through
   ``allocate_slots(req, k)``. When it returns None the *last* running request is preempted:
   ``free(req)``, status PREEMPTED, ``num_computed_tokens = 0``,
   ``num_preemptions += 1``, back to the *front* of the waiting queue; then the allocation
   is retried. A request that has to preempt itself is not scheduled this step.
2. **Waiting requests**, only if nothing was preempted in this step, in FIFO order while
   fewer than ``max_running`` run and budget is left: ``get_computed_blocks(req)``, then
   ``allocate_slots(req, num_tokens - n_hit, n_hit, hit_blocks)`` (the prompt is cut to the
   budget with chunked prefill; without it a prompt over the budget waits); None stops
   admission. ``record_prefix_cache_stats(req, n_hit)``, status RUNNING,
   ``num_computed_tokens = n_hit``.
3. **Model step**: each scheduled request's ``num_computed_tokens += k``; a request whose
   computed tokens reach its ``num_tokens`` samples one output token (its block hashes grow
   when the token completes a block).
4. **Finish**, in running order: requests with ``output_length`` outputs are freed.

Arrivals follow the trace timestamps on a simulated clock that advances ``step_ms`` per step
(and jumps to the next arrival when idle), or all requests wait from the start (``asap``).
A request whose longest sequence needs more blocks than the whole cache (or, without chunked
prefill, more tokens than the budget) is never admitted and is reported as unservable, so a
replay cannot hang on it. In ``ideal`` mode each request is admitted alone and freed at once.

Evictions are counted without asking the pool: vLLM's free queue always holds its uncached
blocks at the head (freed unhashed blocks are prepended, hashed ones appended, spec §4.1), so
an allocation of ``n`` new blocks evicts ``max(0, n - U)`` cached blocks, ``U`` being the
uncached free blocks. ``U`` starts at ``num_blocks - 1``, drops by each allocation and grows
by the unhashed blocks of every freed request (table blocks minus cached blocks; unhashed
blocks are never shared). New blocks follow from full-attention arithmetic:
``cdiv(slots, block_size) - table_blocks``.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import deque
from typing import Any, Callable

import numpy as np

from ..request import RequestStatus
from .backends import Impl, get_impl
from .blockhash import RequestHasher
from .config import SimConfig, check_engine_memory, check_time_span
from .retention import RetentionPolicy
from .result import ReplayResult, Unservable
from .simrequest import SimRequest
from .trace import Trace, TraceRequest

__all__ = ["Replayer", "replay"]

ProgressFn = Callable[[int], None]
_NO_LIMIT = 1 << 62


def _ids(blocks: Any) -> str:
    return ",".join(map(str, blocks.get_block_ids()[0]))


class Replayer:
    """Replays workloads for one implementation, block size and hash algorithm.

    The :class:`RequestHasher` (and its per-hash-id memo) is kept across :meth:`run` calls,
    so a capacity sweep hashes each distinct trace block once.

    Args:
        impl: ``"kvblock"`` or ``"reference"`` (or an :class:`Impl`).
        block_size, hash_algo: as in :class:`SimConfig`.

    Raises:
        ReplayError: unknown implementation.
    """

    def __init__(self, impl: str | Impl, block_size: int, hash_algo: str) -> None:
        self.impl = impl if isinstance(impl, Impl) else get_impl(impl)
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._hashers: dict[int | None, RequestHasher] = {}

    def _hasher(self, trace: Trace) -> RequestHasher:
        key = trace.trace_block_size
        h = self._hashers.get(key)
        if h is None:
            h = self._hashers[key] = RequestHasher(self.impl, self.block_size, self.hash_algo, key)
        return h

    def run(self, trace: Trace, cfg: SimConfig, progress: ProgressFn | None = None) -> ReplayResult:
        """Replay ``trace`` with ``cfg`` (its ``impl``, ``block_size`` and ``hash_algo`` must
        be this replayer's).

        Args:
            trace: the workload.
            cfg: the settings (see :class:`SimConfig`).
            progress: called with the number of requests done (finished or unservable), at
                most once per step.

        Returns:
            A :class:`ReplayResult`: vLLM's ``PrefixCacheStats`` of the run (tokens), block
            hits, evictions, preemptions, blocks in use per step, the time spent in the
            manager calls (ns) and in the hash function (ns per digest computed).

        Raises:
            ReplayError: invalid settings, or a pool larger than the memory available
                (:func:`~kvblock.replay.config.check_engine_memory`); ValueError: ``cfg`` names
                another implementation, block size or hash algorithm than this replayer;
                SettingError: a ``time_scale`` that puts the last arrival past 366 days
                (:func:`~kvblock.replay.config.check_time_span`).
        """
        cfg.validate()
        if (cfg.impl, cfg.block_size, cfg.hash_algo) != (self.impl.name, self.block_size, self.hash_algo):
            raise ValueError("cfg does not match this Replayer's impl / block_size / hash_algo")
        check_time_span(trace, cfg)
        num_blocks = cfg.resolved_num_blocks(trace)
        check_engine_memory(1, num_blocks)
        t0 = time.perf_counter()
        policy = RetentionPolicy(cfg.retention, cfg.block_size, cfg.pin_tokens, cfg.ttl_s)
        mgr = self.impl.make_manager(num_blocks, cfg.block_size, cfg.hash_algo, **policy.manager_kwargs())
        hasher = self._hasher(trace)
        hasher.start_run()
        res = ReplayResult(
            workload=trace.name, source=trace.source, impl=self.impl.name,
            mode="ideal" if cfg.ideal else "scheduled", config=cfg.describe(trace),
            requests=len(trace.requests), prompt_tokens=trace.num_prompt_tokens,
            usable_blocks=num_blocks - 1, skipped_lines=len(trace.bad_lines),
        )
        fp = hashlib.sha256() if cfg.fingerprint else None
        if cfg.ideal:
            _run_ideal(trace, cfg, mgr, hasher, res, fp, progress, policy)
        else:
            sched = _Scheduler(trace, cfg, mgr, hasher, res, fp, progress)
            sched.policy = policy
            sched.run()
        stats = mgr.make_prefix_cache_stats()
        res.queries, res.hits, res.requests_recorded = stats.queries, stats.hits, stats.requests
        res.preempted_queries, res.preempted_hits = stats.preempted_queries, stats.preempted_hits
        res.preempted_requests = stats.preempted_requests
        res.hash_ns, res.blocks_hashed, res.blocks_reused = hasher.hash_ns, hasher.blocks_hashed, hasher.blocks_reused
        res.fingerprint = fp.hexdigest() if fp is not None else None
        res.wall_s = time.perf_counter() - t0
        return res


def replay(trace: Trace, cfg: SimConfig, progress: ProgressFn | None = None) -> ReplayResult:
    """Replay ``trace`` once with ``cfg`` and return its :class:`ReplayResult` (see
    :meth:`Replayer.run`; a :class:`Replayer` reuses block hashes across runs).

    Raises:
        ReplayError: invalid settings.
    """
    cfg.validate()
    return Replayer(cfg.impl, cfg.block_size, cfg.hash_algo).run(trace, cfg, progress)


def _unservable(tr: TraceRequest, cfg: SimConfig, usable: int) -> Unservable | None:
    b = cfg.block_size
    max_len = tr.prompt_len if cfg.ideal else tr.prompt_len + max(tr.output_len, 1) - 1
    need = -(-max_len // b)
    if need > usable:
        return Unservable(
            tr.request_id, tr.line, need,
            f"needs {need:,} blocks for {max_len:,} tokens but the cache has {usable:,} usable blocks",
        )
    if not cfg.ideal and not cfg.chunked_prefill and cfg.token_budget is not None and max_len > cfg.token_budget:
        return Unservable(
            tr.request_id, tr.line, need,
            f"its {max_len:,} tokens exceed the token budget {cfg.token_budget:,} without chunked prefill",
        )
    return None


def _run_ideal(
    trace: Trace, cfg: SimConfig, mgr: Any, hasher: RequestHasher, res: ReplayResult,
    fp: Any, progress: ProgressFn | None, policy: RetentionPolicy | None = None,
) -> int:
    """Admit each request alone, record its hit and free it at once."""
    if policy is not None and policy.name == "lru":
        policy = None
    b = cfg.block_size
    usable = res.usable_blocks
    clock = time.perf_counter_ns
    get_computed_blocks, allocate_slots, free = mgr.get_computed_blocks, mgr.allocate_slots, mgr.free
    record = mgr.record_prefix_cache_stats
    get_free = mgr.block_pool.get_num_free_blocks
    usage = array("i")
    lookup_ns = alloc_ns = free_ns = 0
    blocks_queried = blocks_hit = served = 0
    done = 0
    evictions = 0
    uncached_free = usable  # see _EvictionCounter
    for tr in trace.requests:
        done += 1
        bad = _unservable(tr, cfg, usable)
        if bad is not None:
            res.unservable.append(bad)
            continue
        req = SimRequest(tr)
        req.block_hashes = hasher.prompt_hashes(tr)
        num_tokens = tr.prompt_len
        if policy is not None:
            policy.before_admit(req, tr.arrival_ms * cfg.time_scale / 1000.0)
        t0 = clock()
        hit, n_hit, _ = get_computed_blocks(req)
        t1 = clock()
        new = allocate_slots(req, num_tokens - n_hit, n_hit, hit)
        while new is None and policy is not None and policy.give_way(mgr):
            new = allocate_slots(req, num_tokens - n_hit, n_hit, hit)
        t2 = clock()
        if new is None:
            raise RuntimeError(f"allocate_slots failed for {tr.request_id} in an idle pool")
        if policy is not None:
            policy.after_admit(mgr, req, n_hit)
        record(req, n_hit)
        if fp is not None:
            fp.update(("h" + _ids(hit)).encode())
            fp.update(("n" + _ids(new)).encode())
        usage.append(usable - get_free())
        num_full = len(req.block_hashes)
        blocks_queried += num_full
        blocks_hit += n_hit // b
        table = -(-num_tokens // b)
        num_new = table - n_hit // b
        if num_new > uncached_free:
            evictions += num_new - uncached_free
            uncached_free = 0
        else:
            uncached_free -= num_new
        uncached_free += table - num_full
        t3 = clock()
        free(req)
        free_ns += clock() - t3
        lookup_ns += t1 - t0
        alloc_ns += t2 - t1
        served += 1
        if progress is not None and not served & 15:
            progress(done)
    if progress is not None:
        progress(done)
    res.served = res.steps = served
    res.lookup_ns, res.admit_alloc_ns, res.free_ns = lookup_ns, alloc_ns, free_ns
    res.lookup_calls = res.admit_alloc_calls = res.free_calls = served
    res.blocks_queried, res.blocks_hit = blocks_queried, blocks_hit
    res.usage = np.frombuffer(usage, dtype=np.int32).copy() if usage else np.zeros(0, np.int32)
    res.evictions = evictions


class _Scheduler:
    """The continuous-batching loop of the module docstring (one instance per run)."""

    def __init__(
        self, trace: Trace, cfg: SimConfig, mgr: Any, hasher: RequestHasher, res: ReplayResult,
        fp: Any, progress: ProgressFn | None,
    ) -> None:
        self.trace, self.cfg, self.mgr, self.hasher, self.res = trace, cfg, mgr, hasher, res
        self.fp, self.progress = fp, progress
        self.evictions = 0
        self.uncached_free = res.usable_blocks
        self.done = 0
        self.free_ns = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        #: the simulated clock (ms); advanced by the caller (:meth:`run`, or a fleet)
        self.now = 0.0
        self.steps = 0
        self.lookup_ns = self.admit_ns = self.step_ns = 0
        self.lookup_calls = self.admit_calls = self.step_calls = 0
        self.blocks_queried = self.blocks_hit = 0
        self.usage = array("i")
        #: the retention policy (None or ``lru``: vLLM's)
        self.policy: RetentionPolicy | None = None
        #: the type of the requests :meth:`add` makes (a fleet adds the event fields)
        self.request_type: type[SimRequest] = SimRequest
        #: ``(req, now)`` when a request is first admitted / samples its first token
        self.on_admit: Callable[[SimRequest, float], None] | None = None
        self.on_first_token: Callable[[SimRequest, float], None] | None = None

    # -- per-request actions -----------------------------------------------------------------
    def _allocated(self, req: SimRequest, num_slots: int) -> None:
        """Account for a successful ``allocate_slots`` that gave ``req`` ``num_slots`` slots."""
        b = self.cfg.block_size
        num_new = -(-num_slots // b) - req.table_blocks
        if num_new <= 0:
            return
        req.table_blocks += num_new
        if num_new > self.uncached_free:
            self.evictions += num_new - self.uncached_free
            self.uncached_free = 0
        else:
            self.uncached_free -= num_new

    def _free(self, req: SimRequest) -> None:
        self.uncached_free += req.table_blocks - req.cached_blocks
        t0 = time.perf_counter_ns()
        self.mgr.free(req)
        self.free_ns += time.perf_counter_ns() - t0

    def _preempt(self, req: SimRequest) -> None:
        self._free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.hit_blocks = req.cached_blocks = req.table_blocks = 0
        self.res.preemptions += 1
        self.waiting.appendleft(req)

    def _hash_outputs(self, req: SimRequest) -> None:
        """Hash the blocks completed by the outputs sampled so far."""
        b = self.cfg.block_size
        hashes = req.block_hashes
        if req.tail is None:
            req.tail = self.hasher.tail_tokens(req.spec)
        base = (req.spec.prompt_len // b) * b
        start = len(hashes) * b - base
        end = (req.num_tokens // b) * b - base
        hashes.extend(self.hasher.chain(hashes[-1] if hashes else None, req.tail[start:end]))

    # -- the loop ------------------------------------------------------------------------------
    def add(self, tr: TraceRequest) -> SimRequest | None:
        """A request arrives: it waits, or is recorded as unservable (None)."""
        bad = _unservable(tr, self.cfg, self.res.usable_blocks)
        if bad is not None:
            self.res.unservable.append(bad)
            self.done += 1
            return None
        req = self.request_type(tr)
        self.waiting.append(req)
        return req

    @property
    def busy(self) -> bool:
        """Requests are waiting or running."""
        return bool(self.waiting or self.running)

    def run(self) -> None:
        """Replay the whole trace: arrivals on the simulated clock, one :meth:`step` per
        ``step_ms``."""
        cfg = self.cfg
        pending = deque(self.trace.requests)
        waiting = self.waiting
        scale, step_ms = cfg.time_scale, cfg.step_ms
        while pending or waiting or self.running:
            # Arrivals (the clock jumps forward when nothing is left to do).
            if pending:
                if not cfg.asap and not waiting and not self.running:
                    self.now = max(self.now, pending[0].arrival_ms * scale)
                while pending and (cfg.asap or pending[0].arrival_ms * scale <= self.now):
                    self.add(pending.popleft())
                if not waiting and not self.running:
                    continue
            self.step()
            self.now += step_ms
        self.finish()

    def step(self) -> None:
        """One scheduler step: (1) running requests, (2) waiting ones, (3) the model step,
        (4) finished requests freed (see the module docstring).

        Raises:
            RuntimeError: nothing could be scheduled (a stall).
        """
        cfg, mgr, res, fp = self.cfg, self.mgr, self.res, self.fp
        b = cfg.block_size
        clock = time.perf_counter_ns
        policy = self.policy if self.policy is not None and self.policy.name != "lru" else None
        if policy is not None:
            policy.clock.t = self.now / 1000.0
        get_computed_blocks, allocate_slots = mgr.get_computed_blocks, mgr.allocate_slots
        record = mgr.record_prefix_cache_stats
        hasher = self.hasher
        waiting = self.waiting
        running = self.running
        max_running, chunked = cfg.max_running, cfg.chunked_prefill
        on_admit, on_first_token = self.on_admit, self.on_first_token
        lookup_ns = admit_ns = step_ns = 0
        lookup_calls = admit_calls = step_calls = 0
        blocks_queried = blocks_hit = 0
        RUNNING = RequestStatus.RUNNING
        budget = cfg.token_budget if cfg.token_budget is not None else _NO_LIMIT
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False

        # (1) Running requests.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            k = req.num_tokens - req.num_computed_tokens
            if k > budget:
                k = budget
            while True:
                t0 = clock()
                new = allocate_slots(req, k)
                step_ns += clock() - t0
                step_calls += 1
                if new is not None:
                    break
                if running[-1] is req and not scheduled and policy is not None and policy.give_way(mgr):
                    continue  # pins give way rather than starve the only request left
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new is None:
                break
            if fp is not None:
                fp.update(("d" + _ids(new)).encode())
            slots = req.num_computed_tokens + k
            if slots > req.table_blocks * b:
                self._allocated(req, slots)
            if slots >= (req.cached_blocks + 1) * b:
                cached = min(slots, req.num_tokens, len(req.block_hashes) * b) // b
                if cached > req.cached_blocks:
                    req.cached_blocks = cached
            scheduled.append((req, k))
            budget -= k
            i += 1

        # (2) Waiting requests, unless this step preempted.
        if not preempted:
            while waiting and len(running) < max_running and budget > 0:
                req = waiting[0]
                if not req.hashed:
                    req.block_hashes = hasher.prompt_hashes(req.spec)
                    req.hashed = True
                if policy is not None:
                    policy.before_admit(req, self.now / 1000.0)
                t0 = clock()
                hit, n_hit, _ = get_computed_blocks(req)
                lookup_ns += clock() - t0
                lookup_calls += 1
                k = req.num_tokens - n_hit
                if not chunked and k > budget:
                    break
                if k > budget:
                    k = budget
                t0 = clock()
                new = allocate_slots(req, k, n_hit, hit)
                admit_ns += clock() - t0
                admit_calls += 1
                if new is None:
                    if not running and policy is not None and policy.give_way(mgr):
                        continue  # an idle pool: pins give way rather than starve it
                    break
                if policy is not None:
                    policy.after_admit(self.mgr, req, n_hit)
                waiting.popleft()
                record(req, n_hit)
                if req.num_preemptions == 0:
                    blocks_queried += len(req.block_hashes)
                    blocks_hit += n_hit // b
                    if on_admit is not None:
                        on_admit(req, self.now)
                if fp is not None:
                    fp.update(("h" + _ids(hit)).encode())
                    fp.update(("n" + _ids(new)).encode())
                req.status = RUNNING
                req.num_computed_tokens = n_hit
                req.hit_blocks = req.table_blocks = n_hit // b
                self._allocated(req, n_hit + k)
                req.cached_blocks = min(n_hit + k, req.num_tokens, len(req.block_hashes) * b) // b
                running.append(req)
                scheduled.append((req, k))
                budget -= k

        if not scheduled:
            raise RuntimeError(
                f"scheduler stalled at step {self.steps} with {len(running)} running and "
                f"{len(waiting)} waiting requests"
            )

        # (3) Model step.
        any_finished = False
        for req, k in scheduled:
            req.num_computed_tokens += k
            if req.num_computed_tokens == req.num_tokens:
                if req.num_output_tokens < req.output_len:
                    # sample one token; hash the block it completes, if any
                    req.num_output_tokens += 1
                    req.num_tokens += 1
                    if req.num_output_tokens == 1 and on_first_token is not None:
                        on_first_token(req, self.now)
                    if req.num_tokens >= (len(req.block_hashes) + 1) * b:
                        self._hash_outputs(req)
                if req.num_output_tokens >= req.output_len:
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    any_finished = True

        # (4) Finish, in running order.
        if any_finished:
            still: list[SimRequest] = []
            for req in running:
                if req.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                    self._free(req)
                    res.served += 1
                    self.done += 1
                else:
                    still.append(req)
            running[:] = still
            if self.progress is not None:
                self.progress(self.done)
        self.usage.append(res.usable_blocks - mgr.block_pool.get_num_free_blocks())
        self.steps += 1
        self.lookup_ns += lookup_ns
        self.admit_ns += admit_ns
        self.step_ns += step_ns
        self.lookup_calls += lookup_calls
        self.admit_calls += admit_calls
        self.step_calls += step_calls
        self.blocks_queried += blocks_queried
        self.blocks_hit += blocks_hit

    def finish(self) -> None:
        """Write the run's counters into the result."""
        res = self.res
        if self.progress is not None:
            self.progress(self.done)
        res.steps = self.steps
        res.sim_time_s = self.now / 1e3
        res.lookup_ns, res.admit_alloc_ns, res.step_alloc_ns, res.free_ns = (
            self.lookup_ns, self.admit_ns, self.step_ns, self.free_ns)
        res.lookup_calls, res.admit_alloc_calls, res.step_alloc_calls = (
            self.lookup_calls, self.admit_calls, self.step_calls)
        res.free_calls = res.served + res.preemptions
        res.blocks_queried, res.blocks_hit = self.blocks_queried, self.blocks_hit
        usage = self.usage
        res.usage = np.frombuffer(usage, dtype=np.int32).copy() if usage else np.zeros(0, np.int32)
        res.evictions = self.evictions
