"""``kvblock index serve`` (kvblock.cluster.service): a real service on loopback fed by real
ZMQ publishers in vLLM's wire format (kvblock's ``KVEventPublisher`` sending real
``KVCacheManager`` event batches).

* ``/score`` answers (block hashes as hex or event ints, and token ids hashed by the
  service) equal an in-process ``PrefixIndex`` fed the very same payloads;
* bad bodies get a clear 4xx, the index is unchanged and the service keeps serving;
* a malformed event batch and a restarted engine (new publisher on the same ports, batch
  numbers from 0) leave the index exact, and are counted;
* ``/metrics`` parses with prometheus_client's parser and its counters move;
* engines added and removed through the API; xxhash without a seed refuses token ids;
* the Redis-backed service answers as the in-process one;
* ``kvblock index serve`` itself, from the command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster_helpers import free_port, parse_metrics, rebind
from conftest import require_module
from redis_fixtures import redis_node  # noqa: F401  (the fixture)

require_module("zmq")
require_module("aiohttp")
require_module("prometheus_client.parser")

from kvblock import KVCacheManager, Request, SamplingParams, hashing  # noqa: E402
from kvblock.cluster import KVEventPublisher, PrefixIndex  # noqa: E402
from kvblock.cluster.service import (  # noqa: E402
    EngineSpec,
    IndexService,
    ServiceConfig,
    ServiceThread,
    parse_engine,
)
from kvblock.events import encode_batch  # noqa: E402

BS = 4
SEED = os.environ.get("PYTHONHASHSEED")  # the engines' (kvblock managers follow vLLM's rules)
REPO = Path(__file__).resolve().parent.parent


# -- helpers --------------------------------------------------------------------------------
def call(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client: ``{"name{l=v,...}": value}``."""
    status, text = call(url + "/metrics")
    assert status == 200
    return parse_metrics(text)


class Engine:
    """A kvblock ``KVCacheManager`` with events on, publishing each step's events on real
    PUB + replay ROUTER sockets; every payload is also kept for the reference index."""

    def __init__(self, name: str, num_blocks: int = 48, port: int = 0, rport: int = 0) -> None:
        self.name = name
        self.mgr = KVCacheManager(num_blocks, BS, enable_kv_cache_events=True)
        self.pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        self.payloads: list[bytes] = []
        self.n = 0

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.name, self.pub.endpoint, self.pub.replay_endpoint)

    def serve(self, tokens: list[int], keep: bool = False) -> None:
        """One request through the cache: computed, published, freed (its blocks stay cached
        until evicted)."""
        self.n += 1
        req = Request(f"{self.name}-{self.n}", tokens, SamplingParams(max_tokens=1),
                      block_hasher=self.mgr.request_block_hasher)
        hit, n, _ = self.mgr.get_computed_blocks(req)
        blocks = self.mgr.allocate_slots(req, req.num_tokens - n, n, hit)
        assert blocks is not None
        req.num_computed_tokens = req.num_tokens
        if not keep:
            self.mgr.free(req)
        self.send(self.mgr.take_events())

    def send(self, events: list[Any]) -> None:
        if events:
            payload = encode_batch(events, ts=time.time())
            self.payloads.append(payload)
            self.pub.publish_payload(payload)

    def close(self) -> None:
        self.pub.close()


def prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts over three shared system prompts of 3-5 blocks, tails of 0-6 blocks."""
    rng = np.random.default_rng(seed)
    systems = [np.random.default_rng(100 + i).integers(0, 5000, BS * (3 + i)).tolist() for i in range(3)]
    out = []
    for _ in range(n):
        head = systems[int(rng.integers(0, 3))]
        out.append(head + rng.integers(0, 5000, int(rng.integers(0, 7)) * BS + int(rng.integers(0, BS))).tolist())
    return out


def reference(engines: list[Engine]) -> PrefixIndex:
    ix = PrefixIndex(BS)
    for e in engines:
        ix.add_instance(e.name)
        for p in e.payloads:
            ix.apply(e.name, p)
    return ix


def wait_applied(url: str, engines: list[Engine], timeout_s: float = 15.0) -> None:
    """Until the service has applied every batch each engine published."""
    deadline = time.monotonic() + timeout_s
    want = {e.name: e.pub.next_seq for e in engines}
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, body = call(url + "/engines")
        got = {e["name"]: e["next_batch"] for e in body["engines"]}
        if all(got.get(k) == v for k, v in want.items()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the service did not catch up: {got} != {want}")


def expected_score(ref: PrefixIndex, names: list[str], hashes: list[bytes]) -> dict[str, int]:
    hits = ref.match(hashes)
    return {n: hits.get(n, 0) * BS for n in names}


def root() -> bytes:
    fn = hashing.get_hash_fn_by_name("sha256")
    return fn(SEED if SEED is not None else hashing.DEFAULT_NONE_HASH_SEED)


@pytest.fixture
def fleet():
    """Two engines and a service subscribed to both."""
    engines = [Engine("engine-a"), Engine("engine-b")]
    svc = IndexService(ServiceConfig(model="m", block_size=BS, hash_seed=SEED, idle_sync_s=0.2),
                       [e.spec for e in engines])
    st = ServiceThread(svc)
    st.start()
    try:
        yield st, svc, engines
    finally:
        st.close()
        for e in engines:
            e.close()


def drive(engines: list[Engine], seed: int, n: int = 30) -> list[list[int]]:
    ps = prompts(seed, n)
    for i, p in enumerate(ps):
        engines[i % len(engines)].serve(p)
    return ps


# -- the tests ------------------------------------------------------------------------------
def test_score_equals_the_in_process_index(fleet):
    st, svc, engines = fleet
    ps = drive(engines, 1, 40)  # 48-block pools: evictions happen (BlockRemoved on the wire)
    wait_applied(st.url, engines)
    ref = reference(engines)
    assert any(svc.sink.events[e.name][1] for e in engines), "the script should evict blocks"
    names = [e.name for e in engines]
    queries = ps + prompts(2, 10)  # and prompts never served (partial hits on system prompts)
    hit_any = 0
    for toks in queries:
        hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
        want = expected_score(ref, names, hashes)
        hit_any += any(want.values())
        for body in ({"token_ids": toks},
                     {"block_hashes": [h.hex() for h in hashes], "model": "m", "block_size": BS},
                     {"block_hashes": [hashing.block_hash_to_event_int(h) for h in hashes]}):
            status, got = call(st.url + "/score", "POST", body)
            assert status == 200, got
            assert got["instances"] == want
            assert got["cached_blocks"] == {k: v // BS for k, v in want.items()}
            assert got["blocks"] == len(hashes) and got["block_size"] == BS and got["model"] == "m"
    assert hit_any >= len(queries) // 2
    status, health = call(st.url + "/health")
    assert status == 200 and health["status"] == "ok" and health["pairs"] == ref.num_pairs()


BAD = [
    (b"{not json", 400, "bad_json"),
    (b"", 400, "bad_json"),
    (b"[1, 2]", 422, "bad_body"),
    (b'{"tokens": [1, 2]}', 422, "bad_body"),  # unknown field
    (b'{"token_ids": ["a"]}', 422, "bad_body"),
    (b'{"token_ids": [1.5]}', 422, "bad_body"),
    (b'{"block_hashes": ["zz"]}', 422, "bad_body"),
    (b'{"block_hashes": [-1]}', 422, "bad_body"),
    (b'{"block_hashes": [18446744073709551616]}', 422, "bad_body"),
    (b'{"block_hashes": [1], "token_ids": [1]}', 422, "bad_body"),
    (b"{}", 422, "bad_body"),
    (b'{"block_hashes": [1], "hash_algo": "sha256"}', 422, "bad_body"),
    (b'{"token_ids": [1, 2], "model": "other"}', 404, "unknown_model"),
    (b'{"token_ids": [1, 2], "block_size": 16}', 422, "block_size"),
    (b'{"token_ids": [1, 2], "hash_algo": "xxhash"}', 422, "hash_algo"),
    (b'{"token_ids": [1, 2], "hash_algo": "md5"}', 422, "hash_algo"),
    (b'{"block_hashes": [' + b"1," * 70000 + b"1]}", 413, "too_large"),
]


def test_bad_bodies_are_refused_and_the_service_keeps_serving(fleet):
    st, svc, engines = fleet
    ps = drive(engines, 3, 12)
    wait_applied(st.url, engines)
    ref = reference(engines)
    pairs = svc.pairs()
    before = metrics(st.url)
    for raw, status, reason in BAD:
        got_status, got = call(st.url + "/score", "POST", raw=raw)
        assert (got_status, got["reason"]) == (status, reason), (raw[:60], got)
        assert got["error"]
    # other routes' bad bodies
    for path, method, body, status in [
        ("/engines", "POST", {"name": "x"}, 422),
        ("/engines", "POST", {"name": "bad name!", "endpoint": "tcp://127.0.0.1:5"}, 422),
        ("/engines", "POST", {"name": "x", "endpoint": "http://127.0.0.1:5"}, 422),
        ("/engines", "POST", {"name": "x", "endpoint": "tcp://127.0.0.1:70000"}, 422),
        ("/engines", "POST", {"name": "engine-a", "endpoint": "tcp://127.0.0.1:5"}, 409),
        ("/engines/nope", "DELETE", None, 404),
        ("/feedback", "POST", {"engine": "nope", "claimed_tokens": 1, "cached_tokens": 1}, 404),
        ("/feedback", "POST", {"engine": "engine-a", "claimed_tokens": -1, "cached_tokens": 1}, 422),
        ("/nowhere", "GET", None, 404),
        ("/score", "GET", None, 405),
    ]:
        got_status, got = call(st.url + path, method, body)
        assert got_status == status, (path, body, got)
        assert "error" in got
    # nothing changed, and it still answers exactly
    assert svc.pairs() == pairs
    names = [e.name for e in engines]
    for toks in ps:
        status, got = call(st.url + "/score", "POST", {"token_ids": toks})
        assert status == 200 and got["instances"] == expected_score(
            ref, names, hashing.hash_blocks(toks, BS, algo="sha256", parent=root()))
    after = metrics(st.url)
    assert after["kvblock_index_refusals_total{reason=bad_json}"] - before.get(
        "kvblock_index_refusals_total{reason=bad_json}", 0) == 2
    assert after["kvblock_index_requests_total{code=422,route=/score}"] >= 12


def test_metrics_parse_and_move(fleet):
    st, svc, engines = fleet
    m0 = metrics(st.url)
    assert m0["kvblock_index_engines{}"] == 2
    ps = drive(engines, 4, 10)
    wait_applied(st.url, engines)
    for toks in ps:
        assert call(st.url + "/score", "POST", {"token_ids": toks})[0] == 200
    assert call(st.url + "/feedback", "POST", {"engine": "engine-a", "claimed_tokens": 32, "cached_tokens": 16}) \
        == (200, {"verdict": "over"})
    assert call(st.url + "/feedback", "POST", {"engine": "engine-a", "claimed_tokens": 0, "cached_tokens": 16}) \
        == (200, {"verdict": "under"})
    assert call(st.url + "/feedback", "POST", {"engine": "engine-b", "claimed_tokens": 16, "cached_tokens": 16}) \
        == (200, {"verdict": "exact"})
    m = metrics(st.url)
    assert m["kvblock_index_lookup_seconds_count{}"] - m0.get("kvblock_index_lookup_seconds_count{}", 0) == len(ps)
    assert m["kvblock_index_hash_seconds_count{}"] >= len(ps)
    for e in engines:
        assert m[f"kvblock_index_batches_applied_total{{engine={e.name}}}"] >= len(e.payloads)
        assert m[f"kvblock_index_events_total{{engine={e.name},kind=stored}}"] > 0
    assert m["kvblock_index_pairs{}"] == svc.pairs() > 0
    assert m["kvblock_index_memory_bytes{}"] > 0
    assert m["process_resident_memory_bytes{}"] > 0
    assert m["kvblock_index_reports_total{engine=engine-a,verdict=over}"] == 1
    assert m["kvblock_index_reports_total{engine=engine-a,verdict=under}"] == 1
    assert m["kvblock_index_reports_total{engine=engine-b,verdict=exact}"] == 1
    assert m["kvblock_index_requests_total{code=200,route=/score}"] == len(ps)


def test_malformed_batch_is_counted_and_the_index_stays_exact(fleet):
    st, svc, engines = fleet
    a, b = engines
    drive(engines, 5, 10)
    a.pub.publish_payload(b"\x93not msgpack")  # a malformed batch: a lost batch, a cleared instance
    a.payloads.clear()  # what the index may still claim of engine-a: only what follows
    ps = drive(engines, 6, 10)
    wait_applied(st.url, engines)
    ref = reference(engines)
    for toks in ps:
        hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
        status, got = call(st.url + "/score", "POST", {"token_ids": toks})
        assert status == 200
        # engine-b exact; engine-a never over what was stored after the bad batch
        want = expected_score(ref, [a.name, b.name], hashes)
        assert got["instances"][b.name] == want[b.name]
        assert got["instances"][a.name] <= want[a.name] or want[a.name] == 0 and got["instances"][a.name] == 0
    m = metrics(st.url)
    assert m["kvblock_index_batches_malformed_total{engine=engine-a}"] == 1
    assert m["kvblock_index_batches_malformed_total{engine=engine-b}"] == 0


def test_engine_restart_forgets_the_old_incarnation(fleet):
    st, svc, engines = fleet
    a, b = engines
    old = drive(engines, 7, 10)
    wait_applied(st.url, engines)
    port, rport = (int(ep.rsplit(":", 1)[1]) for ep in (a.pub.endpoint, a.pub.replay_endpoint))
    a.close()
    # the engine restarts: a new manager and publisher on the same ports, batches from 0
    a2 = rebind(lambda: Engine("engine-a", port=port, rport=rport))
    engines[0] = a2
    try:
        new = prompts(8, 3)
        deadline = time.monotonic() + 15
        names = [a2.name, b.name]
        while True:  # the SUB socket reconnects in the background: publish until seen
            a2.serve(new[a2.n % len(new)])
            time.sleep(0.2)
            _, view = call(st.url + "/engines")
            stats = {e["name"]: e for e in view["engines"]}["engine-a"]
            if stats["next_batch"] == a2.pub.next_seq and (stats["stats"]["restarts"] + stats["stats"]["resyncs"]) >= 1:
                break
            assert time.monotonic() < deadline, stats
        ref = reference([a2, b])
        for toks in old + new:
            hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
            status, got = call(st.url + "/score", "POST", {"token_ids": toks})
            assert status == 200 and got["instances"] == expected_score(ref, names, hashes), toks
    finally:
        a2.close()


def test_engines_added_and_removed_through_the_api(fleet):
    st, svc, engines = fleet
    c = Engine("engine-c")
    try:
        status, view = call(st.url + "/engines", "POST",
                            {"name": "engine-c", "endpoint": c.pub.endpoint, "replay_endpoint": c.pub.replay_endpoint})
        assert status == 201 and [v["name"] for v in view["engines"]] == ["engine-c"]
        ps = prompts(9, 6)
        for p in ps:
            c.serve(p)
        wait_applied(st.url, [c])
        ref = reference([c])
        toks = ps[0]
        hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
        status, got = call(st.url + "/score", "POST", {"token_ids": toks})
        assert got["instances"]["engine-c"] == ref.match(hashes)["engine-c"] * BS > 0
        assert set(got["instances"]) == {"engine-a", "engine-b", "engine-c"}
        status, gone = call(st.url + "/engines/engine-c", "DELETE")
        assert status == 200 and gone == {"removed": "engine-c", "pairs": ref.num_pairs()}
        status, got = call(st.url + "/score", "POST", {"token_ids": toks})
        assert "engine-c" not in got["instances"]
        assert [e["name"] for e in call(st.url + "/engines")[1]["engines"]] == ["engine-a", "engine-b"]
    finally:
        c.close()


def test_xxhash_without_a_seed_takes_block_hashes_only():
    e = Engine("x")
    try:
        svc = IndexService(ServiceConfig(block_size=BS, hash_algo="xxhash"), [e.spec])
        with ServiceThread(svc) as st:
            status, got = call(st.url + "/score", "POST", {"token_ids": list(range(16))})
            assert status == 422 and "--hash-seed" in got["error"]
            assert call(st.url + "/score", "POST", {"block_hashes": ["00ff", 7]})[0] == 200
        svc2 = IndexService(ServiceConfig(block_size=BS, hash_algo="xxhash", hash_seed="42"))
        fn = hashing.get_hash_fn_by_name("xxhash")
        assert svc2.hash_tokens(list(range(8))) == hashing.hash_blocks(list(range(8)), BS, algo="xxhash",
                                                                       parent=fn("42"))
        svc2.close()
    finally:
        e.close()


def test_config_and_engine_specs_are_checked():
    assert parse_engine("a=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558") == [EngineSpec(
        "a", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")]
    # data-parallel ranks on vLLM's offset endpoints (ZmqEventPublisher.offset_endpoint_port)
    assert parse_engine("a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5600,dp=3,topic=kv") == [
        EngineSpec("a@dp0", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600", "kv"),
        EngineSpec("a@dp1", "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601", "kv"),
        EngineSpec("a@dp2", "tcp://10.0.0.1:5559", "tcp://10.0.0.1:5602", "kv")]
    assert [e.endpoint for e in parse_engine("a=inproc://ev,dp=2")] == ["inproc://ev", "inproc://ev_dp1"]
    for bad in ["a", "a=", "=tcp://h:1", "a=tcp://h", "a=tcp://h:1,replay", "a=tcp://h:1,foo=bar", "a=tcp://h:0",
                "a=tcp://h:1,dp=0", "a=tcp://h:1,dp=x", "a=tcp://h:65535,dp=2", "a=ipc:///tmp/x,dp=2"]:
        with pytest.raises(ValueError):
            parse_engine(bad)
    for cfg in [ServiceConfig(block_size=0), ServiceConfig(hash_algo="md5"), ServiceConfig(model="")]:
        with pytest.raises(ValueError):
            IndexService(cfg)
    with pytest.raises(ValueError, match="twice"):
        IndexService(ServiceConfig(), [EngineSpec("a", "tcp://127.0.0.1:1"), EngineSpec("a", "tcp://127.0.0.1:2")])


def test_redis_backed_service_answers_as_the_in_process_one(redis_node):
    engines = [Engine("engine-a"), Engine("engine-b")]
    url = f"redis://127.0.0.1:{redis_node.port}"
    svc = IndexService(ServiceConfig(model="m", block_size=BS, hash_seed=SEED, redis=url, idle_sync_s=0.2),
                       [e.spec for e in engines])
    try:
        with ServiceThread(svc) as st:
            ps = drive(engines, 10, 20)
            wait_applied(st.url, engines)
            ref = reference(engines)
            names = [e.name for e in engines]
            for toks in ps:
                hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
                status, got = call(st.url + "/score", "POST", {"token_ids": toks})
                assert status == 200 and got["instances"] == expected_score(ref, names, hashes)
            assert call(st.url + "/health")[1]["index"] == "redis"
            redis_node.stop()  # Redis down: a clear 503, and the service keeps serving
            status, got = call(st.url + "/score", "POST", {"token_ids": ps[0]})
            assert status == 503 and got["reason"] == "unavailable"
            assert call(st.url + "/health")[0] == 503
            assert call(st.url + "/metrics")[0] == 200
    finally:
        for e in engines:
            e.close()


def test_cli_serve_from_the_readme_example():
    """``kvblock index serve --engine ... --port ...`` in a process of its own; SIGINT stops it (130)."""
    e = Engine("engine-a")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvblock", "index", "serve", "--engine",
                             f"engine-a={e.pub.endpoint},replay={e.pub.replay_endpoint}", "--block-size", str(BS),
                             "--port", str(port), "--log-level", "warning"]
                            + (["--hash-seed", SEED] if SEED is not None else []),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        toks = prompts(11, 1)[0]
        e.serve(toks)
        wait_applied(url, [e])
        hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
        status, got = call(url + "/score", "POST", {"token_ids": toks})
        assert status == 200 and got["instances"] == {"engine-a": len(hashes) * BS}
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        e.close()
    assert proc.returncode == 130, err  # Ctrl-C, as every kvblock command
    assert err.strip().splitlines()[-1] == "kvblock: interrupted", err
    assert f"kvblock index serve: serving on http://127.0.0.1:{port}" in out


def test_speculative_entries_through_the_api():
    e = Engine("engine-a")
    svc = IndexService(ServiceConfig(block_size=BS, hash_seed=SEED, idle_sync_s=0.2, speculative_ttl_ms=60_000),
                       [e.spec])
    try:
        with ServiceThread(svc) as st:
            e.serve(prompts(13, 1)[0])  # the stream is live (its first contact clears the engine)
            wait_applied(st.url, [e])
            toks = prompts(12, 1)[0][-9 * BS:]  # no block in common with the first
            n = len(toks) // BS
            status, got = call(st.url + "/score", "POST", {"token_ids": toks})
            assert got["instances"] == {"engine-a": 0} and got["speculative"] == {"engine-a": 0}
            assert call(st.url + "/speculate", "POST", {"engine": "engine-a", "token_ids": toks}) == (200, {"added": n})
            status, got = call(st.url + "/score", "POST", {"token_ids": toks})
            # speculated, never reported as cached
            assert got["instances"] == {"engine-a": 0} and got["speculative"] == {"engine-a": n * BS}
            assert call(st.url + "/speculate", "POST", {"engine": "nope", "token_ids": toks})[0] == 404
            assert call(st.url + "/speculate", "POST", {"engine": "engine-a", "tokens": toks})[0] == 422
            e.serve(toks)  # the engine computes it: its events confirm the entries
            wait_applied(st.url, [e])
            status, got = call(st.url + "/score", "POST", {"token_ids": toks})
            assert got["instances"] == got["speculative"] == {"engine-a": n * BS}
            m = metrics(st.url)
            assert m["kvblock_index_speculative_blocks_total{outcome=added}"] == n
            assert m["kvblock_index_speculative_blocks_total{outcome=confirmed}"] == n
            assert m["kvblock_index_speculative_live{}"] == 0
    finally:
        e.close()
    off = IndexService(ServiceConfig(block_size=BS))
    with ServiceThread(off) as st:
        status, got = call(st.url + "/speculate", "POST", {"engine": "x", "token_ids": [1, 2, 3, 4]})
        assert status == 409 and "--speculative-ttl-ms" in got["error"]
        assert "speculative" not in call(st.url + "/score", "POST", {"token_ids": [1, 2, 3, 4]})[1]


def free_port_pair() -> tuple[int, int]:
    """Ports ``p`` and ``p + 1``, both free now (vLLM offsets rank r's port by r)."""
    import socket

    for _ in range(200):
        p = free_port()
        try:
            with socket.socket() as a:
                a.bind(("127.0.0.1", p + 1))
            return p, p + 1
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def test_data_parallel_ranks_are_holders_of_their_own():
    """An engine of two data-parallel ranks, each with its own cache and publisher on vLLM's
    offset ports: the service files each rank's blocks under NAME@dpR, so a prefix cached on
    rank 1 is never credited to rank 0."""
    (p0, p1), (r0, r1) = free_port_pair(), free_port_pair()
    ranks = [Engine("dp@dp0", port=p0, rport=r0), Engine("dp@dp1", port=p1, rport=r1)]
    svc = IndexService(ServiceConfig(block_size=BS, hash_seed=SEED, idle_sync_s=0.2))
    try:
        with ServiceThread(svc) as st:
            status, view = call(st.url + "/engines", "POST", {"name": "dp", "endpoint": f"tcp://127.0.0.1:{p0}",
                                                            "replay_endpoint": f"tcp://127.0.0.1:{r0}",
                                                            "data_parallel_size": 2})
            assert status == 201 and [v["endpoint"] for v in view["engines"]] == [
                f"tcp://127.0.0.1:{p0}", f"tcp://127.0.0.1:{p1}"]
            ps = prompts(14, 6)
            ranks[0].serve(ps[0])
            ranks[1].serve(ps[1])
            wait_applied(st.url, ranks)
            ref = reference(ranks)
            for toks in ps[:2]:
                hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
                status, got = call(st.url + "/score", "POST", {"token_ids": toks})
                assert got["instances"] == expected_score(ref, ["dp@dp0", "dp@dp1"], hashes)
            assert call(st.url + "/score", "POST", {"token_ids": ps[1]})[1]["instances"]["dp@dp0"] < len(ps[1]) // BS * BS
            # a second subscription of a rank is refused as a whole
            assert call(st.url + "/engines", "POST", {"name": "dp", "endpoint": f"tcp://127.0.0.1:{p0}",
                                                      "data_parallel_size": 2})[0] == 409
            assert call(st.url + "/engines", "POST", {"name": "z", "endpoint": "tcp://127.0.0.1:5",
                                                      "data_parallel_size": 0})[0] == 422
            # the engine's own name removes every rank (a rank's name, that rank alone)
            pairs = svc.pairs()
            status, body = call(st.url + "/engines/dp", "DELETE")
            assert status == 200 and body == {"removed": "dp", "pairs": pairs, "ranks": ["dp@dp0", "dp@dp1"]}
            assert svc.pairs() == 0 and call(st.url + "/engines", "GET")[1]["engines"] == []
            assert call(st.url + "/engines/dp", "DELETE")[0] == 404
            assert call(st.url + "/engines/d", "DELETE")[0] == 404  # a prefix of the name is not it
    finally:
        for e in ranks:
            e.close()


def test_memory_cap_and_tier_weights_through_the_service():
    """A capped service under eviction: every /score at most the uncapped index's answer
    (never an over-report), the pairs under the cap, the evictions in /metrics; tier
    weights: GPU blocks at 1, an engine's host-memory blocks at 0.5."""
    from kvblock.events import BlockStored

    engines = [Engine("engine-a"), Engine("engine-b")]
    cap = 24
    svc = IndexService(ServiceConfig(model="m", block_size=BS, hash_seed=SEED, idle_sync_s=0.2, max_pairs=cap,
                                     tier_weights=(("GPU", 1.0), ("CPU", 0.5))), [e.spec for e in engines])
    try:
        with ServiceThread(svc) as st:
            ps = drive(engines, 21, 30)
            wait_applied(st.url, engines)
            ref = reference(engines)
            names = [e.name for e in engines]
            assert ref.num_pairs() > cap and svc.pairs() <= cap
            for toks in ps:
                hashes = hashing.hash_blocks(toks, BS, algo="sha256", parent=root())
                status, got = call(st.url + "/score", "POST", {"token_ids": toks})
                want = expected_score(ref, names, hashes)
                assert status == 200 and all(got["instances"][n] <= want[n] for n in names)
                # GPU blocks only so far: the weighted tokens are the cached tokens
                assert got["weighted"] == got["instances"]
            m = metrics(st.url)
            pairs, blocks, sweeps = svc.evicted()
            assert pairs >= ref.num_pairs() - svc.pairs() > 0
            assert m["kvblock_index_evicted_pairs_total{}"] == pairs
            assert m["kvblock_index_evicted_blocks_total{}"] == blocks > 0
            assert m["kvblock_index_evictions_total{}"] == sweeps > 0
            assert m["kvblock_index_max_pairs{}"] == cap
            assert m["kvblock_index_tier_weight{medium=CPU}"] == 0.5
            # an offloading engine: a chain on host memory counts at half
            svc.index.max_pairs = None
            chain = [10_001, 10_002, 10_003]
            engines[1].send([BlockStored(block_hashes=chain, parent_block_hash=None, token_ids=[], block_size=BS,
                                         lora_id=None, medium="CPU", lora_name=None)])
            wait_applied(st.url, engines)
            status, got = call(st.url + "/score", "POST", {"block_hashes": chain})
            assert got["instances"]["engine-b"] == 3 * BS and got["weighted"]["engine-b"] == 1.5 * BS
            status, got = call(st.url + "/score", "POST", {"block_hashes": chain, "medium": "GPU"})
            assert got["instances"]["engine-b"] == 0 and "weighted" not in got
    finally:
        for e in engines:
            e.close()


def test_cap_and_tier_weight_settings_are_checked():
    from kvblock.cli import build_parser

    for cfg in [ServiceConfig(max_pairs=-1), ServiceConfig(max_pairs=True),
                ServiceConfig(max_pairs=10, redis="redis://127.0.0.1:1"),
                ServiceConfig(tier_weights=(("GPU", -1.0),)), ServiceConfig(tier_weights=(("GPU", float("nan")),)),
                ServiceConfig(tier_weights=()), ServiceConfig(tier_weights=(("GPU", 1.0),), speculative_ttl_ms=10),
                ServiceConfig(tier_weights=(("GPU", 1.0),), redis="redis://127.0.0.1:1")]:
        with pytest.raises(ValueError):
            IndexService(cfg)
    p = build_parser()
    a = p.parse_args(["index", "serve", "--max-pairs", "1000", "--tier-weight", "GPU=1", "--tier-weight", "CPU=0.75"])
    assert a.max_pairs == 1000 and a.tier_weight == [("GPU", 1.0), ("CPU", 0.75)]
    for bad in (["--max-pairs", "-5"], ["--tier-weight", "GPU"], ["--tier-weight", "GPU=x"],
                ["--tier-weight", "GPU=-1"], ["--tier-weight", "=1"]):
        with pytest.raises(SystemExit):
            p.parse_args(["index", "serve", *bad])
