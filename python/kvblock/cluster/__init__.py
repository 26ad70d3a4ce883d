"""Past one machine: an exact prefix index across engine instances, fed by vLLM's KV events.

* :class:`PrefixIndex` — the in-process index (Rust): block hash -> holding instances per
  medium, with parent links; ``match(block_hashes)`` gives each instance's longest cached
  prefix;
* :class:`DictIndex` — the same semantics in plain Python dicts of sets (reference and
  benchmark baseline);
* :class:`RedisPrefixIndex` — the index in Redis or Redis Cluster, shared by router replicas
  (needs ``redis``: ``pip install redis``);
* :class:`KVEventSubscriber` / :class:`KVEventPublisher` — vLLM 0.33.0's ZMQ event stream
  (PUB + replay ROUTER), both ends (need ``pyzmq``);
* :class:`EventStream` — sequence numbers, gaps, replays and restarts of one engine's stream;
* :class:`Router` — round-robin, least-loaded and cache-aware routing over the index;
* :class:`SpeculativeIndex` — an index plus speculative entries (blocks just routed to an
  engine) that the engine's events confirm or drop, or a TTL expires;
* ``kvblock.cluster.service`` — ``kvblock index serve``, the index as an HTTP service (needs
  ``aiohttp`` and ``prometheus-client``).

``import kvblock`` imports none of this; ``kvblock.cluster`` imports zmq and redis only when
the classes that need them are used.
"""

from __future__ import annotations

from .index import PrefixIndex, parent_tag
from .dict_index import DictIndex
from .router import POLICIES, Decision, Router
from .speculative import SpeculationStats, SpeculativeIndex
from .stream import EventStream, StreamStats

__all__ = [
    "DictIndex",
    "Decision",
    "EventStream",
    "KVEventPublisher",
    "KVEventSubscriber",
    "POLICIES",
    "PrefixIndex",
    "RedisPrefixIndex",
    "Router",
    "SpeculationStats",
    "SpeculativeIndex",
    "StreamStats",
    "parent_tag",
]


def __getattr__(name: str):
    # zmq / redis are imported only when their classes are asked for
    if name == "KVEventSubscriber":
        from .subscriber import KVEventSubscriber

        return KVEventSubscriber
    if name == "KVEventPublisher":
        from .publisher import KVEventPublisher

        return KVEventPublisher
    if name == "RedisPrefixIndex":
        from .redis_index import RedisPrefixIndex

        return RedisPrefixIndex
    raise AttributeError(f"module 'kvblock.cluster' has no attribute {name!r}")
