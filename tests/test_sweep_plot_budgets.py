"""``kvblock sweep`` with ``--model`` budgets, negative-looking capacities and the ``--json``
series' policy (new-user findings L5, L6, L11).

* L5: ``--plot`` with ``--model`` budgets drew the x axis in blocks (ticks 512 / 4.096k) and
  titled every plot "(vLLM APC, LRU)" whatever the policies; the axis now reads the budgets
  asked for and the title names the policies plotted.
* L6: ``--capacities -1GiB`` (space-separated) was read by argparse as an option ("expected at
  least one argument"); it now gets the bad-capacity message ``--capacities=-1GiB`` gets.
* L11: each ``--json`` series carries its ``policy`` (before, only a name suffix told it).
"""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli


@pytest.fixture
def figures(monkeypatch):
    """The figures ``plot_sweep`` saves (an empty file is written where each would be)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved: list = []

    def savefig(self, fname, *a, **k):
        saved.append(self)
        open(fname, "wb").close()

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_model_budgets_label_the_x_axis_and_the_title_names_the_policies(capsys, tmp_path, figures):
    out_png = str(tmp_path / "plot.png")
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "60", "--model", "Llama-3.1-8B",
                             "--capacities", "1GiB,8GiB,inf", "--retention", "lru,optimal,fifo",
                             "--plot", out_png, "--no-progress")
    assert code == 0, err
    (fig,) = figures
    ax = fig.axes[0]
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["1GiB", "8GiB", "∞"], labels
    assert ax.get_xlabel().startswith("KV-cache memory budget (Llama-3.1-8B")
    assert ax.get_title() == "Hit rate vs cache capacity (vLLM APC, LRU, optimal, FIFO)"


def test_block_counts_keep_the_block_axis(capsys, tmp_path, figures):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "60", "--capacities", "512,4k",
                             "--plot", str(tmp_path / "p.png"), "--no-progress")
    assert code == 0, err
    ax = figures[0].axes[0]
    figures[0].canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "4k"]
    assert ax.get_xlabel() == "cache capacity (blocks of 16 tokens)"
    assert ax.get_title() == "Hit rate vs cache capacity (vLLM APC, LRU)"


@pytest.mark.parametrize("argv", [["--capacities", "-1GiB"], ["--capacities", "1k", "-5"],
                                  ["--capacities", "-1GiB", "--limit", "10"], ["--capacities=-1GiB"]])
def test_a_negative_capacity_gets_the_bad_capacity_message(capsys, argv):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--model", "Llama-3.1-8B", *argv, "--no-progress")
    assert code == 2
    assert err.startswith("kvblock: error: bad capacity '-"), err
    assert "expected at least one argument" not in err


def test_json_series_name_their_policy(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "60", "--capacities", "1k,inf",
                             "--retention", "lru,optimal", "--json", "--no-progress")
    assert code == 0, err
    series = json.loads(out)["series"]
    assert [(s["name"], s["policy"]) for s in series] == [("chat", "lru"), ("chat (optimal)", "optimal")]


def test_replayed_series_name_their_policy(capsys):
    code, out, err = run_cli(capsys, "sweep", "builtin:chat", "--limit", "40", "--capacities", "1k",
                             "--retention", "lru,priority", "--method", "replay", "--json", "--no-progress")
    assert code == 0, err
    assert [s["policy"] for s in json.loads(out)["series"]] == ["lru", "priority"]
