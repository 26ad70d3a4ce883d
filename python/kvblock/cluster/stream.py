"""One engine's KV event stream: sequence numbers, gaps, replays, restarts.

vLLM's ``ZmqEventPublisher`` numbers its batches 0, 1, 2, ... (an 8-byte big-endian frame)
and keeps the last ``buffer_steps`` of them for replay. :class:`EventStream` turns the
messages of one publisher into index updates that never make the index claim a block the
engine does not hold:

* the next batch in sequence is applied;
* a gap (a batch number skipped) is filled from the replay buffer; if the buffer no longer
  has the missing batches, the instance is cleared (its removals may be lost) and rebuilt
  from what the buffer and the live stream still give: an under-report until the blocks are
  stored again, never an over-report;
* a batch number that goes back (a new publisher: the engine restarted) clears the instance
  and starts over, replaying the new publisher's batches from 0;
* a malformed payload is a lost batch: the instance is cleared and the stream goes on;
* :meth:`EventStream.resync` (a reconnect) clears the instance and replays from 0.

The first message of a stream also clears the instance (what an index holds about it from
before is stale) and replays from 0, so a subscriber that joins late still learns the blocks
whose batches the publisher kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = ["EventSink", "EventStream", "ReplayFn", "StreamStats"]

log = logging.getLogger("kvblock.cluster")

#: ``replay(start_seq) -> [(seq, payload), ...]`` in order (None: no replay endpoint or it
#: did not answer).
ReplayFn = Callable[[int], "list[tuple[int, bytes]] | None"]


class EventSink(Protocol):
    """What a stream feeds: an index (``PrefixIndex``, ``DictIndex``, ``RedisPrefixIndex``)."""

    def apply(self, instance: str, payload: bytes, now_ms: int = 0) -> object: ...

    def clear_instance(self, instance: str) -> int: ...

    def add_instance(self, instance: str) -> object: ...


@dataclass
class StreamStats:
    """Counters of one stream."""

    applied: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    malformed: int = 0
    restarts: int = 0
    resyncs: int = 0


class EventStream:
    """The sequencing state machine of one publisher (see the module docstring).

    Args:
        instance: the instance name the index files this stream's blocks under.
        sink: the index.
        replay: fetches buffered batches from a sequence number on (None: no replay).
        clock_ms: ``() -> int``, the time passed to ``sink.apply`` (for ``expire``).
    """

    def __init__(self, instance: str, sink: EventSink, replay: ReplayFn | None = None,
                 clock_ms: Callable[[], int] | None = None) -> None:
        self.instance = instance
        self.sink = sink
        self.replay = replay
        self.clock_ms = clock_ms or (lambda: 0)
        self.expected: int | None = None
        self.stats = StreamStats()
        sink.add_instance(instance)

    # -- input --------------------------------------------------------------------------------
    def on_message(self, seq: int, payload: bytes) -> None:
        """A live batch ``seq`` with its msgpack ``payload``."""
        if self.expected is None:
            self._start(seq, payload)
        elif seq == self.expected:
            self._apply(seq, payload)
        elif seq > self.expected:
            self.stats.gaps += 1
            log.info("kvblock.cluster: %s: batches %d..%d missing, replaying", self.instance, self.expected, seq - 1)
            self._fill(self.expected, seq)
            self._apply(seq, payload)
        else:
            self.stats.restarts += 1
            log.warning("kvblock.cluster: %s: batch number went back from %d to %d (publisher restarted); "
                        "clearing and resynchronising", self.instance, self.expected - 1, seq)
            self._start(seq, payload)

    def catch_up(self) -> int:
        """Ask the replay buffer for batches from the next expected one (from 0 for a
        stream with nothing applied yet) and apply those in sequence: a late joiner learns
        what the publisher kept, and batches lost at the end of a burst (no later message
        shows the gap) are recovered. Returns the batches applied."""
        if self.replay is None:
            return 0
        fresh = self.expected is None
        start = 0 if fresh else self.expected
        got = self.replay(start)
        if not got:
            return 0
        batches = sorted((s, p) for s, p in got if s >= start)
        # the run that ends at the newest batch
        k = len(batches)
        while k > 1 and batches[k - 2][0] == batches[k - 1][0] - 1:
            k -= 1
        run = batches[k - 1:] if batches else []
        if not run:
            return 0
        if fresh:
            self._clear()
        elif run[0][0] != start:
            self.stats.lost += 1
            log.warning("kvblock.cluster: %s: batches from %d are no longer buffered; clearing the instance",
                        self.instance, start)
            self._clear()
        for s, p in run:
            self._apply(s, p)
            self.stats.replayed += 1
        return len(run)

    def resync(self) -> None:
        """Forget what is known (e.g. after a reconnect): clear the instance; the next
        message replays from 0."""
        self.stats.resyncs += 1
        self._clear()
        self.expected = None

    # -- steps --------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.sink.clear_instance(self.instance)

    def _start(self, seq: int, payload: bytes) -> None:
        self._clear()
        self.expected = 0
        if seq > 0:
            self._fill(0, seq, first=True)
        else:
            self.expected = seq
        self._apply(seq, payload)

    def _fill(self, start: int, end: int, first: bool = False) -> None:
        """Apply batches ``start .. end - 1`` from the replay buffer; clear the instance if
        some of them are gone (unless nothing was known: the first message)."""
        got = self.replay(start) if self.replay is not None else None
        batches = sorted((s, p) for s, p in (got or ()) if start <= s < end)
        if not batches or batches[0][0] != start or any(b[0] != a[0] + 1 for a, b in zip(batches, batches[1:])):
            # batches lost for good: drop what we know, keep the contiguous tail we have
            self.stats.lost += 1
            if not first:
                log.warning("kvblock.cluster: %s: batches from %d are no longer buffered; clearing the "
                            "instance (its blocks come back as they are stored again)", self.instance, start)
                self._clear()
            tail: list[tuple[int, bytes]] = []
            for s, p in reversed(batches):
                if tail and s != tail[-1][0] - 1:
                    break
                if not tail and s != end - 1:
                    break
                tail.append((s, p))
            batches = tail[::-1]
        for s, p in batches:
            self.expected = s
            self._apply(s, p)
            self.stats.replayed += 1
        self.expected = end

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.sink.apply(self.instance, payload, self.clock_ms())
            self.stats.applied += 1
        except ValueError as e:
            self.stats.malformed += 1
            log.warning("kvblock.cluster: %s: batch %d is malformed (%s); clearing the instance",
                        self.instance, seq, e)
            self._clear()
        self.expected = seq + 1
