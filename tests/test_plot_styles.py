"""Every series of kvblock's figures stays visible when it equals another (issue 34: in
docs/retention_sweep.png the lru line hid under ttl's, both solid with round markers). Drawn
with real matplotlib; the figure is captured where it is saved."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from kvblock.replay.fleet import FleetResult, plot_fleet_sweep  # noqa: E402
from kvblock.replay.plot import plot_sweep, series_style  # noqa: E402
from kvblock.replay.sweep import SweepPoint, SweepSeries  # noqa: E402


@pytest.fixture
def saved(monkeypatch):
    figures: list[Figure] = []
    def savefig(self, fname, *a, **k):  # an empty file where the figure would be drawn
        figures.append(self)
        open(fname, "wb").close()

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def assert_distinguishable(lines) -> None:
    """Pairwise different marker and dash pattern, and each line thinner than the one drawn
    before it (the earlier one shows around it where they coincide)."""
    styles = [(ln.get_marker(), ln.get_linestyle()) for ln in lines]
    assert len(set(s[0] for s in styles)) == len(styles) and len(set(s[1] for s in styles)) == len(styles), styles
    widths = [ln.get_linewidth() for ln in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths), widths


def test_series_styles_differ_and_thin_out():
    styles = [series_style(i) for i in range(4)]
    assert len({(s["marker"], s["linestyle"], s["color"]) for s in styles}) == 4
    assert [s["linewidth"] for s in styles] == sorted((s["linewidth"] for s in styles), reverse=True)


def test_equal_sweep_series_stay_visible(saved, tmp_path):
    pts = [SweepPoint(c, c, 1000, 900, 300, 0, 0, 0) for c in (1000, 10_000)]
    series = [SweepSeries(name, name, 16, list(pts)) for name in ("lru", "priority", "pin", "ttl")]
    plot_sweep(series, str(tmp_path / "x.png"))
    [fig] = saved
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label() in ("lru", "priority", "pin", "ttl")]
    assert len(lines) == 4
    assert_distinguishable(lines)


def test_equal_fleet_routers_stay_visible(saved, tmp_path):
    def result(router: str, n: int) -> FleetResult:
        return FleetResult("w", {"num_blocks": 100, "block_size": 16}, {"instances": n, "router": router},
                           requests=1, hits=1, queries=2)

    routers = ("round-robin", "least-loaded", "cache-aware")
    plot_fleet_sweep({r: [result(r, 1), result(r, 2)] for r in routers}, str(tmp_path / "x.png"))
    [fig] = saved
    for ax in fig.axes:
        assert_distinguishable([ln for ln in ax.get_lines() if ln.get_label() in routers])
