"""Fleet replay: N simulated engines behind a router, their KV events feeding a prefix index.

Each engine is the single-engine simulator's scheduler (:mod:`kvblock.replay.simulator`)
driving its own :class:`kvblock.KVCacheManager` with KV events on. All engines step on one
simulated clock (``step_ms`` per step). A request is routed when it arrives: the router
hashes its prompt (the vLLM block hashes the engine will compute), asks the index for every
instance's cached prefix and sends it to the instance its policy picks
(:class:`kvblock.cluster.Router`). After every step each engine's ``take_events()`` batch is
encoded in vLLM's msgpack wire format and applied to the index: directly (``transport
"direct"``), or through real ZMQ sockets (``"zmq"``: a ``KVEventPublisher`` per engine, one
``KVEventSubscriber``, inproc endpoints). The index is in-process (Rust) or Redis
(``index="redis://host:port"`` / ``"redis+cluster://host:port"``).

With ``check`` on, every routing decision's claimed prefix is compared with what the chosen
engine's block pool really holds (``lookup_prefix``): an over-report (the index claiming a
block the engine does not hold) is counted and must never happen; under-reports (vLLM kept
two copies of a block and evicted one; Redis was down) are counted too.

Reported: fleet and per-instance prefix-cache hit rates (vLLM's hits / queries), requests and
prompt tokens per instance with the load imbalance (max / mean prompt tokens), queueing delay
(arrival to first admission) and time to first token, on the simulated clock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..events import encode_batch
from .blockhash import RequestHasher
from .config import SimConfig, check_engine_memory, check_time_span
from .errors import ReplayError
from .result import ReplayResult, Unservable
from .retention import RetentionPolicy
from .simrequest import SimRequest
from .simulator import _Scheduler
from .trace import Trace, TraceRequest

__all__ = ["FleetConfig", "FleetRequest", "FleetResult", "InstanceStats", "replay_fleet"]

TRANSPORTS = ("direct", "zmq")


class FleetRequest(SimRequest):
    """A replayed request with what a ``BlockStored`` event reads from a vLLM request (no
    multimodal features, LoRA, salt or prompt embeddings; the simulator does not materialise
    token ids, so the events carry none) and its routing times."""

    __slots__ = ("arrival_ms", "admitted_ms", "first_token_ms", "instance")
    mm_features: list = []
    lora_request = None
    cache_salt = None
    prompt_embeds = None
    _prompt_embeds_per_block_hashes = None
    all_token_ids: tuple = ()

    def __init__(self, spec: TraceRequest) -> None:
        super().__init__(spec)
        self.arrival_ms = 0.0
        self.admitted_ms: float | None = None
        self.first_token_ms: float | None = None
        self.instance = ""


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet is set up (the engines' own settings are a :class:`SimConfig`).

    Attributes:
        instances: engines in the fleet.
        router: ``round-robin``, ``least-loaded`` or ``cache-aware``.
        index: ``"memory"`` (in-process) or a Redis URL.
        load_weight: the cache-aware router's weight of a token of load.
        transport: ``"direct"`` (payloads applied to the index) or ``"zmq"``.
        check: compare every routing claim with the chosen engine's pool.
        check_all: compare the index's claims for every instance, not only the chosen one.
        speculative_ttl_ms: > 0: the cache-aware router also records speculative entries
            (:class:`~kvblock.cluster.speculative.SpeculativeIndex`) living this long on the
            simulated clock unless the engines' events confirm or drop them first; 0: off.
        index_max_pairs: the in-process index's memory cap in (block, instance) pairs, >= 1 (None:
            none); what it evicts is reported (``index.evicted_pairs``) and the claims are
            still checked against the engines (an evicted block is an under-report).
    """

    instances: int = 4
    router: str = "cache-aware"
    index: str = "memory"
    load_weight: float = 0.5
    transport: str = "direct"
    check: bool = True
    check_all: bool = False
    speculative_ttl_ms: float = 0.0
    index_max_pairs: int | None = None

    def validate(self) -> "FleetConfig":
        from ..cluster.router import POLICIES

        if self.instances < 1:
            raise ReplayError(f"--instances must be >= 1, got {self.instances}")
        if self.router not in POLICIES:
            raise ReplayError(f"unknown --router {self.router!r}; choose from {', '.join(POLICIES)}")
        if not 0 <= self.speculative_ttl_ms <= 366 * 86_400_000:  # NaN, inf, past a trace's 366 days
            raise ReplayError(
                f"--speculative-ttl-ms must be >= 0 and at most 366 days (31,622,400,000 ms), "
                f"got {self.speculative_ttl_ms:g}"
            )
        if not 0 <= self.load_weight < math.inf:
            raise ReplayError(f"--load-weight must be a finite number >= 0, got {self.load_weight}")
        if self.transport not in TRANSPORTS:
            raise ReplayError(f"unknown --transport {self.transport!r}; choose from {', '.join(TRANSPORTS)}")
        if self.index_max_pairs is not None:
            if isinstance(self.index_max_pairs, bool) or not isinstance(self.index_max_pairs, int) \
                    or self.index_max_pairs < 1:
                raise ReplayError(f"--index-max-pairs must be an int >= 1 (a cap of 0 would hold nothing; omit it "
                                  f"for no cap), got {self.index_max_pairs!r}")
            if self.index != "memory":
                raise ReplayError("--index-max-pairs caps the in-process index ('--index memory')")
        if self.index != "memory" and not self.index.startswith(("redis://", "redis+cluster://", "unix://")):
            raise ReplayError(f"--index must be 'memory' or a redis:// / redis+cluster:// URL, got {self.index!r}")
        return self


@dataclass
class InstanceStats:
    """One engine of the fleet."""

    name: str
    requests: int
    prompt_tokens: int
    queries: int
    hits: int
    evictions: int
    preemptions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate,
                "evictions": self.evictions, "preemptions": self.preemptions}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


@dataclass
class FleetResult:
    """What a fleet replay measured (times on the simulated clock, in ms)."""

    workload: str
    config: dict[str, Any]
    fleet: dict[str, Any]
    requests: int = 0
    served: int = 0
    unservable: int = 0
    #: ``(instance, request)`` of each unservable request.
    unservable_requests: list[tuple[str, Unservable]] = field(default_factory=list)
    prompt_tokens: int = 0
    queries: int = 0
    hits: int = 0
    per_instance: list[InstanceStats] = field(default_factory=list)
    queue_delay_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    routed_cached_tokens: int = 0
    over_reports: int = 0
    under_reports: int = 0
    index_fallbacks: int = 0
    index_pairs: int = 0
    index_bytes: int = 0
    #: (block, holder) pairs the index's memory cap evicted.
    index_evicted_pairs: int = 0
    block_events: int = 0
    batches: int = 0
    steps: int = 0
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    index_s: float = 0.0
    #: :class:`~kvblock.cluster.speculative.SpeculationStats` as a dict (speculative runs).
    speculation: dict[str, int] | None = None

    @property
    def routing(self) -> str:
        """How the requests were routed, in words: the router's name, unless a cache-aware
        router's index could not answer (then it routed by load: for every request, or for
        how many)."""
        router = str(self.fleet["router"])
        if not self.index_fallbacks:
            return router
        if self.index_fallbacks >= self.requests:
            return "least-loaded (cache-aware, but its index never answered)"
        return f"{router}, by load for {self.index_fallbacks:,} of {self.requests:,} requests (index unavailable)"

    @property
    def hit_rate(self) -> float:
        """vLLM's prefix-cache hit rate over the fleet: hit tokens / queried tokens."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean of the prompt tokens routed to each instance (1.0: even)."""
        loads = [s.prompt_tokens for s in self.per_instance]
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else 1.0

    def to_dict(self) -> dict[str, Any]:
        q = self.queue_delay_ms
        t = self.ttft_ms
        return {
            "workload": self.workload, "config": self.config, "fleet": self.fleet, "routing": self.routing,
            "requests": self.requests, "served": self.served, "unservable": self.unservable,
            "unservable_requests": [{"instance": i, **u.to_dict()} for i, u in self.unservable_requests],
            "prompt_tokens": self.prompt_tokens, "queries": self.queries, "hits": self.hits,
            "hit_rate": self.hit_rate, "imbalance": self.imbalance,
            "queue_delay_ms": {"mean": float(np.mean(q)) if q else 0.0, "p50": _pct(q, 50), "p99": _pct(q, 99)},
            "ttft_ms": {"mean": float(np.mean(t)) if t else 0.0, "p50": _pct(t, 50), "p99": _pct(t, 99)},
            "routed_cached_tokens": self.routed_cached_tokens, "over_reports": self.over_reports,
            "under_reports": self.under_reports, "index_fallbacks": self.index_fallbacks,
            "index": {"pairs": self.index_pairs, "bytes": self.index_bytes, "evicted_pairs": self.index_evicted_pairs,
                      "block_events": self.block_events,
                      "batches": self.batches, "seconds": self.index_s},
            "per_instance": [s.to_dict() for s in self.per_instance],
            "steps": self.steps, "sim_time_s": self.sim_time_s, "wall_s": self.wall_s,
            "speculation": self.speculation,
        }


def _make_index(spec: str, block_size: int, namespace: str) -> Any:
    from ..cluster import PrefixIndex

    if spec == "memory":
        return PrefixIndex(block_size)
    try:
        from ..cluster.redis_index import RedisPrefixIndex
    except ImportError:
        from .._optional import install_hint

        raise ReplayError(f"--index redis://... needs redis-py: {install_hint('redis', 'cluster')}") from None
    ix = RedisPrefixIndex(spec, namespace, block_size=block_size)
    return ix


class _Transport:
    """Moves each engine's event batches into the index."""

    def __init__(self, kind: str, names: list[str], index: Any) -> None:
        self.kind = kind
        self.index = index
        self.pubs: dict[str, Any] = {}
        self.sub = None
        self.streams: dict[str, Any] = {}
        if kind == "zmq":
            from ..cluster.publisher import KVEventPublisher
            from ..cluster.subscriber import KVEventSubscriber

            tag = f"{id(self):x}"
            self.sub = KVEventSubscriber(index, idle_sync_s=None)
            for n in names:
                pub = KVEventPublisher(f"inproc://kvblock-fleet-{tag}-{n}", f"inproc://kvblock-fleet-{tag}-{n}-replay")
                self.pubs[n] = pub
                self.streams[n] = self.sub.add_engine(n, pub.endpoint, pub.replay_endpoint)

    def send(self, name: str, payload: bytes) -> None:
        if self.kind == "direct":
            self.index.apply(name, payload)
        else:
            self.pubs[name].publish_payload(payload)

    def flush(self) -> None:
        """Deliver everything sent (the router must see the state after the step)."""
        if self.sub is None:
            return
        deadline = time.monotonic() + 10
        while True:
            lagging = [n for n, p in self.pubs.items() if (self.streams[n].expected or 0) < p.next_seq]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"KV events of {lagging[0]} were not delivered")
            if self.sub.poll(5) == 0:
                # batches lost to the slow joiner: ask the replay buffers
                for n in lagging:
                    self.streams[n].catch_up()

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
        for p in self.pubs.values():
            p.close()


def _count_claim(out: FleetResult, claimed: int, engine: _Scheduler, hashes: list) -> None:
    truth = len(engine.mgr.block_pool.lookup_prefix(hashes)) if hashes else 0
    if claimed > truth:
        out.over_reports += 1
    elif claimed < truth:
        out.under_reports += 1


def replay_fleet(trace: Trace, cfg: SimConfig, fleet: FleetConfig,
                 progress: Callable[[int], None] | None = None) -> FleetResult:
    """Replay ``trace`` on ``fleet.instances`` engines configured by ``cfg`` (each with
    ``cfg.num_blocks`` blocks) behind a router; see the module docstring.

    Raises:
        ReplayError: invalid settings (an ideal replay, the reference implementation, ...), or
            engines whose pools would not fit in the memory available
            (:func:`~kvblock.replay.config.check_engine_memory`).
    """
    from ..cluster import Router
    from ..manager import KVCacheManager
    from .backends import get_impl

    cfg.validate()
    fleet.validate()
    check_time_span(trace, cfg)
    check_engine_memory(fleet.instances, cfg.num_blocks)
    if cfg.ideal:
        raise ReplayError("a fleet replay schedules requests; --ideal is for one engine")
    if cfg.impl != "kvblock":
        raise ReplayError("a fleet replay runs kvblock's KVCacheManager (--impl kvblock)")
    t_start = time.perf_counter()
    names = [f"engine-{i}" for i in range(fleet.instances)]
    num_blocks = cfg.resolved_num_blocks(trace)
    impl = get_impl("kvblock")
    hasher = RequestHasher(impl, cfg.block_size, cfg.hash_algo, trace.trace_block_size)
    engines: list[_Scheduler] = []
    for name in names:
        policy = RetentionPolicy(cfg.retention, cfg.block_size, cfg.pin_tokens, cfg.ttl_s)
        mgr = KVCacheManager(num_blocks, cfg.block_size, hash_algo=cfg.hash_algo, log_stats=True,
                             enable_kv_cache_events=True, **policy.manager_kwargs())
        res = ReplayResult(workload=trace.name, source=trace.source, impl="kvblock", mode="fleet",
                           config=cfg.describe(trace), requests=0, prompt_tokens=0, usable_blocks=num_blocks - 1)
        e = _Scheduler(trace, cfg, mgr, hasher, res, None, None)
        e.request_type = FleetRequest
        e.policy = policy  # each engine its own --retention state
        engines.append(e)
    hasher.start_run()
    namespace = f"fleet-{int(time.time() * 1000)}-{id(engines):x}"
    index = _make_index(fleet.index, cfg.block_size, namespace)
    if fleet.index_max_pairs is not None:
        index.max_pairs = fleet.index_max_pairs
    now = 0.0
    if fleet.speculative_ttl_ms > 0 and fleet.router == "cache-aware":
        from ..cluster.speculative import SpeculativeIndex

        index = SpeculativeIndex(index, fleet.speculative_ttl_ms, lambda: now)
    transport = _Transport(fleet.transport, names, index)
    router = Router(names, index if fleet.router == "cache-aware" else None, fleet.router,
                    block_size=cfg.block_size, load_weight=fleet.load_weight)
    out = FleetResult(workload=trace.name, config=cfg.describe(trace),
                      fleet={"instances": fleet.instances, "router": fleet.router, "index": fleet.index,
                             "load_weight": fleet.load_weight, "transport": fleet.transport,
                             "speculative_ttl_ms": fleet.speculative_ttl_ms,
                             "index_max_pairs": fleet.index_max_pairs},
                      requests=len(trace.requests), prompt_tokens=trace.num_prompt_tokens)
    step_ms = cfg.step_ms

    def admitted(req: Any, now: float) -> None:
        req.admitted_ms = now
        out.queue_delay_ms.append(now - req.arrival_ms)

    def first_token(req: Any, now: float) -> None:
        out.ttft_ms.append(now + step_ms - req.arrival_ms)

    routed_tokens = {n: 0 for n in names}
    routed_requests = {n: 0 for n in names}
    for e in engines:
        e.on_admit = admitted
        e.on_first_token = first_token
    pending = deque(trace.requests)
    scale = cfg.time_scale
    done = 0
    index_s = 0.0
    try:
        while pending or any(e.busy for e in engines):
            if pending:
                if not cfg.asap and not any(e.busy for e in engines):
                    now = max(now, pending[0].arrival_ms * scale)
                if cfg.asap or pending[0].arrival_ms * scale <= now:
                    # the loads the router sees: tokens of running requests, prompt tokens still to prefill
                    for name, e in zip(names, engines):
                        router.set_load(name, sum(r.num_tokens for r in e.running),
                                        sum(r.num_tokens - r.num_computed_tokens for r in e.waiting))
                while pending and (cfg.asap or pending[0].arrival_ms * scale <= now):
                    tr = pending.popleft()
                    hashes = hasher.prompt_hashes(tr)
                    t0 = time.perf_counter()
                    d = router.route(hashes, tr.prompt_len)
                    index_s += time.perf_counter() - t0
                    if not d.index_available:
                        out.index_fallbacks += 1
                    k = names.index(d.instance)
                    e = engines[k]
                    if fleet.check_all and d.index_available:
                        claims = index.match(hashes) if hashes else {}
                        for n2, e2 in zip(names, engines):
                            _count_claim(out, claims.get(n2, 0), e2, hashes)
                    elif fleet.check and d.cached_blocks and fleet.router == "cache-aware":
                        _count_claim(out, d.cached_blocks, e, hashes)
                    out.routed_cached_tokens += d.cached_tokens
                    req = e.add(tr)
                    routed_requests[d.instance] += 1
                    routed_tokens[d.instance] += tr.prompt_len
                    if req is None:
                        done += 1
                        continue
                    req.block_hashes = hashes
                    req.hashed = True
                    req.arrival_ms = tr.arrival_ms * scale if not cfg.asap else 0.0
                    req.instance = d.instance
                    router.add_waiting(d.instance, tr.prompt_len)
                if not any(e.busy for e in engines):
                    continue
            for name, e in zip(names, engines):
                if not e.busy:
                    continue
                e.now = now
                before = e.done
                e.step()
                done += e.done - before
                events = e.mgr.take_events()
                if events:
                    payload = encode_batch(events, ts=now / 1e3)
                    t0 = time.perf_counter()
                    transport.send(name, payload)
                    index_s += time.perf_counter() - t0
                    out.batches += 1
                    out.block_events += sum(len(getattr(ev, "block_hashes", ())) for ev in events)
            t0 = time.perf_counter()
            transport.flush()
            index_s += time.perf_counter() - t0
            now += step_ms
            out.steps += 1
            if progress is not None:
                progress(done)
    finally:
        transport.close()
    for name, e in zip(names, engines):
        e.now = now
        e.finish()
        st = e.mgr.make_prefix_cache_stats()
        r = e.res
        out.per_instance.append(InstanceStats(name, routed_requests[name], routed_tokens[name], st.queries, st.hits,
                                              r.evictions, r.preemptions))
        out.queries += st.queries
        out.hits += st.hits
        out.served += r.served
        out.unservable += len(r.unservable)
        out.unservable_requests += [(name, u) for u in r.unservable]
    out.index_fallbacks = max(out.index_fallbacks, router.fallbacks)
    if getattr(index, "speculative", False):
        index.expire(now)
        out.speculation = index.stats.to_dict()
        index = index.index
    mirror = getattr(index, "mirror", index)
    out.index_pairs = mirror.num_pairs()
    out.index_bytes = mirror.memory_bytes() if hasattr(mirror, "memory_bytes") else 0
    out.index_evicted_pairs = int(mirror.evicted()[0]) if hasattr(mirror, "evicted") else 0
    if hasattr(index, "close"):
        index.close()
    out.sim_time_s = now / 1e3
    out.index_s = index_s
    out.wall_s = time.perf_counter() - t_start
    return out


# -- reports and sweeps ---------------------------------------------------------------------------

def render_fleet(r: FleetResult, console: Any) -> None:
    """Print a fleet replay's report (rich)."""
    from rich.table import Table

    from .report import print_table

    d = r.to_dict()
    f = r.fleet
    plural = "s" if f["instances"] != 1 else ""
    console.print(f"[bold]{r.workload}[/bold]: {f['instances']} instance{plural}, router [bold]{r.routing}[/bold], "
                  f"index {f['index']} ({f['transport']})"
                  + (f", retention [bold]{r.config['retention']}[/bold]" if "retention" in r.config else ""))
    t = Table(title="fleet", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("requests served / unservable", f"{r.served:,} / {r.unservable:,}")
    t.add_row("prefix-cache hit rate (hits / queries)", f"{100 * r.hit_rate:.2f}%  ({r.hits:,} / {r.queries:,} tokens)")
    t.add_row("load imbalance (max / mean prompt tokens)", f"{r.imbalance:.2f}")
    qd, tt = d["queue_delay_ms"], d["ttft_ms"]
    t.add_row("queueing delay mean / p50 / p99", f"{qd['mean']:,.0f} / {qd['p50']:,.0f} / {qd['p99']:,.0f} ms")
    t.add_row("time to first token mean / p50 / p99", f"{tt['mean']:,.0f} / {tt['p50']:,.0f} / {tt['p99']:,.0f} ms")
    t.add_row("KV events into the index", f"{r.block_events:,} block events in {r.batches:,} batches")
    t.add_row("index at the end", f"{r.index_pairs:,} (block, holder) pairs, {r.index_bytes:,} bytes")
    if f.get("index_max_pairs") is not None:
        t.add_row(f"index memory cap ({f['index_max_pairs']:,} pairs): pairs evicted", f"{r.index_evicted_pairs:,}")
    t.add_row("routing claims over / under the engine's truth", f"{r.over_reports:,} / {r.under_reports:,}")
    if r.index_fallbacks:
        t.add_row("routed by load (index unavailable)", f"{r.index_fallbacks:,}")
    if r.speculation is not None:
        sp = r.speculation
        t.add_row(f"speculative blocks (TTL {f['speculative_ttl_ms']:g} ms) added: confirmed / dropped / expired",
                  f"{sp['added']:,}: {sp['confirmed']:,} / {sp['dropped']:,} / {sp['expired']:,}")
    t.add_row("simulated time / wall time", f"{r.sim_time_s:,.1f} s / {r.wall_s:,.1f} s (index {r.index_s:.1f} s)")
    print_table(console, t)
    pi = Table(title="per instance")
    for col in ("instance", "requests", "prompt tokens", "hit rate", "evictions", "preemptions"):
        pi.add_column(col, justify="right")
    for s in r.per_instance:
        pi.add_row(s.name, f"{s.requests:,}", f"{s.prompt_tokens:,}", f"{100 * s.hit_rate:.2f}%",
                   f"{s.evictions:,}", f"{s.preemptions:,}")
    print_table(console, pi)


def fleet_sweep(trace: Trace, cfg: SimConfig, instance_counts: list[int], routers: list[str],
                fleet: FleetConfig, progress: Callable[[int], None] | None = None) -> dict[str, list[FleetResult]]:
    """A fleet replay of ``trace`` for every router and instance count: ``{router: [result
    per count]}``."""
    from dataclasses import replace

    out: dict[str, list[FleetResult]] = {}
    base = 0
    n = len(trace.requests)
    for router in routers:
        for count in instance_counts:
            f = replace(fleet, instances=count, router=router)
            off = base
            r = replay_fleet(trace, cfg, f, None if progress is None else (lambda d, o=off: progress(o + d)))
            out.setdefault(router, []).append(r)
            base += n
    return out


def plot_fleet_sweep(results: dict[str, list[FleetResult]], path: str, title: str | None = None) -> None:
    """Fleet hit rate and queueing delay against instance count, one line per router.

    Raises:
        ReplayError: matplotlib is missing or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        from .plot import PLOT_HINT

        raise ReplayError(PLOT_HINT) from None
    fig = Figure(figsize=(9.0, 3.8), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    from .plot import series_style

    counts: list[int] = []
    for i, (router, rs) in enumerate(results.items()):
        xs = [r.fleet["instances"] for r in rs]
        counts = sorted(set(counts) | set(xs))
        style = series_style(i)  # equal lines (one instance: every router) stay visible
        ax1.plot(xs, [100 * r.hit_rate for r in rs], label=router, **style)
        ax2.plot(xs, [r.to_dict()["queue_delay_ms"]["mean"] for r in rs], label=router, **style)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_xlabel("engine instances")
        ax.grid(True, alpha=0.35)
    ax1.set_ylabel("fleet prefix-cache hit rate (%)")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("mean queueing delay (ms)")
    ax2.set_ylim(bottom=0)
    ax1.legend(fontsize="small")
    any_r = next(iter(results.values()))[0]
    cfg = any_r.config
    fig.suptitle(title or f"{any_r.workload} ({any_r.requests:,} requests): {cfg['num_blocks']:,} blocks of "
                 f"{cfg['block_size']} tokens per instance", fontsize="medium")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise ReplayError(f"cannot write plot {path}: {e}") from None
