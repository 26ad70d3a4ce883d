"""kvblock's capacity curves against the two peer capacity planners, run as their own CLIs.

The peers (``make install`` puts them in ``.venv-peers/``, apart from the test venv; or set
``KVBLOCK_PEERS_BIN`` to a folder holding their executables): llmtrafficlens 0.13.4 and
kvcache-simulator 0.1.3. Missing peers skip these tests, except under ``CI=true``, where they fail.

What is checked, on the whole Mooncake conversation trace at the trace's 512-token blocks
(each test a few seconds):

* llmtrafficlens ``profile --format mooncake --warmup 0`` (Mooncake JSONL is one of its input
  formats; without ``--format`` it expects a gateway-log CSV and finds "no parseable
  requests"): its cold LRU curve at its sizes (16K..16M tokens, ``tokens // 512`` blocks, plus
  unbounded) is within 1 point of kvblock's at the same blocks plus vLLM's null block. Its LRU
  is per block (a block can hit after a missed one), so the two differ a little.
* kvcache-simulator ``run --block-size 512`` (last 50% of requests measured, as kvblock's
  ``--warmup 0.5``) with LRU and OPTIMAL at 7 budgets: fed the trace with each prompt's partial
  last block dropped from ``hash_ids`` (vLLM never caches a partial block; the simulator caches
  it and spends a slot on it), its LRU hit tokens over kvblock's prompt tokens equal kvblock's
  within 0.5 point at every budget where no request is larger than the pool (kvblock: vLLM
  cannot schedule those; the simulator serves them in part). Its OPTIMAL may refuse to admit a
  block (Belady with bypass), which vLLM cannot (every block of a running request is
  allocated): kvblock's optimal is at most the simulator's, and within 0.5 point once the
  cache holds most of the reuse. Its bytes per token for Llama 3.1 8B equal kvblock's catalog.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvblock.replay import load_trace
from kvblock.replay.capacity import capacity_sweep
from kvblock.replay.memory import load_sizing

from conftest import IN_CI, REPO, shared_path

TRACE = "mooncake_fast25_conversation_trace.jsonl"
BLOCK = 512


def _peer(name: str) -> str:
    where = os.environ.get("KVBLOCK_PEERS_BIN") or str(REPO / ".venv-peers" / "bin")
    exe = Path(where) / name
    if not exe.exists():
        msg = f"{name} is not in {where} (make install puts it in .venv-peers/; or set KVBLOCK_PEERS_BIN)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return str(exe)


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def trace():
    return load_trace(str(shared_path("traces", TRACE)))


def test_llmtrafficlens_cold_curve(trace, tmp_path: Path) -> None:
    exe = _peer("llmtrafficlens")
    _run([exe, "profile", str(shared_path("traces", TRACE)), "--format", "mooncake", "--warmup", "0",
          "-o", str(tmp_path / "ltl")], tmp_path)
    curve = json.loads((tmp_path / "ltl.json").read_text())["reuse_potential"]["curve"]
    assert len(curve) == 7 and curve[-1]["capacity_tokens"] is None
    caps = [None if c["capacity_tokens"] is None else c["capacity_tokens"] // BLOCK + 1 for c in curve]
    series, _ = capacity_sweep([trace], caps, ["lru"], block_size=BLOCK, warmup=0.0)
    for c, p in zip(curve, series[0].points):
        assert abs(100 * p.hit_rate - 100 * c["hit_rate"]) < 1.0, (c, p)


def _drop_partial_blocks(src: Path, dst: Path) -> None:
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            r = json.loads(line)
            r["hash_ids"] = r["hash_ids"][: max(1, r["input_length"] // BLOCK)]
            g.write(json.dumps(r) + "\n")


def test_kvcache_simulator_lru_and_optimal(trace, tmp_path: Path) -> None:
    exe = _peer("kvcache-simulator")
    src = shared_path("traces", TRACE)
    full = tmp_path / "full_blocks.jsonl"
    _drop_partial_blocks(src, full)
    common = ["--block-size", str(BLOCK), "--model", "llama-3.1-8b", "--budgets-gib", "1,4,16,64,256,1024,4096",
              "--policies", "lru,optimal", "--no-progress", "--format", "json"]
    _run([exe, "run", "--trace", str(full), *common, "-o", str(tmp_path / "full.json")], tmp_path)
    _run([exe, "run", "--trace", str(src), *common, "-o", str(tmp_path / "raw.json")], tmp_path)
    sim = json.loads((tmp_path / "full.json").read_text())
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert sim["metadata"]["bytesPerToken"] == load_sizing("Llama-3.1-8B").bytes_per_token
    blocks = [p["cacheBlocks"] for p in sim["points"]]
    assert len(blocks) == 7 and blocks == [p["cacheBlocks"] for p in raw["points"]]
    series, _ = capacity_sweep([trace], [b + 1 for b in blocks], ["lru", "optimal"], block_size=BLOCK,
                               warmup=0.5)
    lru, opt = series
    assert sim["metadata"]["warmupRequests"] == len(trace.requests) // 2
    servable = 0
    for k, (pt, sp, rp) in enumerate(zip(lru.points, sim["points"], raw["points"])):
        den = pt.prompt_tokens
        assert rp["results"]["lru"]["totalTokens"] == den
        if pt.unservable:
            continue
        servable += 1
        sim_lru = sp["results"]["lru"]["hitTokens"] / den
        assert abs(pt.hit_rate - sim_lru) < 0.005, (pt.num_blocks, pt.hit_rate, sim_lru)
        # the raw trace: the partial blocks the simulator caches cost it at most a point here
        assert abs(pt.hit_rate - rp["results"]["lru"]["hitRate"]) < 0.01
        o, sim_opt = opt.points[k], sp["results"]["optimal"]["hitTokens"] / den
        assert o.hit_rate <= sim_opt + 1e-9, (o.num_blocks, o.hit_rate, sim_opt)
        if o.hit_rate > 0.8 * opt.points[-1].hit_rate:
            assert sim_opt - o.hit_rate < 0.005, (o.num_blocks, o.hit_rate, sim_opt)
    assert servable >= 5
