""":class:`RedisPrefixIndex`: the fleet prefix index in Redis or Redis Cluster.

The same answers as the in-process :class:`~kvblock.cluster.PrefixIndex` (the same
semantics and the same 32-bit parent tags), shared by every router replica that reads it.

Key layout (``ns`` the namespace, e.g. one per model; ``inst`` an instance name)::

    kvb:{ns:inst}:meta      HASH  seq (last batch applied), media (names, newline-separated)
    kvb:{ns:inst}:b:<mid>   HASH  8-byte block hash -> 4-byte parent tag (medium number mid)
    kvb:{ns}:instances      ZSET  instance -> last time heard from (ms)

An instance's keys share one hash tag, so on Redis Cluster they live in one slot and an
event batch is one server-side script call (one round trip, atomic); instances spread over
the cluster's nodes. A lookup is one script call for every instance on one node, and one
pipeline of one script call per instance on a cluster (one round trip to each node, sent
together).

Expiry: every batch and :meth:`RedisPrefixIndex.touch` refreshes the instance's keys' TTL
(``ttl_s``): a dead instance's entries go away by themselves, and lookups skip instances
not heard from within the TTL.

Faults: the writer keeps an in-process mirror (a :class:`PrefixIndex`) of the instances it
writes. When Redis is unreachable the batch is applied to the mirror only and the instance
marked dirty; when Redis answers again (or has lost the instance's keys: a restart, a flush,
an expiry) the instance is rewritten from the mirror in one transaction. Lookups raise
:class:`~kvblock.cluster.errors.IndexUnavailable` while Redis is unreachable (the router then
routes by load). The writer assumes it is the only one writing its instances (one indexer per
engine stream); any number of readers may share the index.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

from .._optional import require
from .errors import IndexUnavailable
from .index import PrefixIndex

__all__ = ["MAX_MEDIA", "RedisPrefixIndex"]

log = logging.getLogger("kvblock.cluster")

#: Media per instance (GPU, CPU, STORAGE... ; the lookup script declares this many keys).
MAX_MEDIA = 8

_APPLY = r"""
-- KEYS[1] meta, KEYS[2..] block hashes of media 0..n-1
-- ARGV: ttl_ms, seq, expect_meta, media, then (op, mid, data) triples
local meta = KEYS[1]
if ARGV[3] == '1' and redis.call('EXISTS', meta) == 0 then return -2 end
local seq = tonumber(ARGV[2])
if seq >= 0 then
  local last = redis.call('HGET', meta, 'seq')
  if last and tonumber(last) >= seq then return -1 end
end
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  local key = KEYS[2 + tonumber(ARGV[i + 1])]
  local data = ARGV[i + 2]
  if op == 'S' then
    local args = {}
    for p = 1, #data, 12 do
      args[#args + 1] = string.sub(data, p, p + 7)
      args[#args + 1] = string.sub(data, p + 8, p + 11)
      if #args >= 4000 then redis.call('HSET', key, unpack(args)); args = {} end
    end
    if #args > 0 then redis.call('HSET', key, unpack(args)) end
  elseif op == 'R' then
    local args = {}
    for p = 1, #data, 8 do
      args[#args + 1] = string.sub(data, p, p + 7)
      if #args >= 4000 then redis.call('HDEL', key, unpack(args)); args = {} end
    end
    if #args > 0 then redis.call('HDEL', key, unpack(args)) end
  elseif op == 'C' then
    for k = 2, #KEYS do redis.call('DEL', KEYS[k]) end
  end
  i = i + 3
end
redis.call('HSET', meta, 'seq', ARGV[2], 'media', ARGV[4])
local ttl = tonumber(ARGV[1])
if ttl > 0 then
  for k = 1, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
end
return 1
"""

_MATCH = r"""
-- KEYS[1] meta, KEYS[2..] block hashes of media 0..MAX_MEDIA-1
-- ARGV[1] '' (any medium) or '=' .. name; ARGV[2] (hash 8 bytes, parent tag 4 bytes)*
local media = redis.call('HGET', KEYS[1], 'media')
if not media then return 0 end
local keys = {}
local mid = 0
for name in string.gmatch(media .. '\n', '([^\n]*)\n') do
  if ARGV[1] == '' or ARGV[1] == '=' .. name then keys[#keys + 1] = KEYS[2 + mid] end
  mid = mid + 1
end
local q = ARGV[2]
local n = #q / 12
if n == 0 or #keys == 0 then return 0 end
local fields = {}
for i = 1, n do fields[i] = string.sub(q, (i - 1) * 12 + 1, (i - 1) * 12 + 8) end
local held = {}
for _, key in ipairs(keys) do
  local vals = redis.call('HMGET', key, unpack(fields))
  for i = 1, n do
    if vals[i] and vals[i] == string.sub(q, (i - 1) * 12 + 9, i * 12) then held[i] = true end
  end
end
local k = 0
while k < n and held[k + 1] do k = k + 1 end
return k
"""

_MATCH_MANY = r"""
-- one node (not a cluster): every instance in one call. KEYS: per instance its meta key then
-- its MAX_MEDIA block-hash keys; ARGV[1] medium filter, ARGV[2] query, ARGV[3] MAX_MEDIA
local per = 1 + tonumber(ARGV[3])
local q = ARGV[2]
local n = #q / 12
local fields, tags = {}, {}
for i = 1, n do
  fields[i] = string.sub(q, (i - 1) * 12 + 1, (i - 1) * 12 + 8)
  tags[i] = string.sub(q, (i - 1) * 12 + 9, i * 12)
end
local out = {}
for base = 0, #KEYS - per, per do
  local k = 0
  local media = redis.call('HGET', KEYS[base + 1], 'media')
  if media and n > 0 then
    local held = {}
    local mid = 0
    for name in string.gmatch(media .. '\n', '([^\n]*)\n') do
      if ARGV[1] == '' or ARGV[1] == '=' .. name then
        local vals = redis.call('HMGET', KEYS[base + 2 + mid], unpack(fields))
        for i = 1, n do
          if vals[i] and vals[i] == tags[i] then held[i] = true end
        end
      end
      mid = mid + 1
    end
    while k < n and held[k + 1] do k = k + 1 end
  end
  out[#out + 1] = k
end
return out
"""

_RESET = r"""
-- KEYS[1] meta, KEYS[2..] block hashes of media; ARGV: ttl_ms, seq, media
for k = 2, #KEYS do redis.call('DEL', KEYS[k]) end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'media', ARGV[3])
local ttl = tonumber(ARGV[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
"""


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What counts as "Redis unavailable": every redis-py error (connection, timeout,
    cluster down, a server refusing writes when out of memory, ...) and socket errors."""
    import redis.exceptions as rex

    # RedisClusterException (no node of a cluster reachable, or the node is not in cluster
    # mode) is not a RedisError
    return (rex.RedisError, rex.RedisClusterException, ConnectionError, TimeoutError, OSError)


def _medium_name(medium: str | None) -> str:
    return "" if medium is None else medium


class RedisPrefixIndex:
    """The prefix index kept in Redis (see the module docstring).

    Args:
        client: a ``redis.Redis`` / ``redis.RedisCluster``, or a URL: ``redis://host:port``
            (one node) or ``redis+cluster://host:port`` (a cluster, any node of it).
        namespace: the key namespace (one index per namespace; e.g. the model name).
        ttl_s: lifetime of an instance's keys after its last batch or :meth:`touch` (None:
            no expiry).
        block_size, group_idx: as :class:`PrefixIndex`.
        retry_interval_s: after a failure, Redis is tried again no sooner than this.
        timeout_s: socket timeouts of a client made from a URL.

    A client made from a URL connects at first use, a Redis Cluster one too (redis-py's
    connects when made): an unreachable node, or one not in cluster mode, is an outage like
    any other (writes go to the mirror, :meth:`match` raises
    :class:`~kvblock.cluster.errors.IndexUnavailable` naming the cause), never an error here.

    Raises:
        ValueError: a bad URL or namespace.
    """

    #: :class:`~kvblock.cluster.Router` passes its instances to :meth:`match`
    wants_instances = True

    def __init__(self, client: Any, namespace: str = "kvblock", *, ttl_s: float | None = 300.0,
                 block_size: int | None = None, group_idx: int = 0, retry_interval_s: float = 0.5,
                 timeout_s: float = 0.5) -> None:
        redis = require("redis", package="redis", extra="cluster", what="kvblock.cluster.RedisPrefixIndex")

        if not namespace or any(c in namespace for c in "{}\n"):
            raise ValueError(f"namespace must be non-empty without braces or newlines, got {namespace!r}")
        self._connect: Any = None
        if isinstance(client, str):
            self.is_cluster = client.startswith("redis+cluster://")
            self._connect = self._client_from_url(client, timeout_s)
            client = None if self.is_cluster else self._connect()
        else:
            self.is_cluster = isinstance(client, redis.RedisCluster)
        self._client = client
        self.namespace = namespace
        self.ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_interval_s = retry_interval_s
        self.mirror = PrefixIndex(block_size, group_idx)
        self._errors = _connection_errors()
        self._noscript = redis.exceptions.NoScriptError
        self._sha: dict[str, str] = {}
        self._src = {"apply": _APPLY, "match": _MATCH, "match_many": _MATCH_MANY, "reset": _RESET}
        self._media: dict[str, list[str]] = {}  # writer: instance -> medium names by mid
        self._written: set[str] = set()
        self._dirty: set[str] = set()
        self._down_since: float | None = None
        self._last_try = 0.0
        self._registry: list[str] = []
        self._registry_at = -1e9
        self.registry_refresh_s = 1.0
        self.resyncs = 0
        self.failures = 0

    @staticmethod
    def _client_from_url(url: str, timeout_s: float) -> Callable[[], Any]:
        """A function that makes the client of ``url`` (checked now: ValueError)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        if url.startswith("redis+cluster://"):
            hostport = url[len("redis+cluster://"):].rstrip("/")
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bad Redis Cluster URL {url!r}: expected redis+cluster://host:port")
            return lambda: redis.RedisCluster(host=host, port=int(port), **kw)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"bad Redis URL {url!r}: expected redis://host:port or redis+cluster://host:port")
        client = redis.Redis.from_url(url, **kw)  # connects at first use
        return lambda: client

    @property
    def client(self) -> Any:
        """The redis-py client (one made from a URL is made at its first use: a failure is
        an outage, raised as redis-py raised it to the caller that handles outages)."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    # -- keys ---------------------------------------------------------------------------------
    def _tag(self, instance: str) -> str:
        if any(c in instance for c in "{}\n"):
            raise ValueError(f"instance names cannot hold braces or newlines: {instance!r}")
        return f"kvb:{{{self.namespace}:{instance}}}"

    def _keys(self, instance: str, n_media: int) -> list[str]:
        t = self._tag(instance)
        return [f"{t}:meta"] + [f"{t}:b:{m}" for m in range(n_media)]

    @property
    def registry_key(self) -> str:
        """The Redis key of the instance registry (``kvb:{namespace}:instances``, a hash tag so
        a cluster keeps the namespace's keys in one slot).
        """
        return f"kvb:{{{self.namespace}}}:instances"

    # -- script calls -------------------------------------------------------------------------
    def _load(self, name: str) -> str:
        sha = self.client.script_load(self._src[name])
        self._sha[name] = sha
        return sha

    def _evalsha(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any]) -> None:
        import hashlib

        sha = self._sha.get(name) or hashlib.sha1(self._src[name].encode()).hexdigest()
        self._sha[name] = sha
        pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    def _execute(self, build: Any) -> list[Any]:
        """Run a pipeline built by ``build(pipe)``; load the scripts and retry once if Redis
        lost them (a restart)."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            res = pipe.execute(raise_on_error=False)
            if any(isinstance(r, self._noscript) for r in res) and attempt == 0:
                for name in self._src:
                    self._load(name)
                continue
            for r in res:
                if isinstance(r, self._errors):
                    raise r
                if isinstance(r, Exception):
                    raise r
            return res
        return res

    # -- availability -------------------------------------------------------------------------
    def _failed(self, e: BaseException, instances: Iterable[str] = ()) -> None:
        self.failures += 1
        # Redis may have lost everything (a restart): every instance written gets rewritten
        self._dirty.update(instances)
        self._dirty.update(self._written)
        self._last_try = time.monotonic()
        if self._down_since is None:
            self._down_since = self._last_try
            log.warning("kvblock.cluster: Redis is unavailable (%s: %s); the index is kept in memory and "
                        "rewritten when Redis is back", type(e).__name__, e)

    def _may_try(self) -> bool:
        return self._down_since is None or time.monotonic() - self._last_try >= self.retry_interval_s

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.warning("kvblock.cluster: Redis is available again after %.1f s",
                        time.monotonic() - self._down_since)
            self._down_since = None

    @property
    def available(self) -> bool:
        """False since a Redis call failed, until one succeeds."""
        return self._down_since is None

    def ping(self) -> bool:
        """Ask Redis now (``PING``, with the client's short timeouts): whether it answered.
        The answer updates :attr:`available` (an outage is logged once, as any failed call);
        instances written before an outage are still rewritten by the next call that
        writes or matches."""
        try:
            self.client.ping()
        except self._errors as e:
            self._failed(e)
            return False
        self._recovered()
        return True

    # -- writer -------------------------------------------------------------------------------
    def add_instance(self, instance: str) -> None:
        """Register ``instance`` in Redis and in the local mirror. Raises
        :class:`~kvblock.cluster.IndexUnavailable` when Redis cannot be reached.
        """
        self._tag(instance)
        self.mirror.add_instance(instance)

    def _mids(self, instance: str, ops: list[tuple[str, Any, bytes]]) -> list[str]:
        media = self._media.setdefault(instance, [])
        for op, medium, _ in ops:
            if op in ("S", "R"):
                name = _medium_name(medium)
                if name not in media:
                    if len(media) >= MAX_MEDIA:
                        raise ValueError(f"instance {instance!r}: more than {MAX_MEDIA} media")
                    if "\n" in name:
                        raise ValueError("medium names cannot hold newlines")
                    media.append(name)
        return media

    def apply(self, instance: str, payload: bytes, now_ms: int = 0, seq: int = -1) -> tuple[int, int, int, int]:
        """Apply one ``KVEventBatch`` payload for ``instance`` (the mirror's counts are
        returned). Never raises for Redis faults (the instance is rewritten later).

        Args:
            now_ms: the time for the mirror's ``expire``.
            seq: the batch number; Redis skips a batch at or below the last one it applied
                for the instance (a re-sent batch). -1: no check.

        Raises:
            ValueError: a malformed payload (nothing changes), more than ``MAX_MEDIA`` media.
        """
        tag = self._tag(instance)
        ops = self.mirror.wire_ops(payload)  # validates before anything changes
        media_before = list(self._media.get(instance, []))
        media = self._mids(instance, ops)
        try:
            stats = self.mirror.apply(instance, payload, now_ms)
        except Exception:
            self._media[instance] = media_before
            raise
        if not self._may_try():
            self._dirty.add(instance)
            return stats
        try:
            if instance in self._dirty:
                self._rewrite(instance)
            else:
                self._write_ops(instance, tag, ops, media, seq)
            self._recovered()
        except self._errors as e:
            self._failed(e, [instance])
        return stats

    def _write_ops(self, instance: str, tag: str, ops: list, media: list[str], seq: int) -> None:
        keys = self._keys(instance, len(media))
        args: list[Any] = [self.ttl_ms, seq, "1" if instance in self._written else "0", "\n".join(media)]
        for op, medium, data in ops:
            mid = media.index(_medium_name(medium)) if op != "C" else 0
            args += [op, mid, data]
        now = int(time.time() * 1000)

        def build(pipe: Any) -> None:
            self._evalsha(pipe, "apply", keys, args)
            pipe.zadd(self.registry_key, {instance: now})

        res = self._execute(build)
        if res[0] == -2:  # Redis lost the instance (restart, flush, expiry): rewrite it
            self._rewrite(instance)
        else:
            self._written.add(instance)
        if instance not in self._registry:
            self._registry_at = -1e9  # this index registered it: its next match() asks it

    def _rewrite(self, instance: str) -> None:
        """Replace the instance's keys with the mirror's state, in one transaction."""
        media = self._media.get(instance, [])
        keys = self._keys(instance, len(media))
        fields: list[tuple[str, list[tuple[int, int]]]] = []
        for name in media:
            medium = None if name == "" else name
            fields.append((name, self.mirror.blocks_of(instance, medium)))
        pipe = self.client.pipeline(transaction=True)
        pipe.execute_command("EVAL", _RESET, len(keys), *keys, self.ttl_ms, -1, "\n".join(media))
        for mid, (_, blocks) in enumerate(fields):
            key = keys[1 + mid]
            for i in range(0, len(blocks), 4000):
                mapping = {h.to_bytes(8, "big"): t.to_bytes(4, "big") for h, t in blocks[i:i + 4000]}
                pipe.hset(key, mapping=mapping)
            if self.ttl_ms:
                pipe.pexpire(key, self.ttl_ms)
        pipe.execute()
        self.client.zadd(self.registry_key, {instance: int(time.time() * 1000)})
        self._dirty.discard(instance)
        self._written.add(instance)
        self.resyncs += 1

    def resync(self) -> int:
        """Rewrite every dirty instance from the mirror now; returns how many were rewritten
        (0 while Redis is still unavailable)."""
        done = 0
        for instance in sorted(self._dirty):
            try:
                self._rewrite(instance)
                self._recovered()
                done += 1
            except self._errors as e:
                self._failed(e, [instance])
                break
        return done

    def clear_instance(self, instance: str) -> int:
        """Drop the instance's blocks (kept registered). Returns the pairs dropped."""
        self.add_instance(instance)
        removed = self.mirror.clear_instance(instance)
        if not self._may_try():
            self._dirty.add(instance)
            return removed
        try:
            self._rewrite(instance)
            self._recovered()
        except self._errors as e:
            self._failed(e, [instance])
        return removed

    def remove_instance(self, instance: str) -> int:
        """Forget the instance (its keys and registry entry). KeyError if unknown."""
        removed = self.mirror.remove_instance(instance)
        media = self._media.pop(instance, [])
        self._dirty.discard(instance)
        self._written.discard(instance)
        self._registry_at = -1e9
        try:
            self.client.delete(*self._keys(instance, max(len(media), MAX_MEDIA)))
            self.client.zrem(self.registry_key, instance)
        except self._errors as e:
            self._failed(e)
        return removed

    def touch(self, instance: str, now_ms: int | None = None) -> None:
        """The instance is alive: refresh its TTL (one script-free pipeline)."""
        media = self._media.get(instance, [])
        now = int(time.time() * 1000) if now_ms is None else now_ms
        self.mirror.touch(instance, now)
        if not self._may_try():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            if self.ttl_ms:
                for k in self._keys(instance, len(media)):
                    pipe.pexpire(k, self.ttl_ms)
            pipe.execute()
            self.client.zadd(self.registry_key, {instance: now})
            self._recovered()
        except self._errors as e:
            self._failed(e, [instance])

    def expire(self, now_ms: int | None = None) -> list[str]:
        """Drop registry entries not refreshed within the TTL; returns their names."""
        if not self.ttl_ms:
            return []
        now = int(time.time() * 1000) if now_ms is None else now_ms
        try:
            dead = [m.decode() if isinstance(m, bytes) else m
                    for m in self.client.zrangebyscore(self.registry_key, "-inf", now - self.ttl_ms)]
            if dead:
                self.client.zrem(self.registry_key, *dead)
            return dead
        except self._errors as e:
            self._failed(e)
            return []

    # -- reader -------------------------------------------------------------------------------
    def instances(self, refresh: bool = False) -> list[str]:
        """Instances heard from within the TTL (cached for ``registry_refresh_s``, 1 s by
        default; ``refresh=True`` reads Redis now; this object's own writes of a new
        instance and removals refresh it).

        Raises:
            IndexUnavailable: Redis cannot be reached.
        """
        now = time.monotonic()
        if refresh or now - self._registry_at >= self.registry_refresh_s:
            lo = "-inf" if not self.ttl_ms else int(time.time() * 1000) - self.ttl_ms
            try:
                names = self.client.zrangebyscore(self.registry_key, lo, "+inf")
            except self._errors as e:
                self._failed(e)
                raise IndexUnavailable(f"Redis: {type(e).__name__}: {e}") from None
            self._registry = sorted(m.decode() if isinstance(m, bytes) else m for m in names)
            self._registry_at = now
        return list(self._registry)

    def match(self, block_hashes: Any, medium: str | None = None,
              instances: Iterable[str] | None = None) -> dict[str, int]:
        """Longest cached prefix (blocks) of the chain per instance with a hit, from Redis in
        one round trip (one script call on one node; one per instance, pipelined, on a
        cluster).

        Args:
            instances: the instances to ask. Default: the registry's live ones as last read,
                at most ``registry_refresh_s`` (1 s) ago; an instance this index object wrote
                or removed since is seen at once, one another process registered may be
                missed (an under-report) for up to that long. The router passes its own list.

        Raises:
            IndexUnavailable: Redis cannot be reached.
            ValueError / TypeError: malformed block hashes.
        """
        q = self.mirror.query_bytes(block_hashes)
        if not q:
            return {}
        if self._dirty and self._may_try():
            self.resync()
            self._registry_at = -1e9
        names = self.instances() if instances is None else list(instances)
        if not names:
            return {}
        flt = "" if medium is None else "=" + medium

        def build(pipe: Any) -> None:
            if self.is_cluster:  # one slot per instance: one call each, sent together
                for name in names:
                    self._evalsha(pipe, "match", self._keys(name, MAX_MEDIA), (flt, q))
            else:
                keys = [k for name in names for k in self._keys(name, MAX_MEDIA)]
                self._evalsha(pipe, "match_many", keys, (flt, q, MAX_MEDIA))

        if not self._may_try():
            raise IndexUnavailable("Redis is unavailable (retrying shortly)")
        try:
            res = self._execute(build)
        except self._errors as e:
            self._failed(e)
            raise IndexUnavailable(f"Redis: {type(e).__name__}: {e}") from None
        self._recovered()
        counts = res if self.is_cluster else res[0]
        return {name: int(n) for name, n in zip(names, counts) if int(n) > 0}

    # -- size ---------------------------------------------------------------------------------
    def memory_bytes(self, instance: str) -> int:
        """Redis's ``MEMORY USAGE`` of the instance's keys (bytes)."""
        media = self._media.get(instance, [])
        total = 0
        for k in self._keys(instance, len(media)):
            total += self.client.memory_usage(k, samples=0) or 0
        return total

    def num_pairs(self) -> int:
        """(block, holder) pairs of the instances this writer wrote (from the mirror)."""
        return self.mirror.num_pairs()

    def close(self) -> None:
        """Close the Redis client this index opened (a no-op if none is open)."""
        if self._client is not None:
            self._client.close()
