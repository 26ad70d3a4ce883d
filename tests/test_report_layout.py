"""What reports print is whole and tells things apart (issue 34, item 6): the replay's
fingerprint in full, the ``--model`` sweep table with no header cut or cell split at 80
columns, and two traces of the same file name, and their one-pass curves, labelled and
coloured apart."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli

TOKENS = [list(range(1, 40 + i)) for i in range(8)]


def test_fingerprint_printed_whole(capsys):
    code, out, _ = run_cli(capsys, "replay", "builtin:chat", "--limit", "40", "--fingerprint", "--json",
                        "--no-progress")
    assert code == 0
    fp = json.loads(out)["fingerprint"]
    code, out, _ = run_cli(capsys, "replay", "builtin:chat", "--limit", "40", "--fingerprint", "--no-progress")
    assert code == 0 and len(fp) == 64 and fp in out


def test_model_sweep_table_cuts_nothing_at_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, "sweep", "builtin:chat", "--limit", "60", "--model", "Llama-3.1-8B",
                        "--capacities", "1GiB,8GiB", "--no-progress")
    assert code == 0
    assert "…" not in out
    assert "8.00 GiB" in out and "1.00 GiB" in out
    for word in ("capacity", "unservable", "evictions", "speedup"):
        assert word in out


def _two_toks(tmp_path):
    paths = []
    for k, sub in enumerate(("a", "b")):
        (tmp_path / sub).mkdir()
        p = tmp_path / sub / "tok.jsonl"
        p.write_text("".join(json.dumps([t + 1000 * k for t in toks]) + "\n" for toks in TOKENS))
        paths.append(str(p))
    return paths


def test_same_file_names_get_distinct_labels(capsys, tmp_path):
    a, b = _two_toks(tmp_path)
    code, out, err = run_cli(capsys, "sweep", a, b, "--capacities", "10,inf", "--json", "--no-progress")
    assert code == 0, err
    assert [s["name"] for s in json.loads(out)["series"]] == [a, b]
    code, out, err = run_cli(capsys, "sweep", a, a, "--capacities", "10,inf", "--json", "--no-progress")
    assert code == 0, err
    assert [s["name"] for s in json.loads(out)["series"]] == [a, f"{a} #2"]


def test_one_pass_curves_coloured_apart(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures = []

    def savefig(self, fname, *a, **k):
        figures.append(self)
        open(fname, "wb").close()

    monkeypatch.setattr(Figure, "savefig", savefig)
    a, b = _two_toks(tmp_path)
    code, _, err = run_cli(capsys, "sweep", a, b, "--capacities", "3,10,inf", "--plot", str(tmp_path / "p.png"),
                        "--no-progress")
    assert code == 0, err
    lines = [ln for ln in figures[0].axes[0].get_lines() if ln.get_label().endswith("(LRU, one pass)")]
    assert len(lines) == 2
    assert lines[0].get_color() != lines[1].get_color()
    assert lines[0].get_label() != lines[1].get_label()
