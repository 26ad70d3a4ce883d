"""The ``kvblock`` command.

``kvblock info``     build profile, version, and a hashing speed table (kvblock vs the
                     pure-Python reference on a 4096-token prompt).
``kvblock replay``   replay a request trace (Mooncake, Bailian or token-id JSONL) or a built-in
                     workload through a continuous-batching scheduler simulator driving the KV
                     cache manager; report hit rates, evictions, preemptions and costs. With
                     ``--instances N --router POLICY`` a fleet of N engines behind a router.
``kvblock sweep``    hit rate against cache capacity for one or more traces, with a plot; with
                     ``--instances``, fleet hit rate against instance count per routing policy.
``kvblock index serve``  the fleet prefix index as an HTTP service: subscribes to engines'
                     ZMQ KV-event streams, answers ``POST /score`` (see
                     ``kvblock.cluster.service``; needs the ``cluster`` extra).
``kvblock demo``     a tiny paged-attention model served with prefix caching on and off: the
                     outputs are identical (needs the ``torch`` extra).

Exit status: 0 success (``index serve``: stopped by SIGTERM); 1 ``--compare`` found kvblock and
the reference disagreeing, or ``index serve`` cannot bind its address; 2 bad input or settings
(the message says which; never a traceback); 3 some requests can never fit in the cache (the
report of the others is printed first); 130 interrupted (Ctrl-C), at any point. Standard output's
reader gone before the output was written (``kvblock ... | head -1``): the command stops quietly
(no message) with 0, every command alike, as it would if the output had fitted in the pipe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from . import _core


def _best_ns(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def hashing_table(block_size: int = 16, num_tokens: int = 4096, repeat: int = 20) -> list[dict]:
    """ns per block of ``kvblock.hash_blocks`` vs the reference, for every algorithm (best of
    ``repeat`` runs; ValueError below 1)."""
    if repeat < 1:
        raise ValueError(f"repeat: must be >= 1, got {repeat}")
    import numpy as np

    from . import hashing
    from .reference import hashing as ref

    rng = np.random.default_rng(1234567)
    arr = rng.integers(0, 128000, size=num_tokens, dtype=np.int64)
    toks = arr.tolist()
    root = bytes(32)
    n_blocks = num_tokens // block_size
    rows = []
    for algo in hashing.ALGORITHMS:
        fast = _best_ns(lambda: hashing.hash_blocks(arr, block_size, algo=algo, parent=root), repeat) / n_blocks
        slow = _best_ns(lambda: ref.hash_blocks(toks, block_size, algo=algo, parent=root), max(3, repeat // 5)) / n_blocks
        rows.append({"algo": algo, "kvblock_ns_per_block": fast, "reference_ns_per_block": slow, "speedup": slow / fast})
    return rows


def _cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"kvblock {_core.__version__} — core build profile: [bold]{_core.BUILD_PROFILE}[/bold]")
    if _core.BUILD_PROFILE != "release":
        console.print("[yellow]warning: a debug build; timings are not representative[/yellow]")
    rows = hashing_table(repeat=args.repeat)
    table = Table(title=f"Block hashing, {4096} tokens in blocks of 16 (best of {args.repeat})")
    table.add_column("algorithm")
    table.add_column("kvblock ns/block", justify="right")
    table.add_column("reference ns/block", justify="right")
    table.add_column("speedup", justify="right")
    for r in rows:
        table.add_row(r["algo"], f"{r['kvblock_ns_per_block']:.0f}", f"{r['reference_ns_per_block']:.0f}", f"{r['speedup']:.1f}x")
    _print_table(console, table)
    return 0


# -- replay / sweep ----------------------------------------------------------------------------

def _num_blocks(text: str) -> int | None:
    """A block count (``10k`` and ``1m`` suffixes allowed) or ``unlimited``."""
    from .replay.errors import ReplayError
    from .replay.sweep import parse_capacities

    try:
        caps = parse_capacities([text], sizes_in_bytes=False)
    except ReplayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len(caps) != 1:
        raise argparse.ArgumentTypeError(f"expected one block count or 'unlimited', got {text!r}")
    return caps[0]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free port), got {value}")
    return value


def _tier_weight(text: str) -> tuple[str, float]:
    """``MEDIUM=W`` (``--tier-weight``): a medium's name and its weight, a number >= 0."""
    import math

    medium, sep, w = text.partition("=")
    if not sep or not medium:
        raise argparse.ArgumentTypeError(f"expected MEDIUM=WEIGHT (e.g. CPU=0.75), got {text!r}")
    weight = _float(w)
    if not math.isfinite(weight) or weight < 0:
        raise argparse.ArgumentTypeError(f"the weight of {medium} must be a finite number >= 0, got {w!r}")
    return medium, weight


def version_line() -> str:
    """``kvblock --version``: the package's version, and the Rust core's (version, build
    profile and file: a stale ``_core*.so`` shadowing a new build shows here)."""
    from importlib import metadata

    try:
        package = metadata.version("kvblock")
    except metadata.PackageNotFoundError:
        package = "(not installed)"
    return (f"kvblock {package}, Rust core {_core.__version__} ({_core.BUILD_PROFILE} build, "
            f"{getattr(_core, '__file__', '?')})")


def _print_table(console: Any, table: Any) -> None:
    from .replay.report import print_table

    print_table(console, table)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _add_input_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace input")
    g.add_argument("--format", choices=("auto", "mooncake", "bailian", "tokens"), default="auto",
                   help="trace file format (default: detected from the first line)")
    g.add_argument("--trace-block-size", type=_int, default=None, metavar="N",
                   help="tokens per trace hash id (default 512 for Mooncake, 16 for Bailian)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed or invalid trace lines instead of stopping at the first")
    g.add_argument("--limit", type=_int, default=None, metavar="N", help="replay only the first N requests")


def _load_input(spec: str, args: argparse.Namespace) -> Any:
    """A trace file, or ``builtin:NAME`` for a built-in workload."""
    from .replay import ReplayError, builtin_workload, load_trace

    if spec.startswith("builtin:"):
        trace = builtin_workload(spec[len("builtin:"):])
        if args.limit is not None:
            if args.limit <= 0:
                raise ReplayError(f"--limit must be > 0, got {args.limit}")
            trace = trace.head(args.limit)
        return trace
    return load_trace(spec, format=args.format, trace_block_size=args.trace_block_size,
                      skip_bad_lines=args.skip_bad_lines, limit=args.limit)


def _warn_skipped(trace: Any, err: Any) -> None:
    if trace.bad_lines:
        first = trace.bad_lines[0]
        err.print(f"[yellow]warning:[/yellow] {trace.source}: skipped {len(trace.bad_lines):,} bad "
                  f"line(s); first, line {first.line}: {first.reason}", markup=True, highlight=False)


#: replay options that map to SimConfig fields (None = not given on the command line).
_CONFIG_OPTIONS = ("num_blocks", "block_size", "hash_algo", "impl", "max_running", "token_budget",
                   "chunked_prefill", "asap", "step_ms", "time_scale", "retention", "ttl_s", "pin_tokens")


def _replay_config(args: argparse.Namespace, trace: Any) -> Any:
    from .replay.config import DEFAULTS

    given = {name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not _UNSET}
    if "token_budget" in given:
        given["token_budget"] = given["token_budget"] or None
    cfg = DEFAULTS.with_defaults(trace.defaults, set(given))
    return replace(cfg, ideal=args.ideal, fingerprint=args.fingerprint, **given).validate()


def _unservable_error(unservable: Sequence[Any], usable_blocks: int) -> Any:
    """The exit-3 error for a replay's (or a fleet's) unservable requests; None if none."""
    from .replay import UnservableRequestsError

    if not unservable:
        return None
    # trace order (a fleet reports them per instance)
    first = min(unservable, key=lambda u: (u.line or 0, str(u.request_id)))
    where = f" (line {first.line})" if first.line else ""
    need = max(u.blocks_needed for u in unservable)
    hint = (f"raise --num-blocks to at least {need + 1:,} for all of them (the largest needs {need:,} blocks "
            f"besides the null block)" if need > usable_blocks
            else "raise --token-budget or enable chunked prefill")
    return UnservableRequestsError(
        f"{len(unservable):,} request(s) can never fit and were not replayed; first "
        f"{first.request_id}{where}: {first.reason}; {hint}",
        len(unservable),
    )


def _cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .replay import Replayer, ReplayError
    from .replay.progress import replay_progress
    from .replay.report import compare_results, render_comparison, render_result

    out, err = Console(), Console(stderr=True)
    if args.trace is not None and args.workload is not None:
        raise ReplayError("give either a TRACE file or --workload, not both")
    spec = args.trace if args.trace is not None else f"builtin:{args.workload or _DEFAULT_WORKLOAD}"
    trace = _load_input(spec, args)
    _warn_skipped(trace, err)
    cfg = _replay_config(args, trace)
    for option, field, policy in (("--ttl-s", "ttl_s", "ttl"), ("--pin-tokens", "pin_tokens", "pin-system-prompts")):
        if getattr(args, field) is not _UNSET and cfg.retention != policy:
            err.print(f"[yellow]warning:[/yellow] {option} is a setting of --retention {policy}; with --retention "
                      f"{cfg.retention} it is ignored", markup=True, highlight=False)
    given = _fleet_options_given(args)
    if given:
        return _fleet_replay(args, trace, cfg, out, err, given)
    impls = ("kvblock", "reference") if args.compare else (cfg.impl,)
    results = []
    for name in impls:
        c = replace(cfg, impl=name)
        label = f"replay ({name})"
        with replay_progress(len(trace.requests), label, err, not args.no_progress) as progress:
            results.append(Replayer(name, c.block_size, c.hash_algo).run(trace, c, progress))
    status = 0
    if args.compare:
        cmp = compare_results(results[0], results[1])
        if args.json:
            print(json.dumps(cmp.to_dict(), indent=2))
        else:
            render_result(results[0], out)
            render_comparison(cmp, out)
        if not cmp.identical:
            err.print("[red]kvblock: kvblock and the reference disagree (see the mismatches above)[/red]")
            status = 1
    elif args.json:
        print(json.dumps(results[0].to_dict(), indent=2))
    else:
        render_result(results[0], out)
    unservable = _unservable_error(results[0].unservable, results[0].usable_blocks)
    if unservable is not None:
        raise unservable
    return status


#: the fleet options of ``replay`` (and ``sweep``): any of them given runs a fleet.
_FLEET_OPTIONS = ("instances", "router", "routers", "index", "load_weight", "transport", "speculative_ttl_ms",
                  "index_max_pairs")


def _fleet_options_given(args: argparse.Namespace) -> list[str]:
    """The fleet options given on the command line, as flags (--instances, ...)."""
    return ["--" + name.replace("_", "-") for name in _FLEET_OPTIONS if getattr(args, name, None) is not None]


def _fleet_config(args: argparse.Namespace, instances: int, router: str) -> Any:
    from .replay.fleet import FleetConfig

    d = FleetConfig()
    pick = lambda name: d.__dict__[name] if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    return FleetConfig(instances=instances, router=router, index=pick("index"),
                       load_weight=pick("load_weight"), transport=pick("transport"),
                       speculative_ttl_ms=pick("speculative_ttl_ms"),
                       index_max_pairs=pick("index_max_pairs")).validate()


def _fleet_replay(args: argparse.Namespace, trace: Any, cfg: Any, out: Any, err: Any, given: list[str]) -> int:
    from .replay import ReplayError
    from .replay.fleet import render_fleet, replay_fleet
    from .replay.progress import replay_progress

    if args.compare or args.ideal or args.fingerprint:
        raise ReplayError(f"{' / '.join(given)} (a fleet replay) cannot be combined with "
                          "--compare, --ideal or --fingerprint")
    fleet = _fleet_config(args, args.instances if args.instances is not None else 1, args.router or "cache-aware")
    if fleet.speculative_ttl_ms > 0 and fleet.router != "cache-aware":
        raise ReplayError(f"--speculative-ttl-ms applies to the cache-aware router, not --router {fleet.router}")
    if args.instances is None:
        err.print(f"kvblock: {' '.join(given)} runs a fleet replay: 1 instance behind the {fleet.router} router "
                  "(give --instances N for more)", highlight=False, soft_wrap=True)
    with replay_progress(len(trace.requests), f"fleet replay ({fleet.instances} x {fleet.router})", err,
                         not args.no_progress) as progress:
        r = replay_fleet(trace, cfg, fleet, progress)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
    else:
        render_fleet(r, out)
    unservable = _unservable_error([u for _, u in r.unservable_requests], cfg.resolved_num_blocks(trace) - 1)
    if unservable is not None:
        raise unservable  # exit 3, as a single engine's replay
    return 0


def _int_list(specs: Sequence[str], what: str) -> list[int]:
    from .replay import ReplayError

    out: list[int] = []
    for spec in specs:
        for part in str(spec).split(","):
            if part.strip():
                try:
                    out.append(int(part))
                except ValueError:
                    raise ReplayError(f"bad {what} {part!r}: expected integers such as 1,2,4,8") from None
    if not out or min(out) < 1:
        raise ReplayError(f"{what}: expected integers >= 1")
    return sorted(set(out))


def _cmd_fleet_sweep(args: argparse.Namespace, out: Any, err: Any) -> int:
    from rich.table import Table

    from .cluster.router import POLICIES
    from .replay import ReplayError, SimConfig
    from .replay.fleet import fleet_sweep, plot_fleet_sweep
    from .replay.memory import load_sizing, resolve_capacities
    from .replay.progress import replay_progress
    from .replay.retention import POLICIES as RETENTION

    counts = _int_list(args.instances, "--instances")
    routers = [r.strip() for spec in args.routers or [_DEFAULT_ROUTERS] for r in spec.split(",") if r.strip()]
    for r in routers:
        if r not in POLICIES:
            raise ReplayError(f"unknown router {r!r}; choose from {', '.join(POLICIES)}")
    if len(args.traces) != 1:
        raise ReplayError("a fleet sweep (--instances) takes one TRACE")
    policies = _policy_list(args.retention)
    if len(policies) != 1 or policies[0] not in RETENTION:
        raise ReplayError(f"a fleet sweep (--instances) replays one --retention policy of {', '.join(RETENTION)} "
                          f"(got {','.join(policies)}); sweep several policies without --instances")
    if args.capacities is None:
        raise ReplayError("a fleet sweep (--instances) needs the blocks of each instance: give one "
                          "--capacities value, e.g. --capacities 10k")
    if args.warmup:
        raise ReplayError("a fleet sweep (--instances) counts every request: --warmup needs a sweep without "
                          "--instances")
    if args.method != "auto" or args.impl != "kvblock":
        raise ReplayError("a fleet sweep (--instances) replays kvblock's manager: --method and --impl do not apply")
    sizing = load_sizing(args.model, args.kv_dtype) if args.model else None
    if args.kv_dtype != "auto" and sizing is None:
        raise ReplayError("--kv-dtype sizes budgets in bytes: give --model too")
    caps, _ = resolve_capacities(args.capacities, sizing, args.block_size)
    if len(caps) != 1:
        raise ReplayError(f"a fleet sweep (--instances) takes one --capacities value, the blocks of each "
                          f"instance (got {len(caps)})")
    trace = _load_input(args.traces[0], args)
    _warn_skipped(trace, err)
    cfg = SimConfig(num_blocks=caps[0], block_size=args.block_size, hash_algo=args.hash_algo,
                    time_scale=1.0 if args.time_scale is None else args.time_scale, retention=policies[0],
                    pin_tokens=args.pin_tokens, ttl_s=args.ttl_s).validate()
    fleet = _fleet_config(args, 1, routers[0])
    total = len(trace.requests) * len(counts) * len(routers)
    with replay_progress(total, "fleet sweep", err, not args.no_progress) as progress:
        results = fleet_sweep(trace, cfg, counts, routers, fleet, progress)
    if args.plot:
        plot_fleet_sweep(results, args.plot, args.title)
    if args.json:
        print(json.dumps({"retention": cfg.retention,
                          "routers": {k: [r.to_dict() for r in v] for k, v in results.items()}, "plot": args.plot},
                         indent=2))
        return 0
    policy = "" if cfg.retention == "lru" else f", retention {cfg.retention}"
    table = Table(title=f"{trace.name}: fleet hit rate vs instances",
                  caption=f"{cfg.resolved_num_blocks(trace):,} blocks of {cfg.block_size} tokens per instance{policy}")
    for col in ("router", "instances", "hit rate", "imbalance", "queue mean", "queue p99", "TTFT p50",
                "over-reports"):
        table.add_column(col, justify="right", no_wrap=True)
    for router, rs in results.items():
        for r in rs:
            d = r.to_dict()
            table.add_row(r.routing, str(r.fleet["instances"]), f"{100 * r.hit_rate:.2f}%", f"{r.imbalance:.2f}",
                          f"{d['queue_delay_ms']['mean'] / 1e3:,.2f} s", f"{d['queue_delay_ms']['p99'] / 1e3:,.2f} s",
                          f"{d['ttft_ms']['p50'] / 1e3:,.2f} s", f"{r.over_reports}")
    _print_table(out, table)
    if args.plot:
        out.print(f"wrote {args.plot}")
    return 0


def _si(n: int) -> str:
    """A count in a few characters (1,234 / 12.3k / 45.67M)."""
    if n < 10_000:
        return f"{n:,}"
    if n < 1_000_000:
        return f"{n / 1e3:.1f}k"
    return f"{n / 1e6:,.2f}M"


def _policy_list(specs: Sequence[str]) -> list[str]:
    from .replay import ReplayError
    from .replay.capacity import POLICIES as CURVE_POLICIES
    from .replay.retention import POLICIES as RETENTION

    POLICIES = RETENTION + tuple(p for p in CURVE_POLICIES if p not in RETENTION)
    out: list[str] = []
    for part in ",".join(specs).split(","):
        p = part.strip()
        if not p:
            continue
        if p not in POLICIES:
            raise ReplayError(f"unknown --retention {p!r}; choose from {', '.join(POLICIES)}")
        if p not in out:
            out.append(p)
    return out or ["lru"]


def _model_names() -> list[str]:
    from .replay.memory import CATALOG

    return list(CATALOG)


def _speedup(hit_rate: float) -> float:
    """Prefill tokens saved as a speedup: ``1 / (1 - hit rate)`` (capped at 1000x, as
    kvcache-simulator caps it)."""
    return min(1000.0, 1.0 / max(1.0 - hit_rate, 0.001))


def _distinct_names(traces: list[Any]) -> list[Any]:
    """Traces whose names clash (two files named tok.jsonl) named by their paths instead, so
    tables and plot legends tell them apart; a clash left (the same file twice) gets #2, #3."""
    from collections import Counter

    counts = Counter(t.name for t in traces)
    out = [replace(t, name=t.source) if counts[t.name] > 1 else t for t in traces]
    seen: Counter[str] = Counter()
    for i, t in enumerate(out):
        seen[t.name] += 1
        if seen[t.name] > 1:
            out[i] = replace(t, name=f"{t.name} #{seen[t.name]}")
    return out


#: a fleet sweep's routers when --routers is not given.
_DEFAULT_ROUTERS = "round-robin,least-loaded,cache-aware"
#: ``kvblock sweep``'s capacities when --capacities is not given (a fleet sweep needs one).
_DEFAULT_CAPACITIES = "1k,2k,5k,10k,20k,50k,100k,inf"


def _cmd_sweep(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .replay import ReplayError, SimConfig
    from .replay.plot import check_plot_target, plot_sweep
    from .replay.progress import replay_progress
    from .replay.sweep import parse_capacities, sweep

    out, err = Console(), Console(stderr=True)
    if args.instances is not None:
        return _cmd_fleet_sweep(args, out, err)
    given = _fleet_options_given(args) + (["--time-scale"] if args.time_scale is not None else [])
    if given:
        raise ReplayError(f"{' / '.join(given)} set a fleet sweep: give --instances LIST too")
    from .replay.memory import load_sizing, resolve_capacities

    sizing = load_sizing(args.model, args.kv_dtype) if args.model else None
    if args.kv_dtype != "auto" and sizing is None:
        raise ReplayError("--kv-dtype sizes budgets in bytes: give --model too")
    capacities, cap_labels = resolve_capacities(args.capacities or [_DEFAULT_CAPACITIES], sizing, args.block_size)
    policies = _policy_list(args.retention)
    from .replay.capacity import POLICIES as CURVE_POLICIES, capacity_sweep, warm_from
    from .replay.retention import POLICIES as RETENTION

    warm_from(1, args.warmup)  # --warmup outside [0, 1): one line, exit 2
    curve_only = [p for p in policies if p not in RETENTION]
    replay_only = [p for p in policies if p not in CURVE_POLICIES]
    if curve_only and replay_only:
        common = [p for p in policies if p in RETENTION and p in CURVE_POLICIES]
        raise ReplayError(
            f"--retention {','.join(policies)} cannot run in one sweep: {', '.join(curve_only)} only the one-pass "
            f"curve computes (--method curve) and {', '.join(replay_only)} only replays (--method replay); "
            f"split it: --retention {','.join(common + curve_only)} and --retention {','.join(common + replay_only)}")
    use_curve = args.method == "curve" or (args.method == "auto" and args.impl == "kvblock"
                                           and all(p in CURVE_POLICIES for p in policies))
    if use_curve:
        bad = [p for p in policies if p not in CURVE_POLICIES]
        if bad or args.impl != "kvblock":
            raise ReplayError(f"--method curve computes {', '.join(CURVE_POLICIES)} with --impl kvblock "
                              f"(got --retention {','.join(policies)}, --impl {args.impl}); use --method replay")
    else:
        if args.warmup:
            raise ReplayError("--warmup needs --method curve (the lru, fifo and optimal policies)")
        for pol in policies:
            if pol in ("fifo", "optimal"):
                raise ReplayError(f"--retention {pol} needs --method curve")
            SimConfig(block_size=args.block_size, hash_algo=args.hash_algo, impl=args.impl, ideal=True,
                      retention=pol, pin_tokens=args.pin_tokens, ttl_s=args.ttl_s).validate()
    if args.plot:
        check_plot_target(args.plot)  # before the sweep: it may take minutes
    if args.traces.count("-") > 1:
        raise ReplayError("standard input ('-') can be read once: give '-' as one TRACE at most")
    traces = _distinct_names([_load_input(spec, args) for spec in args.traces])
    for t in traces:
        _warn_skipped(t, err)
    series = []
    curves: list[Any] = []
    t0 = time.perf_counter()
    if use_curve:
        series, curves = capacity_sweep(traces, capacities, policies, block_size=args.block_size,
                                        hash_algo=args.hash_algo, warmup=args.warmup)
    else:
        total = sum(len(t.requests) for t in traces) * len(capacities) * len(policies)
        with replay_progress(total, "sweep", err, not args.no_progress) as progress:
            for k, pol in enumerate(policies):
                base = k * total // len(policies)
                series += sweep(traces, capacities, block_size=args.block_size, hash_algo=args.hash_algo,
                                impl=args.impl,
                                progress=None if progress is None else (lambda d, b=base: progress(b + d)),
                                retention=pol, pin_tokens=args.pin_tokens, ttl_s=args.ttl_s)
    wall_s = time.perf_counter() - t0
    plot_axis: dict[str, Any] = {}
    if sizing is not None:
        # the x axis in the budgets asked for (ticks at their blocks, labelled as given)
        plot_axis = {"tick_labels": dict(zip(capacities, cap_labels)),
                     "x_label": f"KV-cache memory budget ({args.model}, {args.block_size}-token blocks)"}
    if args.json:
        if args.plot:
            plot_sweep(series, args.plot, args.title, curves, **plot_axis)
        doc: dict[str, Any] = {"block_size": args.block_size, "hash_algo": args.hash_algo, "impl": args.impl,
                               "method": "curve" if use_curve else "replay", "warmup": args.warmup,
                               "wall_s": wall_s, "plot": args.plot, "capacities": capacities,
                               "capacity_labels": cap_labels,
                               "series": [s.to_dict() for s in series]}
        if sizing is not None:
            doc["model"] = {**sizing.to_dict(), "bytes_per_block": sizing.bytes_per_block(args.block_size)}
            for sd in doc["series"]:
                for pd in sd["points"]:
                    pd["memory_bytes"] = sizing.budget_of(pd["num_blocks"], args.block_size)
                    pd["cached_tokens"] = (pd["num_blocks"] - 1) * args.block_size
                    pd["prefill_speedup"] = _speedup(pd["hit_rate"])
        print(json.dumps(doc, indent=2))
        return 0
    if sizing is not None:
        out.print(sizing.describe(args.block_size))
    for s in series:
        how = ("one-pass LRU curve (points it cannot give replayed)" if use_curve and "(" not in s.name
               else "replays") + (f", first {args.warmup:g} of requests as warmup" if args.warmup else "")
        table = Table(title=f"{s.name}: hit rate vs capacity", caption=f"{how}, {s.block_size}-token blocks")
        cols = ["capacity", "hit rate", "vLLM rate", "missed tokens", "unservable", "evictions"]
        if sizing is not None:
            cols[1:1] = ["blocks", "tokens", "memory"]
            cols.insert(6, "prefill speedup")
        rows = []
        for label, p in zip(cap_labels, s.points):
            row = [label, f"{100 * p.hit_rate:.2f}%", f"{100 * p.token_hit_rate:.2f}%", _si(p.misses),
                   f"{p.unservable:,}", _si(p.evictions)]
            if sizing is not None:
                from .replay.memory import format_bytes

                row[1:1] = [f"{p.num_blocks:,}", _si((p.num_blocks - 1) * s.block_size),
                            format_bytes(sizing.budget_of(p.num_blocks, s.block_size))]
                row.insert(6, f"{_speedup(p.hit_rate):.2f}x")
            rows.append(row)
        for col in cols:
            # no cell is cut ("capaci…") or split ("8.00 / GiB"): the wide --model table puts
            # a header's words on lines of their own; print_table widens what still does not fit
            table.add_column(col.replace(" ", "\n") if sizing is not None else col, justify="right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        _print_table(out, table)
    out.print("capacity in blocks" + (" or bytes (blocks = bytes // bytes per block, null block included; "
                                      "tokens = (blocks - 1) x block size)" if sizing is not None else "")
              + "; hit rate = hit tokens / all prompt tokens (unservable requests "
              "count as misses); vLLM rate = hits / queries of the served requests"
              + ("; prefill speedup = 1 / (1 - hit rate), the ideal prefill-only bound kvcache-simulator "
                 "reports" if sizing is not None else ""), style="dim")
    out.print(f"computed in {wall_s:.2f} s", style="dim")
    if args.plot:
        # after the tables: the results are shown even if the plot then fails
        plot_sweep(series, args.plot, args.title, curves, **plot_axis)
        out.print(f"wrote {args.plot}")
    return 0


class _Unset:
    def __repr__(self) -> str:
        return "(workload default)"


_UNSET: Any = _Unset()
_DEFAULT_WORKLOAD = "shared-prompt"


class _Version(argparse.Action):
    """``--version``: print :func:`version_line` as it is (argparse's own action wraps it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_line())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (``kvblock: error: ...``, exit status 2), and no
    abbreviated options (a guessed ``--trace`` would otherwise be read as ``--trace-block-size``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, _usage_message(message, self.prog))

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, but arguments no parser knows are refused with the help of the
        subcommand they were given to (argparse's own check names the top-level parser's)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = _command_of(list(sys.argv[1:] if args is None else args))
            self.exit(2, _usage_message(f"unrecognized arguments: {' '.join(extras)}", prog))
        return ns


def _usage_message(message: str, prog: str) -> str:
    """The line every refused command line prints (exit status 2): the message, then where
    the options are described."""
    return f"kvblock: error: {message} (see {prog} --help)\n"


_SUBCOMMANDS = ("info", "demo", "replay", "sweep", "index", "serve")


def _command_of(argv: Sequence[str]) -> str:
    """``kvblock`` and the subcommand words that lead ``argv`` (the prog of the parser whose
    options a refused setting belongs to)."""
    words = ["kvblock"]
    for a in argv:
        if a not in _SUBCOMMANDS:
            break
        words.append(a)
    return " ".join(words)


def _cmd_index_serve(args: argparse.Namespace) -> int:
    from .cluster.service import BindError, ServiceConfig, parse_engine, serve

    try:  # the settings' own messages name the option; the exception's class is noise here
        engines = [spec for e in args.engine for spec in parse_engine(e)]
        config = ServiceConfig(model=args.model, block_size=args.block_size, hash_algo=args.hash_algo,
                               hash_seed=args.hash_seed, redis=args.redis, redis_ttl_s=args.redis_ttl_s,
                               speculative_ttl_ms=args.speculative_ttl_ms, max_pairs=args.max_pairs,
                               tier_weights=tuple(args.tier_weight) or None).check()
    except ValueError as e:
        print(_usage_message(str(e), "kvblock index serve"), end="", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(config, engines, args.host, args.port)
    except BindError as e:  # nothing was claimed yet: the "serving" line comes after the bind
        print(f"kvblock: error: {e.strerror}", file=sys.stderr)
        return 1
    except ValueError as e:  # the engines or Redis settings, refused before serving
        print(_usage_message(str(e), "kvblock index serve"), end="", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .hashing import ALGORITHMS
    from .replay.workloads import WORKLOADS

    p = _Parser(prog="kvblock", description="vLLM-identical prefix-caching KV block manager")
    p.add_argument("--version", action=_Version, help="kvblock's version and its Rust core's build, then exit")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="build profile and a hashing speed table")
    info.add_argument("--repeat", type=_positive_int, default=20, metavar="N", help="timing repetitions (default 20)")
    info.set_defaults(func=_cmd_info)
    # `kvblock demo ...` is dispatched in main() before parsing (its options belong to
    # kvblock.worker.demo); this entry only lists it in `kvblock --help`.
    sub.add_parser(
        "demo",
        help="paged-attention serving loop: prefix caching on vs off gives identical outputs "
        "(needs torch; see `kvblock demo --help`)",
        add_help=False,
    )

    rp = sub.add_parser(
        "replay",
        help="replay a trace or built-in workload through a continuous-batching simulator",
        description="Replay requests through a continuous-batching scheduler simulator driving the KV cache "
        "manager with vLLM 0.33.0's call pattern, and report prefix-cache hit rates, evictions, "
        "preemptions, blocks in use and manager / hashing costs. With no TRACE the built-in "
        f"{_DEFAULT_WORKLOAD!r} workload runs with its own settings (vLLM 0.33.0 hits 1,150,464 of "
        "2,048,000 tokens on it).",
    )
    rp.add_argument("trace", nargs="?", default=None, metavar="TRACE",
                    help="JSONL trace (Mooncake, Bailian, token ids; .gz allowed), - for standard input, "
                    "or builtin:NAME")
    rp.add_argument("--workload", choices=tuple(WORKLOADS), default=None,
                    help=f"built-in workload to replay when no TRACE is given (default {_DEFAULT_WORKLOAD})")
    _add_input_options(rp)
    g = rp.add_argument_group("cache and scheduler (defaults: the workload's, else these)")
    g.add_argument("--num-blocks", type=_num_blocks, default=_UNSET, metavar="N",
                   help="KV-cache blocks including the null block, or 'unlimited' (default 32768)")
    g.add_argument("--block-size", type=_int, default=_UNSET, metavar="N", help="tokens per block (default 16)")
    g.add_argument("--hash-algo", choices=ALGORITHMS, default=_UNSET, help="block hash (default sha256)")
    g.add_argument("--max-running", type=_int, default=_UNSET, metavar="N",
                   help="most requests running at once, vLLM max_num_seqs (default 256)")
    g.add_argument("--token-budget", type=_int, default=_UNSET, metavar="N",
                   help="tokens per step, vLLM max_num_batched_tokens; 0 = unlimited (default 8192)")
    g.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=_UNSET,
                   help="split long prompts across steps (default on)")
    g.add_argument("--asap", action=argparse.BooleanOptionalAction, default=_UNSET,
                   help="ignore timestamps: all requests wait from the start (default off for traces)")
    g.add_argument("--step-ms", type=_float, default=_UNSET, metavar="MS",
                   help="simulated duration of a scheduler step, at most 366 days (default 20)")
    g.add_argument("--time-scale", type=_float, default=_UNSET, metavar="X",
                   help="multiply arrival times by X; 0.5 doubles the request rate (default 1); the last "
                   "arrival scaled must stay within 366 days, as a trace's own timestamps")
    g.add_argument("--impl", choices=("kvblock", "reference"), default=_UNSET,
                   help="KV cache manager: kvblock (Rust) or the pure-Python reference (default kvblock)")
    g.add_argument("--ideal", action="store_true",
                   help="requests finish instantly: measure the prefix cache alone")
    g.add_argument("--retention", choices=("lru", "priority", "pin-system-prompts", "ttl"), default=_UNSET,
                   help="eviction policy: lru (vLLM's, default), priority (shared prefixes kept over one-off "
                   "prompts), pin-system-prompts (pin hit system prompts, up to 1/4 of the pool), ttl (prompts "
                   "kept first for --ttl-s after use)")
    g.add_argument("--ttl-s", type=_float, default=_UNSET, metavar="S",
                   help="the ttl policy's seconds on the simulated clock (default 300)")
    g.add_argument("--pin-tokens", type=_int, default=_UNSET, metavar="N",
                   help="tokens pin-system-prompts pins per prompt (default 2048)")
    fl = rp.add_argument_group("fleet (any of these runs N engines behind a router)")
    fl.add_argument("--instances", type=_int, default=None, metavar="N",
                    help="engine instances, each with --num-blocks blocks (default 1)")
    fl.add_argument("--router", choices=("round-robin", "least-loaded", "cache-aware"), default=None,
                    help="routing policy (default cache-aware)")
    fl.add_argument("--index", default=None, metavar="URL",
                    help="prefix index: 'memory' (in-process, default), redis://host:port or "
                    "redis+cluster://host:port")
    fl.add_argument("--load-weight", type=_float, default=None, metavar="W",
                    help="cache-aware score = cached tokens - W * load tokens (default 0.5)")
    fl.add_argument("--transport", choices=("direct", "zmq"), default=None,
                    help="events to the index directly, or through ZMQ publisher/subscriber sockets (default direct)")
    fl.add_argument("--speculative-ttl-ms", type=_float, default=None, metavar="MS",
                    help="cache-aware: also count blocks just routed to an instance (speculative entries) until "
                    "its events confirm them or MS pass on the simulated clock (default 0: off)")
    fl.add_argument("--index-max-pairs", type=_positive_int, default=None, metavar="N",
                    help="cap the in-process index at N (block, instance) pairs; the report counts the pairs "
                    "evicted (default: no cap)")
    o = rp.add_argument_group("output")
    o.add_argument("--compare", action="store_true",
                   help="run kvblock and the reference on the same input; print both and the speedup")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--fingerprint", action="store_true",
                   help="also compute the block-id fingerprint (workload README section 5.1)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.set_defaults(func=_cmd_replay)

    sw = sub.add_parser(
        "sweep",
        help="hit rate against cache capacity, with a plot",
        description="Ideal replays (requests finish instantly) of each TRACE at each capacity; prints the hit "
        "rates and, with --plot, draws them against capacity (Mooncake FAST'25 Figure 9 style).",
    )
    sw.add_argument("traces", nargs="+", metavar="TRACE", help="JSONL trace files (- for standard input), or builtin:NAME")
    sw.add_argument("--capacities", nargs="+", default=None, metavar="LIST",
                    help="cache sizes in blocks, e.g. 1k,10k,100k,inf, or in bytes with --model, e.g. 8GiB,512MiB "
                    "(default 1k,2k,5k,10k,20k,50k,100k,inf)")
    sw.add_argument("--plot", default=None, metavar="OUT.png", help="write the plot to this file")
    sw.add_argument("--title", default=None, help="plot title")
    sw.add_argument("--block-size", type=_int, default=16, metavar="N", help="tokens per block (default 16)")
    sw.add_argument("--hash-algo", choices=ALGORITHMS, default="sha256", help="block hash (default sha256)")
    sw.add_argument("--impl", choices=("kvblock", "reference"), default="kvblock", help="KV cache manager")
    sw.add_argument("--retention", nargs="+", default=["lru"], metavar="LIST",
                    help="eviction policies to sweep, e.g. lru,optimal,fifo or lru,priority,pin-system-prompts,ttl "
                    "(default lru; one series per trace and policy; optimal = Belady, fifo = first cached first "
                    "evicted, both at vLLM's block granularity)")
    sw.add_argument("--method", choices=("auto", "curve", "replay"), default="auto",
                    help="curve: lru from one pass over the trace (stack distances), fifo and optimal replayed in "
                    "Rust; replay: one ideal replay of the manager per capacity; auto (default): curve when every "
                    "policy is lru, fifo or optimal and --impl is kvblock")
    sw.add_argument("--warmup", type=_float, default=0.0, metavar="FRACTION",
                    help="the first FRACTION of the requests warm the cache and are not counted, in [0, 1) "
                    "(kvcache-simulator counts the last 50%%: --warmup 0.5; default 0)")
    sw.add_argument("--model", default=None, metavar="NAME|config.json",
                    help="size budgets in bytes (--capacities 8GiB,512MiB) for this model: a Hugging Face "
                    "config.json (or its folder), or one of " + ", ".join(_model_names()) + "; prints bytes/token "
                    "as vLLM sizes the KV cache, and tokens, memory and prefill speedup per capacity")
    sw.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                    help="KV cache dtype for --model: auto (the model's, 2 bytes), bf16, fp16, fp8, fp8_e4m3, "
                    "fp8_e5m2, fp32 (default auto)")
    sw.add_argument("--ttl-s", type=_float, default=300.0, metavar="S", help="the ttl policy's seconds (default 300)")
    sw.add_argument("--pin-tokens", type=_int, default=None, metavar="N",
                    help="tokens pin-system-prompts pins per prompt (default 2048)")
    _add_input_options(sw)
    fs = sw.add_argument_group("fleet sweep (with --instances: hit rate against instance count per router)")
    fs.add_argument("--instances", nargs="+", default=None, metavar="LIST",
                    help="instance counts, e.g. 1,2,4,8,16 (--capacities then gives the blocks per instance)")
    fs.add_argument("--routers", nargs="+", default=None, metavar="LIST",
                    help="routing policies (default all three)")
    fs.add_argument("--index", default=None, metavar="URL", help="prefix index (default in-process)")
    fs.add_argument("--load-weight", type=_float, default=None, metavar="W",
                    help="cache-aware load weight (default 0.5)")
    fs.add_argument("--transport", choices=("direct", "zmq"), default=None,
                    help="how events reach the index (default direct)")
    fs.add_argument("--speculative-ttl-ms", type=_float, default=None, metavar="MS",
                    help="cache-aware: speculative entries living MS on the simulated clock (default 0: off)")
    fs.add_argument("--time-scale", type=_float, default=None, metavar="X",
                    help="multiply arrival times by X (default 1; the last arrival scaled within 366 days)")
    sw.add_argument("--json", action="store_true", help="print the data as JSON")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")
    sw.set_defaults(func=_cmd_sweep)

    ix = sub.add_parser("index", help="the fleet prefix index as a service (kvblock index serve)")
    ixsub = ix.add_subparsers(dest="index_command", required=True, metavar="COMMAND")
    sv = ixsub.add_parser(
        "serve",
        help="HTTP service: subscribe to engines' KV events, answer POST /score",
        description="Subscribe to engines' ZMQ KV-event streams (vLLM's --kv-events-config publisher) and "
        "answer POST /score (block hashes or token ids -> each engine's cached-prefix length), GET /health, "
        "GET /metrics (Prometheus), GET/POST/DELETE /engines. API: docs/index_service.md.",
    )
    sv.add_argument("--engine", action="append", default=[],
                    metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC][,dp=N]",
                    help="an engine's PUB endpoint (and replay ROUTER endpoint); repeat per engine (more can be "
                    "added with POST /engines); ',topic=TOPIC': subscribe to that ZMQ topic only (default: "
                    "every topic); ',dp=N': N data-parallel ranks NAME@dp0.. on vLLM's offset ports")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=_port, default=8000, metavar="N",
                    help="port to listen on, 0-65535 (0: any free port; default 8000)")
    sv.add_argument("--model", default=None, help="the model served; queries naming another are refused (404)")
    sv.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                    help="the engines' tokens per block (default 16)")
    sv.add_argument("--hash-algo", choices=ALGORITHMS, default="sha256",
                    help="the engines' --prefix-caching-hash-algo, for token_ids queries (default sha256)")
    sv.add_argument("--hash-seed", default=None, metavar="SEED",
                    help="the engines' PYTHONHASHSEED (default: vLLM's fixed root for sha256*; xxhash* engines "
                    "without one have random roots, so token_ids queries are refused)")
    sv.add_argument("--redis", default=None, metavar="URL",
                    help="keep the index in Redis: redis://host:port or redis+cluster://host:port")
    sv.add_argument("--redis-ttl-s", type=_positive_float, default=300.0, metavar="S",
                    help="a silent engine's entries expire from Redis after S seconds (default 300)")
    sv.add_argument("--speculative-ttl-ms", type=_float, default=0.0, metavar="MS",
                    help="keep speculative entries (POST /speculate) MS milliseconds unless the engines' events "
                    "confirm or drop them first (default 0: off)")
    sv.add_argument("--max-pairs", type=_positive_int, default=None, metavar="N",
                    help="memory cap: keep at most N (block, engine) pairs, about 16-30 bytes each; past it whole "
                    "blocks are evicted, the deepest first (chains' first blocks last), and counted in "
                    "kvblock_index_evicted_pairs_total (default: no cap)")
    sv.add_argument("--tier-weight", action="append", type=_tier_weight, default=[], metavar="MEDIUM=W",
                    help="a medium's weight, e.g. GPU=1 CPU=0.75 disk=0.25 (repeat per medium): /score also answers "
                    "\"weighted\" tokens, each tier's prefix at its weight (a medium not named weighs 0)")
    sv.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                    help="logging level (default info)")
    sv.set_defaults(func=_cmd_index_serve)
    return p


#: The exit status when standard output's reader goes away (``kvblock ... | head -1``): 0, as
#: ripgrep. Whether the output is cut depends on the pipe's timing (a report that fitted in the
#: pipe before the reader left was written, and the command ended with its own status), so any
#: other status (141 = 128 + SIGPIPE, as a C tool stopped by SIGPIPE) would make the same pipeline
#: end now 0 and now that, failing ``set -o pipefail`` scripts at random. The reader chose to stop
#: reading: a report cut short does not give its exit-3 verdict.
EXIT_STDOUT_CLOSED = 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvblock`` command; returns the exit status (see the module docstring).
    Ctrl-C anywhere in it, imports included: ``kvblock: interrupted``, 130. Standard output's
    reader gone (a closed pipe), while the command writes or at its last flush: no message,
    :data:`EXIT_STDOUT_CLOSED`."""
    try:
        try:
            return _main(argv)
        finally:
            # the output still buffered (argparse's --help too) goes now, where a closed pipe is
            # answered as any other write's, not at the interpreter's exit ("Exception ignored
            # ... BrokenPipeError", exit status 120)
            if sys.stdout is not None:
                sys.stdout.flush()
    except KeyboardInterrupt:
        print("kvblock: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        status = _stdout_closed()
        if isinstance(e.__context__, KeyboardInterrupt):  # Ctrl-C, then the last flush failed
            print("kvblock: interrupted", file=sys.stderr)
            return 130
        return status
    except SystemExit as e:
        # rich's Console answers a broken pipe itself with SystemExit(1) (Console.on_broken_pipe),
        # raised while handling the BrokenPipeError
        if isinstance(e.__context__, BrokenPipeError):
            return _stdout_closed()
        raise


def _stdout_closed() -> int:
    """Standard output's reader is gone: point file descriptor 1 at ``os.devnull`` (the Python
    docs' note on SIGPIPE), so that no later flush, the interpreter's at exit included, can raise
    again; returns :data:`EXIT_STDOUT_CLOSED`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (replaced, closed)
        pass
    return EXIT_STDOUT_CLOSED


#: Options whose values may look negative (``--capacities -1GiB``): argparse reads such a value
#: as an unknown option ("expected at least one argument"); glued to the option
#: (``--capacities=-1GiB``), it reaches the option's own check and message.
_NEGATIVE_VALUE_OPTIONS = ("--capacities",)


def _glue_negative_values(argv: list[str]) -> list[str]:
    """``argv`` with each :data:`_NEGATIVE_VALUE_OPTIONS` option and the values after it that
    argparse would take for options (``-1GiB``, ``-5``) given as one ``--option=a,b`` word;
    a command line without such a value is returned as it is."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        values: list[str] = []
        j = i + 1
        if word in _NEGATIVE_VALUE_OPTIONS:
            while j < len(argv) and (not argv[j].startswith("-") or argv[j][1:2].isdigit() or argv[j][1:2] == "."):
                values.append(argv[j])
                j += 1
        if any(v.startswith("-") for v in values):
            out.append(f"{word}={','.join(values)}")
            i = j
        else:
            out.append(word)
            i += 1
    return out


def _main(argv: Sequence[str] | None) -> int:
    from .replay.errors import ReplayError

    argv = _glue_negative_values(list(sys.argv[1:] if argv is None else argv))
    try:
        if argv[:1] == ["demo"]:
            from .worker.demo_args import build_parser as demo_parser

            demo_parser().parse_args(argv[1:])  # --help and usage errors need no torch
            try:
                from .worker.demo import main as demo_main  # imports torch: only this command needs it
            except ImportError as e:
                print(f"kvblock: error: {e}", file=sys.stderr)
                return 2
            try:
                return demo_main(argv[1:])
            except RuntimeError as e:  # torch's errors, e.g. an unknown or absent device
                print(_usage_message(str(e), "kvblock demo"), end="", file=sys.stderr)
                return 2
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except ReplayError as e:  # exit status 2: the command's input or settings, 3: the run's
        from .replay.errors import SettingError

        if isinstance(e, SettingError):  # a setting named as its option (--num-blocks)
            print(_usage_message(e.option_message, _command_of(argv)), end="", file=sys.stderr)
        elif e.exit_code == 2:
            print(_usage_message(str(e), _command_of(argv)), end="", file=sys.stderr)
        else:
            print(f"kvblock: error: {e}", file=sys.stderr)
        return e.exit_code
    except ModuleNotFoundError as e:
        # an option whose optional dependency is not installed (--transport zmq without pyzmq,
        # a redis:// index without redis): the message names the pip extra to install
        from ._optional import missing_message

        print(f"kvblock: error: {missing_message(e)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OverflowError) as e:
        # settings the core refuses (e.g. a pool beyond the int32 block-id range)
        print(_usage_message(f"{type(e).__name__}: {e}", _command_of(argv)), end="", file=sys.stderr)
        return 2
    except BrokenPipeError:  # standard output's reader is gone: main() ends quietly
        raise
    except (MemoryError, RecursionError, OSError) as e:  # the machine's, not the command line's
        print(f"kvblock: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
