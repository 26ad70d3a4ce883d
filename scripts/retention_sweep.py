"""Hit rate against capacity for each retention policy (``docs/retention_sweep.png``): ideal
replays of the two Mooncake FAST'25 traces and the built-in chat workload, one panel per
workload, one line per policy (lru, priority, pin-system-prompts, ttl).

Usage: ``python scripts/retention_sweep.py [--shared ../shared] [--out docs/retention_sweep.png]``
(needs matplotlib). Prints the hit rates as a Markdown table too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvblock.replay import builtin_workload, load_trace
from kvblock.replay.plot import series_style
from kvblock.replay.retention import POLICIES
from kvblock.replay.sweep import sweep

WORKLOADS = [
    ("mooncake_fast25_conversation_trace.jsonl", [10_000, 30_000, 100_000, 300_000], None),
    ("mooncake_fast25_synthetic_trace.jsonl", [10_000, 30_000, 100_000, 300_000], None),
    ("builtin:chat", [500, 1_000, 2_000, 5_000, 10_000], 1024),  # its system prompts: 1024 tokens
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=os.environ.get("KVBLOCK_SHARED", str(Path(__file__).resolve().parents[2] / "shared")))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "retention_sweep.png"))
    args = ap.parse_args()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.5, 4.2), dpi=110)
    rows = []
    for k, (name, caps, pin_tokens) in enumerate(WORKLOADS):
        trace = builtin_workload(name[8:]) if name.startswith("builtin:") else load_trace(str(Path(args.shared) / "traces" / name))
        ax = fig.add_subplot(1, len(WORKLOADS), k + 1)
        for i, pol in enumerate(POLICIES):
            (s,) = sweep([trace], caps, retention=pol, pin_tokens=pin_tokens)
            ys = [100 * p.hit_rate for p in s.points]
            ax.plot(caps, ys, label=pol, **series_style(i))  # equal policies' lines stay visible
            rows.append((trace.name, pol, ys))
            print(f"{trace.name:40s} {pol:20s} " + " ".join(f"{y:6.2f}" for y in ys), file=sys.stderr, flush=True)
        ax.set_xscale("log")
        ax.set_title(trace.name, fontsize=9)
        ax.set_xlabel("capacity (16-token blocks)")
        if k == 0:
            ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Hit rate against capacity per retention policy (ideal replays)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"| workload | policy | hit rate (%) at each capacity |\n|---|---|---|")
    for name, pol, ys in rows:
        print(f"| {name} | {pol} | " + " / ".join(f"{y:.2f}" for y in ys) + " |")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
