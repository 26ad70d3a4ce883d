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


def poll_until(sub, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll the subscriber until ``cond()`` holds (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sub.poll(20)
        if cond():
            return
    raise AssertionError("condition not reached in time")


def chain(seed: int, n: int, shared: int = 0, shared_seed: int = 7) -> list[int]:
    """``n`` 64-bit block hashes: the first ``shared`` common to every seed."""
    rng_s = np.random.default_rng(shared_seed)
    head = rng_s.integers(1, 2**63, size=shared, dtype=np.int64).tolist()
    rng = np.random.default_rng(seed + 1000)
    return head + rng.integers(1, 2**63, size=n - shared, dtype=np.int64).tolist()
