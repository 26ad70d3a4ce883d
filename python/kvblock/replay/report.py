"""Reports of replays: rich tables for terminals, JSON for machines, and the comparison of
kvblock with the reference."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from .result import ReplayResult

__all__ = [
    "Comparison", "compare_results", "print_table", "render_comparison", "render_result", "settings_line", "sparkline",
]


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` without cutting a cell: rich cuts a word wider than its column (and a
    ``no_wrap`` cell) with an ellipsis once the table is squeezed to the console's width (80
    columns when the output is not a terminal); the table is printed wider instead (a narrower
    terminal wraps the lines, losing nothing)."""
    from rich.measure import Measurement

    m = Measurement.get(console, console.options.update_width(1 << 16), table)
    # a no_wrap column needs its widest cell; other columns their longest word
    need = m.maximum if any(c.no_wrap for c in table.columns) else m.minimum
    if need <= console.width:
        console.print(table)
        return
    width = console.width
    console.width = need
    try:
        console.print(table)
    finally:
        console.width = width

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: np.ndarray, top: int, width: int = 48) -> str:
    """``values`` (e.g. blocks in use per step) as ``width`` unicode bars scaled to ``top``
    (each bar shows the maximum of its bucket)."""
    if values.size == 0 or top <= 0:
        return ""
    edges = np.linspace(0, values.size, min(width, values.size) + 1).astype(np.int64)
    maxima = np.maximum.reduceat(values, edges[:-1])
    levels = np.minimum((maxima / top * (len(_BARS) - 1)).round().astype(np.int64), len(_BARS) - 1)
    return "".join(_BARS[i] for i in levels)


def _ratio_pct(num: int, den: int) -> str:
    """``num / den`` as a percentage with 2 decimals, rounded half up on the exact ratio
    (1,150,464 / 2,048,000 = 56.175% prints as 56.18%, not as binary float rounding has it)."""
    if not den:
        return "0.00%"
    value = (Decimal(100 * num) / Decimal(den)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    return f"{value}%"


def _us(ns: float, calls: int) -> str:
    return f"{ns / 1e3 / calls:,.2f} µs/call × {calls:,}" if calls else "-"


def settings_line(result: ReplayResult) -> str:
    """The replay's settings in one line."""
    c = result.config
    blocks = f"{c['num_blocks']:,} blocks" + (" (unlimited)" if c.get("num_blocks_unlimited") else "")
    parts = [f"{result.impl}", blocks, f"block size {c['block_size']}", c["hash_algo"]]
    if result.mode == "ideal":
        parts.append("ideal (requests finish instantly)")
    else:
        budget = "unlimited" if c["token_budget"] is None else f"{c['token_budget']:,}"
        parts += [
            f"max running {c['max_running']}",
            f"token budget {budget}",
            "chunked prefill " + ("on" if c["chunked_prefill"] else "off"),
            "arrivals asap" if c["asap"] else f"{c['step_ms']:g} ms/step, time x{c['time_scale']:g}",
        ]
    return ", ".join(parts)


def render_result(result: ReplayResult, console: Console) -> None:
    """Print one replay's report as a rich table."""
    r = result
    table = Table(title=f"kvblock replay: {r.workload} ({r.mode})", caption=settings_line(r), show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_column("detail")
    served = f"{r.served:,} / {r.requests:,}"
    table.add_row("requests served", served, f"[red]{len(r.unservable):,} unservable[/red]" if r.unservable else "")
    if r.skipped_lines:
        table.add_row("trace lines skipped", f"{r.skipped_lines:,}", "--skip-bad-lines")
    table.add_row("prompt tokens", f"{r.prompt_tokens:,}", "")
    table.add_row("token hit rate", _ratio_pct(r.hits, r.queries), f"{r.hits:,} / {r.queries:,} tokens")
    if r.preempted_requests:
        table.add_row("  after preemption", _ratio_pct(r.preempted_hits, r.preempted_queries), f"{r.preempted_hits:,} / {r.preempted_queries:,} tokens ({r.preempted_requests:,} resumed)")
    table.add_row("block hit rate", _ratio_pct(r.blocks_hit, r.blocks_queried), f"{r.blocks_hit:,} / {r.blocks_queried:,} blocks")
    table.add_row("evictions", f"{r.evictions:,}", "cached blocks dropped")
    table.add_row("preemptions", f"{r.preemptions:,}", "")
    table.add_row("blocks in use", f"peak {r.peak_blocks_in_use:,}", f"mean {r.mean_blocks_in_use:,.0f} of {r.usable_blocks:,} usable")
    if r.usage.size > 1:
        table.add_row("  over time", "", sparkline(r.usage, r.usable_blocks, 30))
    steps_detail = f"{r.sim_time_s:,.1f} s simulated" if r.mode == "scheduled" else "one per request"
    table.add_row("scheduler steps", f"{r.steps:,}", steps_detail)
    table.add_row("manager time", f"{r.manager_us_per_step:,.2f} µs/step", f"{r.manager_ns / 1e6:,.1f} ms in all")
    table.add_row("  get_computed_blocks", "", _us(r.lookup_ns, r.lookup_calls))
    table.add_row("  allocate_slots (admission)", "", _us(r.admit_alloc_ns, r.admit_alloc_calls))
    if r.step_alloc_calls:
        table.add_row("  allocate_slots (running)", "", _us(r.step_alloc_ns, r.step_alloc_calls))
    table.add_row("  free", "", _us(r.free_ns, r.free_calls))
    table.add_row(
        "hashing", f"{r.hash_ns_per_block:,.0f} ns/block",
        f"{r.blocks_hashed:,} hashed, {r.blocks_reused:,} memoised",
    )
    table.add_row("wall time", f"{r.wall_s:,.2f} s", "")
    print_table(console, table)
    if r.fingerprint:
        # whole, on a line of its own: a 64-digit hash in a cell would be cut or widen the table
        console.print(f"block-id fingerprint (workload README §5.1): {r.fingerprint}", soft_wrap=True,
                      highlight=False)


@dataclass
class Comparison:
    """kvblock and the reference on the same input.

    Attributes:
        kvblock, reference: the two results.
        mismatches: the observable results that differ (empty when identical).
    """

    kvblock: ReplayResult
    reference: ReplayResult
    mismatches: list[str]

    @property
    def identical(self) -> bool:
        return not self.mismatches

    def speedups(self) -> dict[str, float]:
        """reference / kvblock ratios of manager time, hashing ns per block and wall time."""

        def ratio(a: float, b: float) -> float:
            return a / b if b else float("nan")

        k, r = self.kvblock, self.reference
        return {
            "manager": ratio(r.manager_ns, k.manager_ns),
            "hashing_per_block": ratio(r.hash_ns_per_block, k.hash_ns_per_block),
            "wall": ratio(r.wall_s, k.wall_s),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvblock": self.kvblock.to_dict(),
            "reference": self.reference.to_dict(),
            "identical": self.identical,
            "mismatches": self.mismatches,
            "speedup": self.speedups(),
        }


_COMPARED = (
    "served", "queries", "hits", "preempted_queries", "preempted_hits", "blocks_queried",
    "blocks_hit", "evictions", "preemptions", "steps", "fingerprint",
)


def compare_results(kvblock: ReplayResult, reference: ReplayResult) -> Comparison:
    """Pair two results of the same input and list the observable results that differ."""
    mismatches = [
        f"{name}: kvblock {getattr(kvblock, name)!r} != reference {getattr(reference, name)!r}"
        for name in _COMPARED
        if getattr(kvblock, name) != getattr(reference, name)
    ]
    if not np.array_equal(kvblock.usage, reference.usage):
        mismatches.append("blocks in use over time differ")
    if [u.request_id for u in kvblock.unservable] != [u.request_id for u in reference.unservable]:
        mismatches.append("unservable requests differ")
    return Comparison(kvblock, reference, mismatches)


def render_comparison(cmp: Comparison, console: Console) -> None:
    """Print a comparison: both results side by side and the speedups."""
    k, r = cmp.kvblock, cmp.reference
    sp = cmp.speedups()
    table = Table(title=f"kvblock vs reference: {k.workload} ({k.mode})", caption=settings_line(k).replace("kvblock, ", ""))
    table.add_column("metric", style="bold")
    table.add_column("kvblock", justify="right")
    table.add_column("reference", justify="right")
    table.add_column("speedup", justify="right", style="bold green")
    table.add_row("token hit rate", _ratio_pct(k.hits, k.queries), _ratio_pct(r.hits, r.queries), "")
    table.add_row("hit / queried tokens", f"{k.hits:,} / {k.queries:,}", f"{r.hits:,} / {r.queries:,}", "")
    table.add_row("evictions", f"{k.evictions:,}", f"{r.evictions:,}", "")
    table.add_row("preemptions", f"{k.preemptions:,}", f"{r.preemptions:,}", "")
    table.add_row("manager µs/step", f"{k.manager_us_per_step:,.2f}", f"{r.manager_us_per_step:,.2f}", f"{sp['manager']:.1f}x")
    table.add_row("hashing ns/block", f"{k.hash_ns_per_block:,.0f}", f"{r.hash_ns_per_block:,.0f}", f"{sp['hashing_per_block']:.1f}x")
    table.add_row("wall time", f"{k.wall_s:,.2f} s", f"{r.wall_s:,.2f} s", f"{sp['wall']:.1f}x")
    verdict = "[green]identical[/green]" if cmp.identical else "[red]DIFFERENT[/red]"
    table.add_row("results", verdict, verdict, "")
    print_table(console, table)
    for m in cmp.mismatches:
        console.print(f"[red]mismatch:[/red] {m}")
