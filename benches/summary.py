"""Print the last benchmark run's kvblock-vs-vLLM ratios as a Markdown table (for the README).

``make bench`` (or ``pytest benches``) writes ``.benchmarks/kvblock-summary.json``
(``KVBLOCK_BENCH_SUMMARY`` to put it elsewhere); this reads it:

    python benches/summary.py [path]

Every ratio comes from that one run: ``vLLM / kvblock`` (or ``reference / kvblock``) by minimum
and by median over the run's samples of each group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent.parent / ".benchmarks" / "kvblock-summary.json"


def _fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.0f} ns"


def table(data: dict, baseline: str) -> list[str]:
    rows = []
    for group, r in sorted(data["results"].items()):
        if baseline not in r or "kvblock" not in r:
            continue
        k, b = r["kvblock"], r[baseline]
        rows.append(f"| {group} | {_fmt(b['median_s'])} | {_fmt(k['median_s'])} | "
                    f"{b['min_s'] / k['min_s']:.1f}x | {b['median_s'] / k['median_s']:.1f}x |")
    if not rows:
        return []
    name = f"vLLM {data.get('vllm', '0.33.0')}" if baseline == "vllm" else "reference"
    return [f"| measurement | {name} (median) | kvblock (median) | ratio (min) | ratio (median) |",
            "| --- | ---: | ---: | ---: | ---: |", *rows]


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else DEFAULT
    if not path.exists():
        print(f"no benchmark summary at {path}: run `make bench` (or pytest benches) first", file=sys.stderr)
        return 1
    data = json.loads(path.read_text())
    print(f"Machine: {data['machine']}. One run; ratios = baseline / kvblock.\n")
    for baseline in ("vllm", "reference"):
        lines = table(data, baseline)
        if lines:
            print("\n".join(lines))
            print()
    if data["lines"]:
        print("\n".join(f"- {line.strip()}" for line in data["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
