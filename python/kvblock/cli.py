"""The ``kvblock`` command.

``kvblock info``   build profile, version, and a hashing speed table (kvblock vs the
                   pure-Python reference on a 4096-token prompt).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Sequence

from . import _core


def _best_ns(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def hashing_table(block_size: int = 16, num_tokens: int = 4096, repeat: int = 20) -> list[dict]:
    """ns per block of ``kvblock.hash_blocks`` vs the reference, for every algorithm."""
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
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvblock", description="vLLM-identical prefix-caching KV block manager")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="build profile and a hashing speed table")
    info.add_argument("--repeat", type=int, default=20, help="timing repetitions (default 20)")
    info.set_defaults(func=_cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
