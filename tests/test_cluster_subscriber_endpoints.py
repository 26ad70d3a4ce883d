"""``KVEventSubscriber``'s engines as a new user configures them (real ZMQ sockets on
loopback): a malformed endpoint is refused where it is given and leaves no socket behind, an
engine whose replay endpoint never answers costs only its own replays, and engines come and
go while the subscriber's thread polls."""

from __future__ import annotations

import logging
import os
import time

import pytest

from cluster_helpers import free_port, poll_until
from conftest import require_module

zmq = require_module("zmq")

from kvblock import KVCacheManager, Request, hashing  # noqa: E402
from kvblock.cluster import KVEventPublisher, KVEventSubscriber, PrefixIndex  # noqa: E402

PROMPT = list(range(1000, 1100))  # 6 full blocks of 16


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_settle_to(limit: int, timeout_s: float = 10.0) -> int:
    """The open descriptors once at most ``limit`` (ZMQ closes sockets in its I/O thread,
    so a closed socket's descriptors go a little later), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while open_fds() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_fds()


def publish_prompt(pub: KVEventPublisher) -> list[bytes]:
    """A real manager caches ``PROMPT``; its events go out on ``pub``. Returns the hashes."""
    m = KVCacheManager(256, 16, enable_kv_cache_events=True)
    r = Request("r", PROMPT, block_hasher=m.request_block_hasher)
    blocks, n, _ = m.get_computed_blocks(r)
    m.allocate_slots(r, r.num_tokens - n, n, blocks)
    assert pub.publish_from(m) is not None  # the batch number
    return hashing.hash_blocks(PROMPT, 16)


@pytest.mark.parametrize("endpoint, replay", [
    ("garbage", None),
    ("tcp://127.0.0.1:{p}", "tcp:/127.0.0.1:{q}"),  # one slash short: refused at once
    ("tcp://127.0.0.1:{p}", "nope://x"),
])
def test_a_malformed_endpoint_is_refused_and_leaves_nothing(endpoint, replay):
    p, q = free_port(), free_port()
    endpoint = endpoint.format(p=p)
    replay = replay and replay.format(q=q)
    with KVEventSubscriber(PrefixIndex(16), idle_sync_s=None) as sub:
        sub.add_engine("ok", f"tcp://127.0.0.1:{free_port()}")
        before = open_fds()
        for _ in range(40):
            with pytest.raises(zmq.ZMQError):
                sub.add_engine("bad", endpoint, replay)
        assert list(sub.engines) == ["ok"]
        assert sub.poll(0) == 0  # the poller holds no closed socket
        assert fds_settle_to(before) <= before  # nothing made for a refused engine stays open


def test_a_replay_endpoint_nobody_answers_costs_only_its_own_replays():
    """Two engines, one of them with a well-formed replay endpoint where nothing listens:
    the good engine's events reach the index while the other's idle catch-ups time out and
    are counted (they used to be able to block the poll loop for good)."""
    port, rport = free_port(), free_port()
    index = PrefixIndex(block_size=16)
    with KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}") as pub, \
            KVEventSubscriber(index, replay_timeout_s=0.1, idle_sync_s=0.05) as sub:
        sub.add_engine("good", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        sub.add_engine("silent", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        sub.engines["silent"].ever_connected = True  # as if it had connected once: catch-ups run
        poll_until(sub, lambda: sub.engines["good"].ever_connected)
        hashes = publish_prompt(pub)
        poll_until(sub, lambda: index.match(hashes) == {"good": 6})
        poll_until(sub, lambda: sub.engines["silent"].replay_failures >= 2)
        assert sub.engines["good"].replay_failures == 0


def test_engines_come_and_go_while_the_thread_polls(caplog):
    with KVEventSubscriber(PrefixIndex(16), idle_sync_s=None) as sub:
        sub.start(interval_ms=1)
        before = open_fds()
        with caplog.at_level(logging.ERROR, logger="kvblock.cluster"):
            for k in range(300):
                sub.add_engine(f"e{k % 3}", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
                if k % 3 == 2:
                    for i in range(3):
                        sub.remove_engine(f"e{i}")
        sub.stop()
        assert not sub.engines
        assert not [r for r in caplog.records if "subscriber loop error" in r.getMessage()]
        assert fds_settle_to(before) <= before
