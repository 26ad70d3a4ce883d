""":class:`KVEventSubscriber`: vLLM 0.33.0 KV event streams (ZMQ) into a prefix index.

One SUB socket per engine (each publisher numbers its own batches), one DEALER socket per
engine for replays (vLLM's ROUTER replay protocol: send ``(b"", start_seq)``, receive
``(b"", topic, seq, payload)`` frames until the ``-1`` end marker), and a socket monitor per
SUB socket: a reconnect (the engine went away and came back, or the network dropped) may
hide lost batches or a restarted publisher, so the stream resynchronises (see
:class:`~kvblock.cluster.stream.EventStream`). Payloads go to the index as raw msgpack bytes
(the Rust index decodes them itself).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._optional import require
from .publisher import END_SEQ
from .stream import EventSink, EventStream

__all__ = ["KVEventSubscriber"]

log = logging.getLogger("kvblock.cluster")


@dataclass
class _Engine:
    instance: str
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sub: Any
    monitor: Any
    stream: EventStream
    dealer: Any = None
    disconnected: bool = False
    last_sync: float = 0.0
    malformed_frames: int = 0
    ever_connected: bool = False
    replay_failures: int = 0  # replay requests unanswered, in all
    replay_streak: int = 0  # ... since the last answered one

    def state(self) -> str:
        """``ok``; ``never_connected`` (the event socket never connected); ``disconnected``
        (it connected, then lost the connection); ``not_answering`` (connected, but the
        latest replay request got no complete answer)."""
        if not self.ever_connected:
            return "never_connected"
        if self.disconnected:
            return "disconnected"
        return "not_answering" if self.replay_streak else "ok"


def unreachable_cause(endpoint: str, timeout_s: float) -> str:
    """Why ``endpoint`` did not answer, as far as can be told here: a host name that does
    not resolve, or nothing answering at the address."""
    import socket

    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        host = host.strip("[]")
        if host and host != "*":
            try:
                socket.getaddrinfo(host, int(port) if port.isdigit() else None)
            except (socket.gaierror, UnicodeError) as e:
                return f"host {host!r} does not resolve ({e.strerror if isinstance(e, OSError) else e})"
            except OSError:
                pass
    return f"nothing answered at {endpoint} within {timeout_s:g} s"


class KVEventSubscriber:
    """Subscribes to the KV events of several engines and feeds ``sink``.

    Args:
        sink: the index (``PrefixIndex``, ``DictIndex``, ``RedisPrefixIndex``).
        replay_timeout_s: how long a replay may take before it counts as unanswered.
        idle_sync_s: an engine silent this long is asked for the batches after the last one
            applied (:meth:`EventStream.catch_up`): a late joiner learns what the publisher
            buffered, and batches lost at the end of a burst come back (engines with a
            replay endpoint only; None: never).
        context: a ``zmq.Context`` (default: the process's shared instance).

    Use :meth:`add_engine` per engine, then :meth:`poll` in a loop or :meth:`start` a thread.
    """

    def __init__(self, sink: EventSink, *, replay_timeout_s: float = 1.0, idle_sync_s: float | None = 1.0,
                 context: Any = None) -> None:
        zmq = require("zmq", package="pyzmq", extra="cluster", what="kvblock.cluster.KVEventSubscriber")

        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self.sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.idle_sync_s = idle_sync_s
        self.engines: dict[str, _Engine] = {}
        self._poller = zmq.Poller()
        self._by_socket: dict[Any, tuple[str, _Engine]] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        # held by poll() and by adding / removing an engine, so the thread started by start()
        # never polls a socket being closed; re-entrant for a sink that adds an engine
        self._lock = threading.RLock()

    # -- engines ------------------------------------------------------------------------------
    def add_engine(self, instance: str, endpoint: str, replay_endpoint: str | None = None, *,
                   topic: str = "", bind: bool = False) -> EventStream:
        """Subscribe to one engine's publisher (``bind=True`` when the publisher connects).

        Returns the engine's :class:`EventStream` (its ``stats`` count gaps, replays...).
        Both endpoints are checked here: the replay socket connects now, so a malformed
        ``replay_endpoint`` is refused at once rather than failing every later replay. Safe to
        call while :meth:`start`'s thread polls.

        Raises:
            ValueError: ``instance`` is already subscribed.
            zmq.ZMQError: ``endpoint`` or ``replay_endpoint`` is not a ZMQ endpoint (or cannot
                be bound). Nothing is subscribed and every socket made for it is closed.
        """
        zmq = self._zmq
        with self._lock:
            if instance in self.engines:
                raise ValueError(f"instance {instance!r} is already subscribed")
            made: list[Any] = []
            try:
                sub = self._ctx.socket(zmq.SUB)
                made.append(sub)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
                monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
                made.append(monitor)
                if bind:
                    sub.bind(endpoint)
                else:
                    sub.connect(endpoint)
                dealer = None if replay_endpoint is None else self._dealer(replay_endpoint, made)
            except BaseException:
                if len(made) > 1:
                    made[0].disable_monitor()
                for sock in reversed(made):
                    sock.close(linger=0)
                raise
            eng = _Engine(instance, endpoint, replay_endpoint, topic.encode("utf-8"), sub, monitor,
                          EventStream(instance, self.sink, None, lambda: int(time.time() * 1000)), dealer)
            if replay_endpoint is not None:
                eng.stream.replay = lambda start, e=eng: self._replay(e, start)
            self.engines[instance] = eng
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
            self._by_socket[sub] = ("sub", eng)
            self._by_socket[monitor] = ("monitor", eng)
            return eng.stream

    def remove_engine(self, instance: str) -> None:
        """Unsubscribe (the index keeps the instance; remove it there if it is gone). Safe to
        call while :meth:`start`'s thread polls.

        Raises:
            KeyError: ``instance`` is not subscribed.
        """
        with self._lock:
            eng = self.engines.pop(instance)
            for sock in (eng.sub, eng.monitor):
                self._poller.unregister(sock)
                self._by_socket.pop(sock, None)
            eng.sub.disable_monitor()
            eng.monitor.close(linger=0)
            eng.sub.close(linger=0)
            if eng.dealer is not None:
                eng.dealer.close(linger=0)

    def _dealer(self, replay_endpoint: str, made: list[Any]) -> Any:
        """A DEALER socket connected to ``replay_endpoint`` (appended to ``made`` before it
        connects, so the caller closes it when the connect fails). A send waits at most the
        replay timeout: a socket with no peer would otherwise block the poll loop."""
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        made.append(dealer)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDTIMEO, max(1, int(self.replay_timeout_s * 1000)))
        dealer.connect(replay_endpoint)
        return dealer

    # -- replay -------------------------------------------------------------------------------
    def _replay(self, eng: _Engine, start: int) -> list[tuple[int, bytes]] | None:
        zmq = self._zmq
        out: list[tuple[int, bytes]] = []
        try:
            if eng.dealer is None:
                made: list[Any] = []
                try:
                    eng.dealer = self._dealer(eng.replay_endpoint or "", made)
                except BaseException:
                    for sock in made:
                        sock.close(linger=0)
                    raise
            d = eng.dealer
            d.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not d.poll(int(left * 1000) + 1):
                    raise TimeoutError
                frames = d.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    eng.malformed_frames += 1
                    continue
                if frames[2] == END_SEQ:
                    if eng.replay_streak:
                        log.warning("kvblock.cluster: %s: its replay endpoint answers again (after %d failed)",
                                    eng.instance, eng.replay_streak)
                        eng.replay_streak = 0
                    return out
                out.append((int.from_bytes(frames[2], "big"), frames[3]))
        except (TimeoutError, zmq.ZMQError):
            # late answers would confuse the next replay: start over with a fresh socket. A
            # partial answer is no answer: the stream reads what the buffer lacks as a loss or
            # a restart, so it must see all of it.
            eng.replay_failures += 1
            eng.replay_streak += 1
            n = eng.replay_streak
            if n & (n - 1) == 0:  # logged at the 1st, 2nd, 4th, 8th ... failure in a row
                log.warning("kvblock.cluster: %s: replay from %d got no complete answer (%d batches): %s; %d "
                            "failed in a row (next logged at %d; kvblock_index_replay_failures counts all)",
                            eng.instance, start, len(out),
                            unreachable_cause(eng.replay_endpoint or "", self.replay_timeout_s), n, 2 * n)
            if eng.dealer is not None:
                eng.dealer.close(linger=0)
            eng.dealer = None
            return None

    # -- the loop -----------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0, max_messages: int = 10_000) -> int:
        """Handle the messages waiting (waiting up to ``timeout_ms`` for the first); returns
        how many batches were handled."""
        from zmq.utils.monitor import parse_monitor_message

        zmq = self._zmq
        handled = 0
        with self._lock:
            events = dict(self._poller.poll(timeout_ms))
            while events and handled < max_messages:
                for sock in list(events):
                    kind, eng = self._by_socket.get(sock, (None, None))
                    if eng is None:
                        continue
                    if kind == "monitor":
                        while sock.poll(0):
                            ev = parse_monitor_message(sock.recv_multipart())
                            if ev["event"] == zmq.EVENT_DISCONNECTED:
                                eng.disconnected = True
                            elif ev["event"] in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                                eng.ever_connected = True
                                if eng.disconnected:
                                    eng.disconnected = False
                                    log.warning("kvblock.cluster: %s: reconnected; resynchronising", eng.instance)
                                    eng.stream.resync()
                                eng.last_sync = 0.0  # catch up now
                        continue
                    while sock.poll(0) and handled < max_messages:
                        frames = sock.recv_multipart()
                        handled += 1
                        if len(frames) != 3 or len(frames[1]) != 8:
                            eng.malformed_frames += 1
                            continue
                        eng.stream.on_message(int.from_bytes(frames[1], "big"), frames[2])
                        eng.last_sync = time.monotonic()
                events = dict(self._poller.poll(0))
            if self.idle_sync_s is not None:
                now = time.monotonic()
                for eng in self.engines.values():
                    if eng.replay_endpoint is not None and not eng.disconnected and now - eng.last_sync >= self.idle_sync_s:
                        eng.last_sync = now
                        handled += eng.stream.catch_up()
        return handled

    def start(self, interval_ms: int = 50) -> None:
        """Poll in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._running = True

        def loop() -> None:
            while self._running:
                try:
                    self.poll(interval_ms)
                except Exception:  # keep the subscriber alive; the stream resyncs on the next gap
                    log.exception("kvblock.cluster: subscriber loop error")
                    time.sleep(interval_ms / 1000)

        self._thread = threading.Thread(target=loop, daemon=True, name="kvblock-subscriber")
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (if started)."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    def close(self) -> None:
        """Stop and close every socket."""
        self.stop()
        for name in list(self.engines):
            self.remove_engine(name)

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
