"""Helpers of the kvblock.cluster tests: free ports, polling until a condition holds, event
streams of real KV cache managers."""

from __future__ import annotations

import socket
import time
from typing import Callable

import numpy as np


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A port ``p`` such that ``p`` and its Redis Cluster bus port ``p + 10000`` are free."""
    import random

    for _ in range(200):
        p = random.randint(20000, 50000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def poll_until(sub, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll the subscriber until ``cond()`` holds (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sub.poll(20)
        if cond():
            return
    raise AssertionError("condition not reached in time")


def rebind(make: Callable, timeout_s: float = 5.0):
    """``make()`` once the ports a just-closed socket held are free again (ZMQ closes
    sockets in its I/O thread, so a restart on the same port may briefly find it in use)."""
    import zmq

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make()
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def chain(seed: int, n: int, shared: int = 0, shared_seed: int = 7) -> list[int]:
    """``n`` 64-bit block hashes: the first ``shared`` common to every seed."""
    rng_s = np.random.default_rng(shared_seed)
    head = rng_s.integers(1, 2**63, size=shared, dtype=np.int64).tolist()
    rng = np.random.default_rng(seed + 1000)
    return head + rng.integers(1, 2**63, size=n - shared, dtype=np.int64).tolist()


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text exposition parsed by prometheus_client: ``{"name{l=v,...}": value}``
    (labels sorted by name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
