"""A bounded load test of ``kvblock index serve`` on loopback: queries/s and latency percentiles.

``kvblock index serve`` runs in a process of its own, fed by two real publishers (kvblock
``KVCacheManager`` event batches on vLLM's wire); 16 concurrent aiohttp clients then send
``POST /score`` (half block hashes, half token ids hashed by the service) for a bounded time.
The numbers are printed; the test asserts only that every answer was right and that the
numbers are sane (no timing thresholds: the machine is shared).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from cluster_helpers import free_port
from conftest import require_module

aiohttp = require_module("aiohttp")
require_module("zmq")

from kvblock import hashing  # noqa: E402
from kvblock.cluster import PrefixIndex  # noqa: E402

from test_index_service import BS, REPO, SEED, Engine, call, root, wait_applied  # noqa: E402

DURATION_S = 4.0
MAX_QUERIES = 40_000
CLIENTS = 16


async def _load(url: str, bodies: list[bytes], answers: list[dict],
                duration_s: float) -> tuple[list[float], int, float]:
    """Send bodies round-robin from ``CLIENTS`` tasks until ``duration_s`` or ``MAX_QUERIES``;
    returns the latencies (s), the number of wrong answers and the wall time (s)."""
    lat: list[float] = []
    wrong = 0
    stop = time.perf_counter() + duration_s
    counter = iter(range(MAX_QUERIES))

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal wrong
        for i in counter:
            if time.perf_counter() >= stop:
                return
            k = i % len(bodies)
            t0 = time.perf_counter()
            async with session.post(url + "/score", data=bodies[k],
                                    headers={"Content-Type": "application/json"}) as r:
                got = await r.json()
            lat.append(time.perf_counter() - t0)
            if r.status != 200 or got["instances"] != answers[k]:
                wrong += 1

    conn = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
        wall = time.perf_counter() - t0
    return lat, wrong, wall


def test_index_service_load(capsys):
    engines = [Engine("engine-a", num_blocks=4096), Engine("engine-b", num_blocks=4096)]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "kvblock", "index", "serve", "--block-size", str(BS), "--port", str(port),
            "--log-level", "warning"] + (["--hash-seed", SEED] if SEED is not None else [])
    for e in engines:
        args += ["--engine", f"{e.name}={e.pub.endpoint},replay={e.pub.replay_endpoint}"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if call(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.1)
        # 400 prompts of 8 shared system prompts (16-64 blocks) + tails: a few thousand blocks
        rng = np.random.default_rng(0)
        systems = [np.random.default_rng(200 + i).integers(0, 50_000, BS * (16 + 6 * i)).tolist() for i in range(8)]
        prompts = []
        for i in range(400):
            p = systems[int(rng.integers(0, 8))] + rng.integers(0, 50_000, BS * int(rng.integers(1, 40))).tolist()
            prompts.append(p)
            engines[i % 2].serve(p)
        wait_applied(url, engines, timeout_s=30)
        ref = PrefixIndex(BS)
        for e in engines:
            ref.add_instance(e.name)
            for p in e.payloads:
                ref.apply(e.name, p)
        bodies, answers = [], []
        for i, p in enumerate(prompts[::4]):
            hashes = hashing.hash_blocks(p, BS, algo="sha256", parent=root())
            hits = ref.match(hashes)
            answers.append({e.name: hits.get(e.name, 0) * BS for e in engines})
            body = {"token_ids": p} if i % 2 else {"block_hashes": [h.hex() for h in hashes]}
            bodies.append(json.dumps(body).encode())
        assert sum(1 for a in answers if any(a.values())) == len(answers)
        pairs = ref.num_pairs()
        lat, wrong, wall = asyncio.run(_load(url, bodies, answers, DURATION_S))
        lat_ms = np.array(lat) * 1000
        qps = len(lat) / wall
        p50, p99 = np.percentile(lat_ms, 50), np.percentile(lat_ms, 99)
        _, text = call(url + "/metrics")
        lookup = [line for line in text.splitlines() if line.startswith("kvblock_index_lookup_seconds_")]
        summ = dict(line.split(" ") for line in lookup if "bucket" not in line and "created" not in line)
        lookup_us = float(summ["kvblock_index_lookup_seconds_sum"]) / float(summ["kvblock_index_lookup_seconds_count"]) * 1e6
        with capsys.disabled():
            print(f"\nkvblock index serve on loopback: {len(lat)} queries from {CLIENTS} clients in {wall:.1f} s: "
                  f"{qps:,.0f} queries/s, latency p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {lat_ms.max():.1f} ms; "
                  f"index lookup mean {lookup_us:.1f} µs; {pairs:,} (block, engine) pairs, "
                  f"{np.mean([len(b) for b in bodies]) / 1024:.1f} KiB bodies")
        assert wrong == 0
        assert len(lat) >= 50  # sane, not a threshold: a few hundred a second even on a busy VM
        assert 0 < p50 <= p99 < 10_000
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        for e in engines:
            e.close()
    assert proc.returncode == 130, err  # Ctrl-C, as every kvblock command
