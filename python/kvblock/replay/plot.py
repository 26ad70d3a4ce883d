"""Plotting a capacity sweep (matplotlib, Agg backend, no display needed).

The figure follows the Mooncake paper's Figure 9: cache capacity in blocks on a log x axis,
hit rate on the y axis, one line per trace (:func:`series_style`: its own marker and dash
pattern, so equal lines stay visible). An unlimited capacity is drawn as a
hollow marker at an "∞" tick to the right and a dotted line at that trace's upper bound.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .._optional import install_hint
from .errors import ReplayError
from .sweep import SweepSeries

__all__ = ["check_plot_target", "default_title", "plot_sweep", "series_style"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":")


def series_style(i: int) -> dict[str, object]:
    """The matplotlib line style of a figure's ``i``-th series: its own color, marker and
    dash pattern, and lines thinner (markers smaller) as ``i`` grows, so a series drawn
    later over an equal one leaves it visible around it (lru's line used to hide under
    ttl's in ``docs/retention_sweep.png``)."""
    return {
        "color": f"C{i % 10}",
        "marker": _MARKERS[i % len(_MARKERS)],
        "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
        "linewidth": max(3.4 - 0.7 * i, 1.0),
        "markersize": max(8.0 - 1.2 * i, 3.5),
    }

#: What to install for ``--plot`` (matplotlib alone: ``pip install '.[plot]'`` would rebuild the
#: Rust core for minutes to add it).
PLOT_HINT = f"--plot needs matplotlib: {install_hint('matplotlib', 'plot')}"


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        raise ReplayError(PLOT_HINT) from None
    return Figure, FuncFormatter, NullFormatter


def check_plot_target(path: str) -> None:
    """Check, before a sweep starts, that :func:`plot_sweep` can write ``path``: matplotlib
    imports, the extension is a format it writes, and a file can be created in the folder
    (a probe file is made and removed; an existing ``path`` is left as it is).

    Raises:
        ReplayError: any of these fails (the message says which).
    """
    import os
    import tempfile

    Figure, _, _ = _matplotlib()
    if os.path.isdir(path):
        raise ReplayError(f"cannot write plot {path}: it is a directory")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    formats = Figure().canvas.get_supported_filetypes()
    if ext not in formats:
        raise ReplayError(
            f"cannot write plot {path}: unknown format {ext or '(no extension)'!r} "
            f"(use one of {', '.join('.' + f for f in sorted(formats))})"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ReplayError(f"cannot write plot {path}: no such directory {folder}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ReplayError(f"cannot write plot {path}: permission denied")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvblock-plot-"):
            pass
    except OSError as e:
        raise ReplayError(f"cannot write plot {path}: {e.strerror or e}") from None


#: How the default title names each eviction policy.
_POLICY_NAMES = {"lru": "LRU", "fifo": "FIFO", "optimal": "optimal"}


def default_title(series: Sequence[SweepSeries]) -> str:
    """``"Hit rate vs cache capacity (vLLM APC, LRU, optimal, FIFO)"``: the policies plotted,
    in the series' order."""
    policies = list(dict.fromkeys(_POLICY_NAMES.get(s.policy, s.policy) for s in series)) or ["LRU"]
    return f"Hit rate vs cache capacity (vLLM APC, {', '.join(policies)})"


def plot_sweep(series: Sequence[SweepSeries], path: str, title: str | None = None,
               curves: Sequence[Any] = (), *, tick_labels: Mapping[int | None, str] | None = None,
               x_label: str | None = None) -> None:
    """Draw hit rate against capacity for every series and save it to ``path`` (PNG, SVG or
    PDF by extension). ``curves``: one-pass LRU curves
    (:class:`kvblock.replay.capacity.CapacityCurve`), drawn as thin lines over every capacity
    where they are exact (above each trace's largest request). ``title``: default
    :func:`default_title` (names the policies plotted). ``tick_labels``: a label per capacity
    (blocks; None: unlimited), e.g. the memory budgets ``kvblock sweep --model`` was given
    (``{512: "1GiB"}``), shown on the x axis instead of block counts, with ``x_label`` as the
    axis title (default: the block counts' title).

    Raises:
        ReplayError: matplotlib is not installed, there is nothing to plot, or the file
            cannot be written.
    """
    Figure, FuncFormatter, NullFormatter = _matplotlib()
    if not series or not any(s.points for s in series):
        raise ReplayError("nothing to plot")
    finite = [p.capacity for s in series for p in s.points if p.capacity is not None]
    has_inf = any(p.capacity is None for s in series for p in s.points)
    lo = min(finite) if finite else 1
    hi = max(finite) if finite else 1
    x_inf = hi * 4 if finite else 1

    fig = Figure(figsize=(7.0, 4.4), dpi=120)
    ax = fig.add_subplot()
    for i, s in enumerate(series):
        style = series_style(i)
        color = style["color"]
        pts = [p for p in s.points if p.capacity is not None]
        ax.plot([p.capacity for p in pts], [100 * p.hit_rate for p in pts], label=s.name, **style)
        for p in s.points:
            if p.capacity is None:
                y = 100 * p.hit_rate
                ax.plot([x_inf], [y], marker="o", markerfacecolor="white", color=color, markersize=6)
                ax.axhline(y, color=color, linestyle=":", linewidth=1)
                if pts:
                    ax.plot([pts[-1].capacity, x_inf], [100 * pts[-1].hit_rate, y], color=color,
                            linestyle="--", linewidth=1)
    for c in curves:
        n = len(c.hits)
        start = max(c.max_blocks_needed + 1, int(lo))
        stop = max(min(n - 1, int(hi)), start)
        xs = np.unique(np.geomspace(start, stop, 400).astype(np.int64))
        ys = [100 * c.hit_rate(int(x)) for x in xs]
        # the color of its trace's series: two traces' curves are told apart
        k = next((i for i, s in enumerate(series) if s.name == c.name), None)
        ax.plot(xs, ys, color="black" if k is None else series_style(k)["color"], linewidth=0.8, alpha=0.7,
                label=f"{c.name} (LRU, one pass)")
    ax.set_xscale("log")
    ticks = sorted(set(finite)) + ([x_inf] if has_inf else [])

    def label(x: float, _pos: int) -> str:
        if has_inf and x == x_inf:
            return "∞"
        if tick_labels and int(x) == x and int(x) in tick_labels:
            return tick_labels[int(x)]
        return f"{x / 1e6:g}M" if x >= 1e6 else f"{x / 1e3:g}k" if x >= 1e3 else f"{x:g}"

    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo / 1.5, (x_inf if has_inf else hi) * 1.5)
    ax.set_ylim(0, 100)
    block = series[0].block_size
    ax.set_xlabel(x_label or f"cache capacity (blocks of {block} tokens)")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_title(title or default_title(series))
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    _save_whole(fig, path)


def _save_whole(fig: Any, path: str) -> None:
    """Save ``fig`` to ``path`` whole or not at all: drawn into a file beside it, then moved
    over it (an interrupt or an error leaves an existing ``path`` as it was, and no file
    behind)."""
    import os

    ext = os.path.splitext(path)[1].lower().lstrip(".")
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".kvblock-plot-{os.getpid()}.{ext}")
    try:
        fig.savefig(tmp, format=ext or None)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        raise ReplayError(f"cannot write plot {path}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
