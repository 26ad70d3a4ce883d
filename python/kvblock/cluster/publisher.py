""":class:`KVEventPublisher`: KV events of an engine built on kvblock, on vLLM's ZMQ wire.

The wire format and replay protocol are vLLM 0.33.0's ``ZmqEventPublisher``'s:

* PUB socket, one multipart message per batch: ``(topic, seq, payload)``, ``seq`` the batch
  number as 8 bytes big-endian (0, 1, 2, ...), ``payload`` the msgpack ``KVEventBatch``
  ``[ts, events, data_parallel_rank]``;
* ROUTER replay socket: a request ``(identity, b"", start_seq)`` is answered with every
  buffered batch from ``start_seq`` on as ``(identity, b"", topic, seq, payload)``, then
  ``(identity, b"", b"", -1 as 8 signed bytes, b"")``; the last ``buffer_steps`` batches
  are kept.

Unlike vLLM's, :meth:`KVEventPublisher.publish` sends from the caller's thread (an engine
publishes once per step; no queue); a daemon thread serves replays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Sequence

from .._optional import require
from ..events import KVCacheEvent, KVEventBatch, encode_batch

__all__ = ["END_SEQ", "KVEventPublisher"]

log = logging.getLogger("kvblock.cluster")

#: The replay end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bindable(endpoint: str) -> str:
    """``tcp://host:0`` -> ``tcp://host:*`` (ZMQ's ephemeral port)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + "*"
    return endpoint


class KVEventPublisher:
    """Publishes ``KVCacheManager.take_events()`` batches in vLLM's wire format.

    Args:
        endpoint: PUB address to bind (``tcp://127.0.0.1:5557``, ``tcp://*:0`` for an
            ephemeral port, ``ipc://...``, ``inproc://...``); ``connect=True`` connects instead.
        replay_endpoint: ROUTER address to bind for replays (None: no replay).
        buffer_steps: batches kept for replay.
        hwm: PUB high-water mark (messages).
        topic: topic frame of every message.
        data_parallel_rank: stamped on batches that carry none.
        context: a ``zmq.Context`` (default: the process's shared instance).

    Attributes:
        endpoint, replay_endpoint: the bound addresses (ephemeral ports resolved).

    Raises:
        zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None, *,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0, connect: bool = False, context: Any = None) -> None:
        zmq = require("zmq", package="pyzmq", extra="cluster", what="kvblock.cluster.KVEventPublisher")

        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if connect:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        else:
            self._pub.bind(_bindable(endpoint))
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        self._running = True
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(_bindable(replay_endpoint))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replays, daemon=True, name="kvblock-replay")
            self._thread.start()

    @property
    def next_seq(self) -> int:
        """The number the next batch will carry."""
        return self._seq

    def publish(self, events: Sequence[KVCacheEvent] | KVEventBatch, ts: float | None = None) -> int:
        """Send one batch (a list of events, or a ``KVEventBatch``); returns its number.

        Raises:
            RuntimeError: the publisher is closed.
        """
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if isinstance(events, KVEventBatch):
            payload = encode_batch(events.events, ts=events.ts,
                                   data_parallel_rank=self._rank if events.data_parallel_rank is None
                                   else events.data_parallel_rank)
        else:
            payload = encode_batch(list(events), ts=time.time() if ts is None else ts, data_parallel_rank=self._rank)
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        """Send already-encoded ``KVEventBatch`` bytes; returns the batch number."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    def publish_from(self, manager: Any) -> int | None:
        """Publish ``manager.take_events()`` (a ``KVCacheManager`` or ``BlockPool`` with events
        on); None, and nothing sent, when there are none."""
        events = manager.take_events()
        return self.publish(events) if events else None

    def _serve_replays(self) -> None:
        zmq = self._zmq
        sock = self._replay
        assert sock is not None
        while self._running:
            try:
                if not sock.poll(50):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kvblock.cluster: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start_seq]
            try:
                for s, p in batches:
                    sock.send_multipart((ident, b"", self._topic, s.to_bytes(8, "big"), p))
                sock.send_multipart((ident, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as e:
                log.warning("kvblock.cluster: replay to a subscriber failed: %s", e)

    def close(self) -> None:
        """Stop the replay thread and close the sockets (idempotent)."""
        if not self._running:
            return
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    shutdown = close

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
