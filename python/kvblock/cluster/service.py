"""``kvblock index serve``: the fleet prefix index as an HTTP service.

A small aiohttp service that subscribes to engines' ZMQ KV-event streams (vLLM's wire
format, through :class:`~kvblock.cluster.KVEventSubscriber`) and answers, for a request's
block hashes or token ids, how long a prefix of it each engine holds. One service indexes
one model at one block size (run one per model). The full description, with examples, is
``docs/index_service.md``.

HTTP API (JSON bodies; every error is ``{"error": MESSAGE, "reason": CODE}`` with a 4xx/5xx
status, and changes nothing)::

    POST /score
      request   {"block_hashes": [HEX | INT, ...]}          # vLLM's block hashes, or
                {"token_ids": [INT, ...]}                    # hashed here, as the engines do
                optional: "model": STR (must be the service's --model when it has one),
                          "block_size": INT (must be the service's),
                          "hash_algo": STR (token_ids only; must be the service's),
                          "medium": STR ("GPU", "CPU", ...; absent: any medium)
                HEX: a digest (hex string, 1-64 bytes; its last 8 bytes are vLLM's event
                int); INT: vLLM's 64-bit event int, in [0, 2**64)
      200       {"model": STR | null, "block_size": INT,
                 "blocks": INT,                              # full blocks in the query
                 "instances": {ENGINE: CACHED_TOKENS, ...},  # every engine, 0 included
                 "cached_blocks": {ENGINE: CACHED_BLOCKS, ...},
                 "speculative": {ENGINE: TOKENS, ...},       # with --speculative-ttl-ms only:
                                                             # cached, then speculated, tokens
                 "weighted": {ENGINE: TOKENS, ...},          # with --tier-weight only (and no
                                                             # "medium"): tier-weighted tokens
                 "withheld": [ENGINE, ...]}                  # only when some are: engines whose
                                                             # event stream disconnected, answered
                                                             # 0 until it reconnects and resyncs
      400 body is not JSON; 404 unknown model; 413 body or query too large;
      422 body of the wrong shape, both or neither of block_hashes / token_ids, another
          block size or hash algorithm, token_ids for xxhash without --hash-seed;
      503 the index is unavailable (Redis down)
    GET  /health    200 {"status": "ok" | "degraded", "model", "block_size", "hash_algo", "index",
                         "engines": INT, "engines_down": {ENGINE: STATE}, "pairs": INT};
                    503 {"status": "unavailable", ...} (Redis does not answer a PING)
    GET  /metrics   Prometheus text format (see ``docs/index_service.md``)
    GET  /engines   200 {"engines": [{"name", "endpoint", "replay_endpoint", "topic",
                                      "next_batch": INT | null (the batch number expected next),
                                      "state": "ok" | "never_connected" | "disconnected" |
                                               "not_answering" (as /health's engines_down),
                                      "replay_failures": INT,
                                      "stats": {"applied", "gaps", "replayed", "lost",
                                                "malformed", "restarts", "resyncs"}}]}
    POST /engines   request {"name": STR, "endpoint": "tcp://HOST:PORT",
                             "replay_endpoint": "tcp://HOST:PORT" | null, "topic": STR,
                             "data_parallel_size": INT (default 1; N: ranks NAME@dp0..N-1
                             on vLLM's offset ports, each its own holder)}
                    201 {"engines": [as in GET /engines]}; 409 name taken; 422 bad body
    DELETE /engines/{name}   200 {"removed": NAME, "pairs": INT, "ranks": [NAME@dpR, ...] (a
                             data-parallel engine's own name removes all its ranks)};
                             404 unknown engine
    POST /speculate request {"engine": STR, "block_hashes" | "token_ids": as /score}
                    (a request with this prefix was just sent to the engine: its blocks count
                    in "speculative" until the engine's events confirm or drop them, or
                    --speculative-ttl-ms passes; "instances" never counts them).
                    200 {"added": INT}; 404 unknown engine; 409 speculation is off
    POST /feedback  request {"engine": STR, "claimed_tokens": INT, "cached_tokens": INT}
                    (what /score claimed for the engine a request went to, and what the
                    engine then reported cached, e.g. vLLM's ``usage.prompt_tokens_details.
                    cached_tokens``): counts an over-report (claimed > cached), an
                    under-report or an exact one. 200 {"verdict": "over"|"under"|"exact"};
                    404 unknown engine

Token ids are hashed with :func:`kvblock.hashing.hash_blocks` (vLLM's block hashes byte for
byte) from the root the engines use: ``hash_fn(seed)`` with ``seed`` the engines'
``PYTHONHASHSEED`` (``--hash-seed``), or vLLM's fixed ``"vllm-none-hash"`` for ``sha256`` /
``sha256_cbor`` engines started without one. vLLM draws an ``xxhash`` / ``xxhash_cbor`` root
at random per engine unless ``PYTHONHASHSEED`` is set: without ``--hash-seed`` such a service
refuses ``token_ids`` (422) and takes ``block_hashes`` only. Requests with LoRA adapters,
multimodal inputs or a ``cache_salt`` have extra keys in their hashes: send their
``block_hashes``.

Concurrency: one thread runs the ZMQ subscriber (every socket is used from that thread
alone; engines added or removed through the API are handed to it), the event loop answers
HTTP. The index is read and written under one lock: a lookup never sees half a batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Iterator, Sequence, Union

import msgspec

from .. import hashing
from .._optional import require_all
from .errors import IndexUnavailable
from .index import PrefixIndex

__all__ = [
    "EngineSpec",
    "FeedbackRequest",
    "IndexService",
    "ScoreRequest",
    "ServiceConfig",
    "ServiceThread",
    "BindError",
    "parse_engine",
    "serve",
]

log = logging.getLogger("kvblock.cluster.service")

#: Most blocks one /score may name (block_hashes, or full blocks of token_ids).
MAX_QUERY_BLOCKS = 1 << 16
#: Largest request body (bytes).
MAX_BODY_BYTES = 32 << 20
#: Token-id queries longer than this are hashed off the event loop.
_INLINE_TOKENS = 1 << 14
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-*]+):([0-9]{1,5})|ipc://\S+|inproc://\S+)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@\-]{0,127}$")
_HEX = re.compile(r"^(0x)?([0-9A-Fa-f]{2}){1,64}$")
#: Lookup latency buckets (seconds): 5 µs .. 1 s.
LATENCY_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 1.0)

U64 = Annotated[int, msgspec.Meta(ge=0)]  # < 2**64: checked by the index (422)
Count = Annotated[int, msgspec.Meta(ge=0)]


# -- request bodies -------------------------------------------------------------------------
class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /score`` (see the module docstring)."""

    block_hashes: Union[list[Union[str, U64]], None] = None
    token_ids: Union[list[int], None] = None
    model: Union[str, None] = None
    block_size: Union[int, None] = None
    hash_algo: Union[str, None] = None
    medium: Union[str, None] = None


class EngineRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /engines``."""

    name: str
    endpoint: str
    replay_endpoint: Union[str, None] = None
    topic: str = ""
    data_parallel_size: int = 1


class SpeculateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /speculate``."""

    engine: str
    block_hashes: Union[list[Union[str, U64]], None] = None
    token_ids: Union[list[int], None] = None
    model: Union[str, None] = None
    block_size: Union[int, None] = None
    hash_algo: Union[str, None] = None


class FeedbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /feedback``."""

    engine: str
    claimed_tokens: Count
    cached_tokens: Count


class RequestError(Exception):
    """A refused request: ``status`` (4xx/5xx), ``reason`` (a short code for the metrics
    label) and the message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


# -- configuration --------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine's event stream: ``endpoint`` its PUB address, ``replay_endpoint`` its
    ROUTER replay address (None: no replay), ``topic`` the topic subscribed to."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def check(self) -> "EngineSpec":
        """Self, or ValueError naming the bad field (name: letters, digits, ``._:@-``, at
        most 128; endpoints ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``)."""
        if not _NAME.match(self.name):
            raise ValueError(f"engine name {self.name!r}: 1-128 characters of letters, digits and ._:@- "
                             "(starting with a letter or digit)")
        for field, ep in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if ep is None:
                continue
            m = _ENDPOINT.match(ep)
            if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
                raise ValueError(f"{field} {ep!r}: expected tcp://HOST:PORT (port 1-65535), ipc://PATH "
                                 "or inproc://NAME")
        if len(self.topic) > 256:
            raise ValueError("topic: at most 256 characters")
        return self


#: Most data-parallel ranks of one engine.
MAX_DP = 256


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` of an engine publishes on, by vLLM's rule
    (``ZmqEventPublisher.offset_endpoint_port``): ``tcp://HOST:PORT`` -> port + rank (a
    port of 0 is kept), ``inproc://NAME`` -> ``inproc://NAME_dpRANK``; rank 0 unchanged.

    Raises:
        ValueError: another scheme (vLLM refuses it too) or a port past 65535."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r}: the port is not a number")
        if int(port) == 0:
            return endpoint
        if int(port) + rank > 65535:
            raise ValueError(f"endpoint {endpoint!r}: rank {rank}'s port {int(port) + rank} is past 65535")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"endpoint {endpoint!r}: data-parallel engines publish on tcp:// or inproc:// endpoints")


def data_parallel(spec: EngineSpec, size: int) -> list[EngineSpec]:
    """One spec per data-parallel rank (each rank has its own KV cache and publisher):
    ``NAME@dpR`` on vLLM's offset endpoints (:func:`offset_endpoint`); ``[spec]`` for
    ``size == 1``. The index then files each rank's blocks under its own name, so an answer
    never credits one rank with another's blocks.

    Raises:
        ValueError: ``size`` not in 1..256, or an endpoint that cannot be offset."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_DP:
        raise ValueError(f"data-parallel size: must be an int in 1..{MAX_DP}, got {size!r}")
    if size == 1:
        return [spec.check()]
    return [EngineSpec(f"{spec.name}@dp{r}", offset_endpoint(spec.endpoint, r),
                       None if spec.replay_endpoint is None else offset_endpoint(spec.replay_endpoint, r),
                       spec.topic).check() for r in range(size)]


def parse_engine(text: str) -> list[EngineSpec]:
    """``NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=TOPIC][,dp=N]`` (the CLI's
    ``--engine``) as :class:`EngineSpec`\\ s: one, or with ``dp=N`` one per data-parallel
    rank (:func:`data_parallel`).

    Raises:
        ValueError: not of that form, or a bad name, endpoint or size.
    """
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ValueError(f"--engine {text!r}: expected NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT]")
    endpoint, *opts = rest.split(",")
    replay: str | None = None
    topic = ""
    dp = 1
    for opt in opts:
        key, sep, value = opt.partition("=")
        if key == "replay" and sep and value:
            replay = value
        elif key == "topic" and sep:
            topic = value
        elif key == "dp" and sep and value.isdigit():
            dp = int(value)
        else:
            raise ValueError(f"--engine {text!r}: unknown option {opt!r} (replay=URL, topic=TOPIC, dp=N)")
    return data_parallel(EngineSpec(name, endpoint, replay, topic), dp)


@dataclass(frozen=True)
class ServiceConfig:
    """What a service indexes and how.

    Attributes:
        model: the model served (None: queries may name any model, or none).
        block_size: tokens per block of the engines (events of other sizes are skipped,
            queries naming another size are refused).
        hash_algo: the engines' ``--prefix-caching-hash-algo`` (for ``token_ids`` queries).
        hash_seed: the engines' ``PYTHONHASHSEED`` (None: vLLM's default root, which is
            fixed for sha256 / sha256_cbor and random for xxhash / xxhash_cbor).
        redis: ``redis://host:port`` or ``redis+cluster://host:port`` to keep the index in
            Redis (namespace: the model, or ``kvblock``); None: in process.
        redis_ttl_s: lifetime of a silent engine's entries in Redis, seconds, finite and > 0.
        idle_sync_s: an engine silent this long is asked for what it published since.
        max_query_blocks: most blocks per query.
        speculative_ttl_ms: > 0: keep speculative entries (``POST /speculate``) this long
            unless the engines' events confirm or drop them first; 0: off.
        max_pairs: the in-process index's memory cap in (block, engine) pairs, >= 1 (None: none;
            see :class:`~kvblock.cluster.PrefixIndex`: what it evicts and in what order,
            counted in ``kvblock_index_evicted_pairs``).
        tier_weights: ``((medium, weight), ...)``: /score also answers each engine's
            tier-weighted cached tokens (``PrefixIndex.match_weighted``); None: not.
    """

    model: str | None = None
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    redis: str | None = None
    redis_ttl_s: float = 300.0
    idle_sync_s: float | None = 1.0
    max_query_blocks: int = MAX_QUERY_BLOCKS
    speculative_ttl_ms: float = 0.0
    max_pairs: int | None = None
    tier_weights: tuple[tuple[str | None, float], ...] | None = None

    def check(self) -> "ServiceConfig":
        """Self, or ValueError naming the bad field."""
        if self.max_pairs is not None:
            if isinstance(self.max_pairs, bool) or not isinstance(self.max_pairs, int) or self.max_pairs < 1:
                raise ValueError(f"max_pairs: must be an int >= 1 (a cap of 0 would hold nothing; None: no cap), "
                                 f"got {self.max_pairs!r}")
            if self.redis is not None:
                raise ValueError("max_pairs: the memory cap is the in-process index's (Redis entries expire "
                                 "with --redis-ttl-s)")
        if self.tier_weights is not None:
            from .router import _check_tier_weights

            _check_tier_weights(dict(self.tier_weights), None, None)
            if self.redis is not None:
                raise ValueError("tier_weights: the Redis index has no match_weighted; use the in-process index")
            if self.speculative_ttl_ms > 0:
                raise ValueError("tier_weights with --speculative-ttl-ms: not supported (speculative entries "
                                 "have no medium)")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size: must be an int > 0, got {self.block_size!r}")
        if self.hash_algo not in hashing.ALGORITHMS:
            raise ValueError(f"hash_algo: {self.hash_algo!r} is not one of {', '.join(hashing.ALGORITHMS)}")
        if isinstance(self.redis_ttl_s, bool) or not isinstance(self.redis_ttl_s, (int, float)) \
                or not 0 < self.redis_ttl_s < math.inf:
            raise ValueError(f"redis_ttl_s: must be a finite number of seconds > 0 (entries would expire as soon "
                             f"as they are written), got {self.redis_ttl_s!r}")
        if not self.speculative_ttl_ms >= 0:
            raise ValueError(f"speculative_ttl_ms: must be >= 0, got {self.speculative_ttl_ms}")
        if self.max_query_blocks <= 0:
            raise ValueError("max_query_blocks: must be > 0")
        if self.model is not None and not self.model:
            raise ValueError("model: must be non-empty (or None)")
        return self

    def root(self) -> bytes | None:
        """The engines' root hash (vLLM's ``NONE_HASH``), or None where it is random per
        engine (xxhash without a seed)."""
        fn = hashing.get_hash_fn_by_name(self.hash_algo)
        if self.hash_seed is not None:
            return fn(self.hash_seed)
        if self.hash_algo in ("xxhash", "xxhash_cbor"):
            return None
        return fn(hashing.DEFAULT_NONE_HASH_SEED)


# -- the index under a lock -----------------------------------------------------------------
class _LockedSink:
    """The index as the subscriber's sink: every call under ``lock``, with event counters
    per engine (stored, removed, cleared, skipped; clears of the instance)."""

    def __init__(self, index: Any, lock: threading.Lock) -> None:
        self.index = index
        self.lock = lock
        self.events: dict[str, list[int]] = {}
        self.clears: dict[str, int] = {}

    def apply(self, instance: str, payload: bytes, now_ms: int = 0) -> object:
        with self.lock:
            st = self.index.apply(instance, payload, now_ms)
        c = self.events.setdefault(instance, [0, 0, 0, 0])
        for i in range(4):
            c[i] += int(st[i])
        return st

    def clear_instance(self, instance: str) -> int:
        with self.lock:
            n = int(self.index.clear_instance(instance))
        self.clears[instance] = self.clears.get(instance, 0) + 1
        return n

    def add_instance(self, instance: str) -> object:
        with self.lock:
            return self.index.add_instance(instance)

    def forget(self, instance: str) -> int:
        with self.lock:
            try:
                n = int(self.index.remove_instance(instance))
            except KeyError:
                n = 0
        self.events.pop(instance, None)
        self.clears.pop(instance, None)
        return n


# -- the service ----------------------------------------------------------------------------
class IndexService:
    """The index, its subscriber thread, its metrics and its HTTP application.

    Args:
        config: what to index (:class:`ServiceConfig`).
        engines: engines to subscribe to from the start.

    Use :meth:`app` for the aiohttp application (its startup starts the subscriber thread,
    its cleanup stops it and closes the sockets), or :class:`ServiceThread` / :func:`serve`.

    Raises:
        ValueError: a bad config or engine, or two engines of one name.
        ModuleNotFoundError: aiohttp, prometheus-client or pyzmq (or redis, with
            ``config.redis``) is not installed.
    """

    def __init__(self, config: ServiceConfig, engines: Iterable[EngineSpec] = ()) -> None:
        _, prom, _ = require_all(_SERVICE_NEEDS, extra="cluster", what="kvblock index serve")
        from .subscriber import KVEventSubscriber

        self.config = config.check()
        self._root = config.root()
        self._fn = hashing.get_hash_fn_by_name(config.hash_algo)
        self.lock = threading.Lock()
        self.index: Any
        if config.redis is not None:
            from .redis_index import RedisPrefixIndex

            self.index = RedisPrefixIndex(config.redis, config.model or "kvblock", ttl_s=config.redis_ttl_s,
                                          block_size=config.block_size)
        else:
            self.index = PrefixIndex(config.block_size, max_pairs=config.max_pairs)
        self.tier_weights = None if config.tier_weights is None else dict(config.tier_weights)
        self.speculative = config.speculative_ttl_ms > 0
        if self.speculative:
            from .speculative import SpeculativeIndex

            self.index = SpeculativeIndex(self.index, config.speculative_ttl_ms, lambda: time.time() * 1000)
        self.sink = _LockedSink(self.index, self.lock)
        self.subscriber = KVEventSubscriber(self.sink, idle_sync_s=config.idle_sync_s)
        self.engines: dict[str, EngineSpec] = {}
        self._ops: queue.Queue[tuple[str, Any, concurrent.futures.Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = False
        self.loop_errors = 0
        specs = [e.check() for e in engines]
        names = [e.name for e in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engines: a name is given twice ({', '.join(sorted(names))})")
        for spec in specs:
            self._add_now(spec)

        # -- metrics (one registry per service)
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self.lookup_seconds = prom.Histogram(
            "kvblock_index_lookup_seconds", "Time of one /score lookup in the index (hashing excluded).",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.hash_seconds = prom.Histogram(
            "kvblock_index_hash_seconds", "Time hashing the token ids of one /score.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = prom.Counter(
            "kvblock_index_requests", "HTTP requests answered, by route and status.",
            ["route", "code"], registry=self.registry)
        self.refusals = prom.Counter(
            "kvblock_index_refusals", "Requests refused, by reason.", ["reason"], registry=self.registry)
        self.reports = prom.Counter(
            "kvblock_index_reports", "POST /feedback verdicts per engine: over (the index claimed more "
            "than the engine had cached), under, exact.", ["engine", "verdict"], registry=self.registry)
        self.registry.register(_StreamCollector(self))
        prom.ProcessCollector(registry=self.registry)

    # -- engines (the subscriber thread owns the sockets) -----------------------------------
    def _add_now(self, spec: EngineSpec) -> str:
        if spec.name in self.engines:
            raise KeyError(spec.name)
        self.subscriber.add_engine(spec.name, spec.endpoint, spec.replay_endpoint, topic=spec.topic)
        self.engines = {**self.engines, spec.name: spec}
        return spec.name

    def _remove_now(self, name: str) -> int:
        if name not in self.engines:
            raise KeyError(name)
        self.subscriber.remove_engine(name)
        self.engines = {k: v for k, v in self.engines.items() if k != name}
        return self.sink.forget(name)

    def _call(self, op: str, arg: Any) -> "concurrent.futures.Future[Any]":
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._thread is None:  # not started: do it here
            try:
                fut.set_result(self._add_now(arg) if op == "add" else self._remove_now(arg))
            except BaseException as e:
                fut.set_exception(e)
        else:
            self._ops.put((op, arg, fut))
        return fut

    def add_engine(self, spec: EngineSpec) -> "concurrent.futures.Future[Any]":
        """Subscribe to one more engine (done by the subscriber thread; the future gives its
        name, or raises
        ``KeyError`` for a name taken, ``ValueError`` for a bad spec)."""
        return self._call("add", spec.check())

    def remove_engine(self, name: str) -> "concurrent.futures.Future[Any]":
        """Unsubscribe and forget the engine's blocks (the future gives the pairs dropped,
        or raises ``KeyError`` for an unknown engine)."""
        return self._call("remove", name)

    def _loop(self) -> None:
        while self._running:
            while True:
                try:
                    op, arg, fut = self._ops.get_nowait()
                except queue.Empty:
                    break
                try:
                    fut.set_result(self._add_now(arg) if op == "add" else self._remove_now(arg))
                except Exception as e:
                    fut.set_exception(e)
            try:
                self.subscriber.poll(20)
            except Exception:  # keep serving; the stream resyncs on the next gap
                self.loop_errors += 1
                log.exception("kvblock index serve: subscriber loop error")
                time.sleep(0.02)

    def start(self) -> None:
        """Start the subscriber thread (idempotent)."""
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvblock-index-subscriber")
        self._thread.start()

    def close(self) -> None:
        """Stop the subscriber thread and close every socket (and the Redis client)."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        while not self._ops.empty():
            _, _, fut = self._ops.get_nowait()
            fut.set_exception(RuntimeError("the service is closing"))
        self.subscriber.close()
        if self.config.redis is not None:
            self.index.close()

    # -- lookups ----------------------------------------------------------------------------
    def _hashes(self, req: ScoreRequest | SpeculateRequest) -> tuple[Any, str | None]:
        """The query's block hashes (bytes / ints), and None or a reason to hash off-loop."""
        cfg = self.config
        if req.model is not None and cfg.model is not None and req.model != cfg.model:
            raise RequestError(404, "unknown_model", f"unknown model {req.model!r}: this service indexes "
                               f"{cfg.model!r}")
        if req.block_size is not None and req.block_size != cfg.block_size:
            raise RequestError(422, "block_size", f"block_size {req.block_size} is not this service's "
                               f"({cfg.block_size})")
        if (req.block_hashes is None) == (req.token_ids is None):
            raise RequestError(422, "bad_body", "give exactly one of block_hashes and token_ids")
        if req.block_hashes is not None:
            if req.hash_algo is not None:  # hash_algo names how token_ids are hashed
                raise RequestError(422, "bad_body", "hash_algo goes with token_ids only")
            if len(req.block_hashes) > cfg.max_query_blocks:
                raise RequestError(413, "too_large", f"{len(req.block_hashes)} block hashes: at most "
                                   f"{cfg.max_query_blocks} per query")
            out: list[bytes | int] = []
            for i, h in enumerate(req.block_hashes):
                if isinstance(h, str):
                    if not _HEX.match(h):
                        raise RequestError(422, "bad_body", f"block_hashes[{i}]: {h[:80]!r} is not a hex digest "
                                           "of 1-64 bytes")
                    out.append(bytes.fromhex(h[2:] if h.startswith("0x") else h))
                else:
                    out.append(h)
            return out, None
        assert req.token_ids is not None
        if req.hash_algo is not None and req.hash_algo != cfg.hash_algo:
            raise RequestError(422, "hash_algo", f"hash_algo {req.hash_algo!r} is not the engines' "
                               f"({cfg.hash_algo!r})")
        if self._root is None:
            raise RequestError(422, "hash_algo", f"{cfg.hash_algo} engines draw a random root hash unless "
                               "PYTHONHASHSEED is set: start the service with --hash-seed (the engines' "
                               "PYTHONHASHSEED) or send block_hashes")
        if len(req.token_ids) // cfg.block_size > cfg.max_query_blocks:
            raise RequestError(413, "too_large", f"{len(req.token_ids)} token ids: at most "
                               f"{cfg.max_query_blocks} blocks per query")
        return req.token_ids, "tokens"

    def hash_tokens(self, token_ids: Sequence[int]) -> list[hashing.BlockHash]:
        """The engines' block hashes of ``token_ids`` (full blocks only).

        Raises:
            RequestError: token ids the hash cannot take (422)."""
        assert self._root is not None
        t0 = time.perf_counter()
        try:
            out = list(hashing.hash_blocks(token_ids, self.config.block_size, algo=self._fn, parent=self._root))
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestError(422, "bad_body", f"token_ids: {e}") from None
        self.hash_seconds.observe(time.perf_counter() - t0)
        return out

    def lookup(self, hashes: Any, medium: str | None = None) -> tuple[dict[str, int], dict[str, int] | None]:
        """Cached-prefix blocks per engine (every subscribed engine, 0 included; with Redis,
        also the other writers' live instances with a hit), and with speculation on the
        same counting speculative entries too (else None).

        Raises:
            RequestError: malformed hashes (422), the index unavailable (503)."""
        return self._lookup(hashes, medium)[:2]

    def lookup_weighted(self, hashes: Any, medium: str | None = None) -> tuple[
            dict[str, int], dict[str, int] | None, dict[str, float] | None]:
        """:meth:`lookup`, and with tier weights (and no ``medium``) each engine's weighted
        cached blocks (else None)."""
        return self._lookup(hashes, medium)

    def _lookup(self, hashes: Any, medium: str | None) -> tuple[
            dict[str, int], dict[str, int] | None, dict[str, float] | None]:
        t0 = time.perf_counter()
        spec: dict[str, int] | None = None
        weighted: dict[str, float] | None = None
        try:
            with self.lock:
                if self.speculative:
                    hits, spec = self.index.match_both(hashes, medium)
                else:
                    hits = self.index.match(hashes, medium)
                if self.tier_weights is not None and medium is None:
                    weighted = {k: v[0] for k, v in self.index.match_weighted(hashes, self.tier_weights).items()}
        except IndexUnavailable as e:
            raise RequestError(503, "unavailable", f"the index is unavailable: {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestError(422, "bad_body", str(e)) from None
        self.lookup_seconds.observe(time.perf_counter() - t0)
        out = {name: 0 for name in self.engines}
        out.update(hits)
        if spec is not None:
            spec = {**{name: 0 for name in self.engines}, **spec}
        if weighted is not None:
            weighted = {**{name: 0.0 for name in self.engines}, **weighted}
        for name in self.withheld():
            for answer in (out, spec, weighted):
                if answer is not None and name in answer:
                    answer[name] = 0
        return out, spec, weighted

    def withheld(self) -> list[str]:
        """The engines whose claims /score withholds (answers 0 for): those whose event
        stream disconnected. Their entries stay in the index, but the removals they publish
        meanwhile are missed, so claiming them could over-report; on reconnecting the stream
        resynchronises (replays the gap, or drops the engine's entries if the gap is lost)
        and its claims count again."""
        return sorted(name for name, state in self.engines_down().items() if state == "disconnected")

    def speculate(self, engine: str, hashes: Any) -> int:
        """Record that ``engine`` will hold ``hashes`` (past what it holds now); returns the
        entries added.

        Raises:
            RequestError: speculation off (409), unknown engine (404), bad hashes (422)."""
        if not self.speculative:
            raise RequestError(409, "speculation_off", "speculation is off: start the service with "
                               "--speculative-ttl-ms")
        if engine not in self.engines:
            raise RequestError(404, "unknown_engine", f"unknown engine {engine!r}")
        try:
            with self.lock:
                held = self.index.match(hashes).get(engine, 0)
                return int(self.index.speculate(engine, hashes, held))
        except IndexUnavailable as e:
            raise RequestError(503, "unavailable", f"the index is unavailable: {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestError(422, "bad_body", str(e)) from None

    def score_response(self, n_blocks: int, hits: dict[str, int],
                       spec: dict[str, int] | None = None, weighted: dict[str, float] | None = None) -> dict[str, Any]:
        bs = self.config.block_size
        out = {"model": self.config.model, "block_size": bs, "blocks": n_blocks,
               "instances": {k: v * bs for k, v in hits.items()}, "cached_blocks": hits}
        if spec is not None:
            out["speculative"] = {k: v * bs for k, v in spec.items()}
        if weighted is not None:
            out["weighted"] = {k: v * bs for k, v in weighted.items()}
        return out

    def engine_view(self, name: str) -> dict[str, Any]:
        spec = self.engines[name]
        eng = self.subscriber.engines.get(name)
        stats = eng.stream.stats if eng is not None else None
        return {"name": name, "endpoint": spec.endpoint, "replay_endpoint": spec.replay_endpoint,
                "topic": spec.topic, "next_batch": stats_next(eng),
                "state": "never_connected" if eng is None else eng.state(),
                "replay_failures": 0 if eng is None else eng.replay_failures,
                "stats": {k: getattr(stats, k, 0) for k in
                          ("applied", "gaps", "replayed", "lost", "malformed", "restarts", "resyncs")}}

    def pairs(self) -> int:
        with self.lock:
            return int(self.index.num_pairs())

    def memory_bytes(self) -> int:
        idx = self.index.mirror if self.config.redis is not None else self.index
        with self.lock:
            return int(idx.memory_bytes())

    def evicted(self) -> tuple[int, int, int]:
        """What the memory cap evicted: (pairs, blocks, sweeps)."""
        with self.lock:
            return tuple(int(x) for x in self.index.evicted())  # type: ignore[return-value]

    def engines_down(self) -> dict[str, str]:
        """The engines not heard from as expected, by state (see ``_Engine.state``):
        ``never_connected``, ``disconnected``, ``not_answering`` (replay requests unanswered)."""
        out = {}
        for name, eng in list(self.subscriber.engines.items()):
            state = eng.state()
            if state != "ok":
                out[name] = state
        return out

    def available(self) -> bool:
        """Whether the index answers: the in-process one always; Redis when it answers a
        ``PING`` now (short timeouts), so /health never reports an unreachable Redis ok."""
        if self.config.redis is None:
            return True
        with self.lock:
            return bool(self.index.ping())  # a SpeculativeIndex passes it to the Redis index

    # -- HTTP -------------------------------------------------------------------------------
    def app(self) -> Any:
        """The aiohttp ``web.Application`` of the API (see the module docstring)."""
        web = _web()

        svc = self

        def json_response(obj: Any, status: int = 200) -> web.Response:
            return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")

        async def body_of(request: web.Request, typ: type[Any]) -> Any:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(413, "too_large", f"body over {MAX_BODY_BYTES} bytes") from None
            try:
                return msgspec.json.decode(raw, type=typ)
            except msgspec.ValidationError as e:  # JSON of the wrong shape
                raise RequestError(422, "bad_body", str(e)) from None
            except msgspec.DecodeError as e:  # not JSON
                raise RequestError(400, "bad_json", f"the body is not JSON: {e}") from None

        @web.middleware
        async def errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
            try:
                resp: web.StreamResponse = await handler(request)
            except RequestError as e:
                svc.refusals.labels(e.reason).inc()
                if e.status >= 500:
                    log.warning("kvblock index serve: %s %s: %s", request.method, request.path, e)
                else:
                    log.info("kvblock index serve: refused %s %s (%d %s): %s", request.method, request.path,
                             e.status, e.reason, e)
                resp = json_response({"error": str(e), "reason": e.reason}, e.status)
            except web.HTTPException as e:
                svc.refusals.labels("http").inc()
                resp = json_response({"error": e.reason, "reason": "http"}, e.status)
            except Exception as e:  # a bug: answer 500, keep serving
                log.exception("kvblock index serve: %s %s failed", request.method, request.path)
                svc.refusals.labels("internal").inc()
                resp = json_response({"error": f"internal error: {type(e).__name__}", "reason": "internal"}, 500)
            svc.requests.labels(route, str(resp.status)).inc()
            return resp

        async def score(request: web.Request) -> web.Response:
            req = await body_of(request, ScoreRequest)
            hashes, tokens = svc._hashes(req)
            if tokens is not None:
                if len(hashes) > _INLINE_TOKENS:
                    hashes = await asyncio.to_thread(svc.hash_tokens, hashes)
                else:
                    hashes = svc.hash_tokens(hashes)
            if svc.config.redis is not None:
                hits, spec, weighted = await asyncio.to_thread(svc.lookup_weighted, hashes, req.medium)
            else:
                hits, spec, weighted = svc.lookup_weighted(hashes, req.medium)
            body = svc.score_response(len(hashes), hits, spec, weighted)
            withheld = svc.withheld()
            if withheld:
                body["withheld"] = withheld
            return json_response(body)

        async def speculate(request: web.Request) -> web.Response:
            req = await body_of(request, SpeculateRequest)
            if not svc.speculative:  # before hashing anything
                svc.speculate(req.engine, [])
            hashes, tokens = svc._hashes(req)
            if tokens is not None:
                hashes = await asyncio.to_thread(svc.hash_tokens, hashes)
            if svc.config.redis is not None:
                added = await asyncio.to_thread(svc.speculate, req.engine, hashes)
            else:
                added = svc.speculate(req.engine, hashes)
            return json_response({"added": added})

        async def health(request: web.Request) -> web.Response:
            ok = svc.available() if svc.config.redis is None else await asyncio.to_thread(svc.available)
            down = svc.engines_down()
            status = "unavailable" if not ok else "degraded" if down else "ok"
            return json_response({"status": status, "model": svc.config.model,
                                  "block_size": svc.config.block_size, "hash_algo": svc.config.hash_algo,
                                  "index": "redis" if svc.config.redis is not None else "memory",
                                  "engines": len(svc.engines), "engines_down": down, "pairs": svc.pairs()},
                                 200 if ok else 503)

        async def metrics(request: web.Request) -> web.Response:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            body = await asyncio.to_thread(generate_latest, svc.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def list_engines(request: web.Request) -> web.Response:
            return json_response({"engines": [svc.engine_view(n) for n in sorted(svc.engines)]})

        async def add_engine(request: web.Request) -> web.Response:
            req = await body_of(request, EngineRequest)
            try:
                specs = data_parallel(EngineSpec(req.name, req.endpoint, req.replay_endpoint, req.topic),
                                      req.data_parallel_size)
            except ValueError as e:
                raise RequestError(422, "bad_body", str(e)) from None
            taken = [s.name for s in specs if s.name in svc.engines]
            if taken:
                raise RequestError(409, "engine_exists", f"engine {taken[0]!r} is already subscribed")
            for i, spec in enumerate(specs):
                try:
                    await asyncio.wrap_future(svc.add_engine(spec))
                except Exception as e:  # a name taken meanwhile, or zmq refused the address
                    for done in specs[:i]:  # all ranks or none
                        await asyncio.wrap_future(svc.remove_engine(done.name))
                    if isinstance(e, KeyError):
                        raise RequestError(409, "engine_exists", f"engine {spec.name!r} is already subscribed") \
                            from None
                    raise RequestError(422, "bad_endpoint", f"cannot subscribe to {spec.endpoint!r}: {e}") from None
                log.info("kvblock index serve: subscribed to %s at %s", spec.name, spec.endpoint)
            return json_response({"engines": [svc.engine_view(s.name) for s in specs]}, 201)

        async def delete_engine(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            # an engine added with data_parallel_size N is its ranks NAME@dp0..N-1: its own
            # name removes them all
            ranks = [name] if name in svc.engines else sorted(
                (k for k in svc.engines if re.fullmatch(re.escape(name) + r"@dp\d+", k)),
                key=lambda k: int(k.rsplit("@dp", 1)[1]))
            if not ranks:
                raise RequestError(404, "unknown_engine", f"unknown engine {name!r}")
            pairs = 0
            for rank in ranks:
                try:
                    pairs += await asyncio.wrap_future(svc.remove_engine(rank))
                except KeyError:  # removed meanwhile by another request
                    continue
                log.info("kvblock index serve: unsubscribed from %s", rank)
            body: dict[str, Any] = {"removed": name, "pairs": pairs}
            if ranks != [name]:
                body["ranks"] = ranks
            return json_response(body)

        async def feedback(request: web.Request) -> web.Response:
            req = await body_of(request, FeedbackRequest)
            if req.engine not in svc.engines:
                raise RequestError(404, "unknown_engine", f"unknown engine {req.engine!r}")
            verdict = ("over" if req.claimed_tokens > req.cached_tokens
                       else "under" if req.claimed_tokens < req.cached_tokens else "exact")
            svc.reports.labels(req.engine, verdict).inc()
            if verdict == "over":
                log.warning("kvblock index serve: %s: over-report, claimed %d tokens, %d cached", req.engine,
                            req.claimed_tokens, req.cached_tokens)
            return json_response({"verdict": verdict})

        async def on_startup(app: web.Application) -> None:
            svc.start()

        async def on_cleanup(app: web.Application) -> None:
            await asyncio.to_thread(svc.close)

        app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/score", score)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/engines", list_engines)
        app.router.add_post("/engines", add_engine)
        app.router.add_delete("/engines/{name}", delete_engine)
        app.router.add_post("/feedback", feedback)
        app.router.add_post("/speculate", speculate)
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


def stats_next(eng: Any) -> int | None:
    """The batch number an engine's stream expects next (None: nothing received yet)."""
    return None if eng is None else eng.stream.expected


class _StreamCollector:
    """Per-engine stream counters and the index's size, read at scrape time."""

    def __init__(self, svc: IndexService) -> None:
        self.svc = svc

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        svc = self.svc
        engines = dict(svc.subscriber.engines)
        per_stream = {
            "applied": ("kvblock_index_batches_applied", "Event batches applied to the index."),
            "gaps": ("kvblock_index_gaps", "Gaps in an engine's batch numbers (filled from its replay buffer)."),
            "replayed": ("kvblock_index_batches_replayed", "Batches applied from the replay buffer."),
            "lost": ("kvblock_index_batches_lost", "Gaps the replay buffer no longer held (the engine was "
                     "cleared: an under-report until its blocks are stored again)."),
            "malformed": ("kvblock_index_batches_malformed", "Malformed batches refused (the engine was cleared)."),
            "restarts": ("kvblock_index_restarts", "Engine restarts seen (batch numbers went back)."),
            "resyncs": ("kvblock_index_resyncs", "Reconnects resynchronised."),
        }
        for key, (name, doc) in per_stream.items():
            fam = CounterMetricFamily(name, doc, labels=["engine"])
            for inst, eng in engines.items():
                fam.add_metric([inst], getattr(eng.stream.stats, key))
            yield fam
        fam = CounterMetricFamily("kvblock_index_replay_failures", "Replay requests that got no complete "
                                  "answer (the engine unreachable or not answering).", labels=["engine"])
        for inst, eng in engines.items():
            fam.add_metric([inst], eng.replay_failures)
        yield fam
        fam = GaugeMetricFamily("kvblock_index_engine_up", "1: the engine's event socket is connected and its "
                                "latest replay request was answered; 0: see /health's engines_down.",
                                labels=["engine"])
        for inst, eng in engines.items():
            fam.add_metric([inst], float(eng.state() == "ok"))
        yield fam
        fam = CounterMetricFamily("kvblock_index_malformed_frames", "ZMQ messages of the wrong shape dropped.",
                                  labels=["engine"])
        for inst, eng in engines.items():
            fam.add_metric([inst], eng.malformed_frames)
        yield fam
        fam = CounterMetricFamily("kvblock_index_events", "Block events applied, by kind (stored, removed, "
                                  "cleared, skipped: other block sizes or groups).", labels=["engine", "kind"])
        for inst, c in list(svc.sink.events.items()):
            for kind, v in zip(("stored", "removed", "cleared", "skipped"), c):
                fam.add_metric([inst, kind], v)
        yield fam
        fam = CounterMetricFamily("kvblock_index_instance_clears", "Times an engine's entries were dropped "
                                  "(first contact, lost batches, malformed batches, restarts, reconnects).",
                                  labels=["engine"])
        for inst, n in list(svc.sink.clears.items()):
            fam.add_metric([inst], n)
        yield fam
        yield GaugeMetricFamily("kvblock_index_engines", "Engines subscribed.", value=len(engines))
        yield GaugeMetricFamily("kvblock_index_pairs", "(block, engine) pairs held.", value=svc.pairs())
        yield GaugeMetricFamily("kvblock_index_memory_bytes", "Bytes of the in-process index (with Redis: "
                                "the writer's mirror).", value=svc.memory_bytes())
        if svc.config.redis is None:
            pairs, nodes, sweeps = svc.evicted()
            yield CounterMetricFamily("kvblock_index_evicted_pairs", "(block, engine) pairs the memory cap "
                                      "(--max-pairs) evicted: the index under-reports them until the engines "
                                      "store them again.", value=pairs)
            yield CounterMetricFamily("kvblock_index_evicted_blocks", "Blocks (with all their holders) the "
                                      "memory cap evicted.", value=nodes)
            yield CounterMetricFamily("kvblock_index_evictions", "Batches after which the memory cap evicted.",
                                      value=sweeps)
            if svc.config.max_pairs is not None:
                yield GaugeMetricFamily("kvblock_index_max_pairs", "The memory cap in (block, engine) pairs.",
                                        value=svc.config.max_pairs)
        if svc.tier_weights is not None:
            fam = GaugeMetricFamily("kvblock_index_tier_weight", "Each medium's weight in /score's \"weighted\" "
                                    "(--tier-weight).", labels=["medium"])
            for m, w in svc.tier_weights.items():
                fam.add_metric(["" if m is None else m], w)
            yield fam
        if svc.speculative:
            st = svc.index.stats
            fam = CounterMetricFamily("kvblock_index_speculative_blocks", "Speculative entries (blocks) by "
                                      "outcome: added, then confirmed (stored by the engine), dropped (removed "
                                      "or cleared first) or expired; refused: not added (cap).",
                                      labels=["outcome"])
            for outcome in ("added", "confirmed", "dropped", "expired", "refused"):
                fam.add_metric([outcome], getattr(st, outcome))
            yield fam
            yield GaugeMetricFamily("kvblock_index_speculative_live", "Speculative entries live.", value=st.live)
        yield CounterMetricFamily("kvblock_index_subscriber_errors", "Errors of the subscriber loop (logged).",
                                  value=svc.loop_errors)


# -- running it -----------------------------------------------------------------------------
class ServiceThread:
    """An :class:`IndexService` served on ``host:port`` from a daemon thread's event loop
    (tests, load tests, embedding). ``port=0``: a free port; :attr:`url` is the bound
    address once :meth:`start` returns.

    Raises (from :meth:`start`):
        OSError: the address cannot be bound.
    """

    def __init__(self, service: IndexService, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    def start(self) -> str:
        web = _web()
        started: concurrent.futures.Future[str] = concurrent.futures.Future()
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def up() -> str:
            runner = web.AppRunner(self.service.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self._runner = runner
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                started.set_result(loop.run_until_complete(up()))
            except BaseException as e:
                started.set_exception(e)
                return
            loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="kvblock-index-http")
        self._thread.start()
        self.url = started.result(timeout=30)
        return self.url

    def close(self) -> None:
        """Stop serving, stop the subscriber, close the sockets."""
        loop = self._loop
        if loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        loop.close()
        self._loop = None

    def __enter__(self) -> "ServiceThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BindError(OSError):
    """The service's address cannot be bound (in use, not local, no permission)."""


#: The ``cluster`` extra's packages the service needs (checked together: a missing one is
#: named with every other missing one).
_SERVICE_NEEDS = ["aiohttp", "prometheus_client", "zmq"]


def _web() -> Any:
    """aiohttp's ``web``, or ModuleNotFoundError naming every missing package of the service."""
    require_all(_SERVICE_NEEDS, extra="cluster", what="kvblock index serve")
    from aiohttp import web

    return web


def serve(config: ServiceConfig, engines: Sequence[EngineSpec], host: str = "127.0.0.1", port: int = 8000,
          print_fn: Callable[..., None] | None = print) -> None:
    """Serve until interrupted: what ``kvblock index serve`` runs. The "serving" line is
    printed once the socket is bound. SIGTERM returns; SIGINT raises KeyboardInterrupt
    (after the cleanup), as everywhere in ``kvblock``.

    Raises:
        ValueError: a bad config or engine. BindError: the address cannot be bound.
        ModuleNotFoundError: a ``cluster`` extra's package is missing (the message says
        what to install). KeyboardInterrupt: SIGINT.
    """
    import signal

    web = _web()
    svc = IndexService(config, engines)
    # Redis is checked now: an unreachable one is logged (one warning line) and named in the
    # serving line; the service serves anyway (it keeps the index in memory and writes it
    # when Redis answers), with /health 503 until then, so a readiness probe holds traffic.
    reachable = config.redis is None or svc.available()

    async def run() -> None:
        runner = web.AppRunner(svc.app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            try:
                site = web.TCPSite(runner, host, port)
                await site.start()
            except OSError as e:
                raise BindError(e.errno, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
            bound = runner.addresses[0][:2] if runner.addresses else (host, port)
            if print_fn is not None:
                print_fn(f"kvblock index serve: serving on http://{bound[0]}:{bound[1]}: model "
                         f"{config.model or '(any)'}, block size {config.block_size}, {config.hash_algo}, index "
                         f"{'in process' if not config.redis else 'redis ' + config.redis + ('' if reachable else ' (not answering: /health 503 until it does)')}, "
                         f"{len(svc.engines)} engine(s)", flush=True)
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(run())
