"""One engine's KV event stream: sequence numbers, gaps, replays, restarts.

vLLM's ``ZmqEventPublisher`` numbers its batches 0, 1, 2, ... (an 8-byte big-endian frame),
stamps each with its wall time, and keeps the last ``buffer_steps`` of them for replay; a
batch is in the buffer before any subscriber can ask for it after receiving it.
:class:`EventStream` turns the messages of one publisher into index updates that never make
the index claim a block the engine does not hold:

* the next batch in sequence is applied, and its digest remembered (the last ``history``);
* a batch number already applied with the same payload (a duplicate, a late copy, or the
  live copy of a batch a catch-up already replayed) is dropped and counted (``stale``);
* any other batch number that is not the next one (a gap, or a number that goes back) makes
  the stream ask the replay buffer for the batches from the last one it applied on. The
  publisher's answer tells what happened, because a publisher never forgets its newest
  batch and never sends two payloads under one number:

  - it holds that last batch, identical: the same publisher. A gap is filled from the
    answer; a batch number that went back is a late or damaged copy, dropped (``stale``);
  - it holds that batch with another payload, or holds nothing that recent: a new
    publisher (the engine restarted). The instance is cleared and rebuilt from the new
    publisher's buffer (``restarts``);
  - it no longer holds that batch but holds every one after it: the same publisher,
    further on (this is the one case taken on trust: a restarted publisher would have to
    have published more batches than this one had, none received, and its buffer would
    have to begin exactly at the next number);
  - it no longer holds that batch nor all after it: batches were lost for good. The
    instance is cleared and rebuilt from the buffered tail (``lost``): an under-report until
    the blocks are stored again, never an over-report;
  - no answer (no replay endpoint, or it did not answer in full): a gap clears the instance
    and goes on from the live batch (``lost``); a number that goes back cannot be told from a
    restart, so the instance is cleared and the next batch starts over (``unconfirmed``);
* a malformed next batch is taken from the replay buffer when the publisher holds an intact
  copy (the channel damaged ours); otherwise it is a lost batch: the instance is cleared and
  the stream goes on;
* :meth:`EventStream.resync` (a reconnect) clears the instance and replays from 0.

The first message of a stream also clears the instance (what an index holds about it from
before is stale) and rebuilds it from the replay buffer's run ending at the newest batch, so
a subscriber that joins late still learns the blocks whose batches the publisher kept; a
first message the buffer does not hold (a past publisher's, still in flight) is dropped.
:meth:`EventStream.catch_up` asks the same question as a gap of an idle publisher, so a
catch-up racing the live stream never rebuilds anything (the live copies it overtook arrive
as duplicates) and a restart while idle is seen. The time since the last batch is not used:
a restart is told by the buffer's answer, not guessed from silence.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

__all__ = ["EventSink", "EventStream", "ReplayFn", "StreamStats"]

log = logging.getLogger("kvblock.cluster")

#: ``replay(start_seq) -> [(seq, payload), ...]``: every buffered batch from ``start_seq`` on,
#: in order (None: no replay endpoint, or it did not answer in full).
ReplayFn = Callable[[int], "list[tuple[int, bytes]] | None"]

_Verdict = Literal["same", "restart", "wrapped"]


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class EventSink(Protocol):
    """What a stream feeds: an index (``PrefixIndex``, ``DictIndex``, ``RedisPrefixIndex``)."""

    def apply(self, instance: str, payload: bytes, now_ms: int = 0) -> object: ...

    def clear_instance(self, instance: str) -> int: ...

    def add_instance(self, instance: str) -> object: ...


@dataclass
class StreamStats:
    """Counters of one stream.

    ``stale``: batches dropped because they were already applied (duplicates, late copies)
    or came from before what the stream knows (late, damaged, or a past publisher's);
    ``probes``: replay requests made to tell those from a restart or a loss;
    ``unconfirmed``: batch numbers that went back with no replay answer to tell why (the
    instance was cleared).
    """

    applied: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    malformed: int = 0
    restarts: int = 0
    resyncs: int = 0
    stale: int = 0
    probes: int = 0
    unconfirmed: int = 0


class EventStream:
    """The sequencing state machine of one publisher (see the module docstring).

    Args:
        instance: the instance name the index files this stream's blocks under.
        sink: the index.
        replay: fetches buffered batches from a sequence number on (None: no replay).
        clock_ms: ``() -> int``, the time passed to ``sink.apply`` (for ``expire``).
        history: how many of the last batches applied are remembered (16-byte digests) to
            recognise duplicates without asking the publisher.

    Raises:
        ValueError: ``history`` is below 1.
    """

    def __init__(self, instance: str, sink: EventSink, replay: ReplayFn | None = None,
                 clock_ms: Callable[[], int] | None = None, history: int = 4096) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.instance = instance
        self.sink = sink
        self.replay = replay
        self.clock_ms = clock_ms or (lambda: 0)
        self.history = history
        self.expected: int | None = None
        self.stats = StreamStats()
        self._seen: dict[int, bytes] = {}
        sink.add_instance(instance)

    # -- input --------------------------------------------------------------------------------
    def on_message(self, seq: int, payload: bytes) -> None:
        """A live batch ``seq`` with its msgpack ``payload``."""
        expected = self.expected
        if expected is None:
            self._start(seq, payload)
            return
        if seq == expected:
            if not self._try_apply(seq, payload):
                self._unreadable(seq, payload)
            return
        if seq < expected:
            if self._seen.get(seq) == _digest(payload):
                self.stats.stale += 1
                return
        else:
            self.stats.gaps += 1
        got = self._ask(expected - 1)
        if got is None:
            if seq > expected:
                self.stats.lost += 1
                log.warning("kvblock.cluster: %s: batches %d..%d missing and no replay; clearing the instance",
                            self.instance, expected, seq - 1)
                self._clear()
                self._apply(seq, payload)
            else:
                self.stats.unconfirmed += 1
                log.warning("kvblock.cluster: %s: batch number went back from %d to %d and the replay buffer "
                            "cannot tell a late batch from a restart; clearing the instance",
                            self.instance, expected - 1, seq)
                self._reset(forget=False)
            return
        verdict = self._verdict(got)
        if verdict == "restart":
            self._restart()
            return
        applied_live = self._apply_tail(got, verdict, live=(seq, payload))
        if not applied_live and seq < expected:
            self.stats.stale += 1
            log.debug("kvblock.cluster: %s: dropped batch %d (already past it)", self.instance, seq)
        elif not applied_live:
            # not in the publisher's buffer: a past publisher's batch still in flight
            self.stats.stale += 1

    def catch_up(self) -> int:
        """Ask the replay buffer for batches from the last one applied (from 0 for a stream
        with nothing applied yet) and apply those after it in sequence: a late joiner learns
        what the publisher kept, batches lost at the end of a burst (no later message shows
        the gap) are recovered, and a publisher that restarted while silent is noticed.
        Returns the batches applied."""
        if self.replay is None:
            return 0
        if self.expected is None:
            return self._rebuild()
        got = self._ask(self.expected - 1)
        if got is None:
            return 0
        verdict = self._verdict(got)
        if verdict == "restart":
            return self._restart()
        before = self.stats.applied
        self._apply_tail(got, verdict)
        return self.stats.applied - before

    def resync(self) -> None:
        """Forget what is known (e.g. after a reconnect): clear the instance; the next
        message replays from 0."""
        self.stats.resyncs += 1
        self._reset(forget=False)

    # -- steps --------------------------------------------------------------------------------
    def _ask(self, start: int) -> list[tuple[int, bytes]] | None:
        if self.replay is None:
            return None
        self.stats.probes += 1
        return self.replay(max(start, 0))

    def _verdict(self, got: list[tuple[int, bytes]]) -> _Verdict:
        """What a full answer to ``replay(expected - 1)`` says about the publisher."""
        assert self.expected is not None
        last = self.expected - 1
        newest = max((s for s, _ in got), default=-1)
        for s, p in got:
            if s == last:
                known = self._seen.get(last)
                return "same" if known is None or known == _digest(p) else "restart"
        # a publisher always holds its newest batch, and we applied ``last`` from it
        if newest < last:
            return "restart"
        # ``last`` just left the buffer but everything after it is there: nothing is missing
        return "same" if min(s for s, _ in got) == self.expected else "wrapped"

    def _apply_tail(self, got: list[tuple[int, bytes]], verdict: _Verdict,
                    live: tuple[int, bytes] | None = None) -> bool:
        """Apply the buffered batches after the last one applied (``verdict == "same"``), or
        clear and apply the run that ends at the newest (``"wrapped"``: some are gone).
        Returns whether the live batch ``live`` was among them."""
        assert self.expected is not None
        batches = sorted((s, p) for s, p in got if s >= self.expected)
        if verdict == "wrapped" or (batches and batches[0][0] != self.expected):
            k = len(batches)
            while k > 1 and batches[k - 2][0] == batches[k - 1][0] - 1:
                k -= 1
            batches = batches[k - 1:]
            self.stats.lost += 1
            log.warning("kvblock.cluster: %s: batches from %d are no longer buffered; clearing the instance "
                        "(its blocks come back as they are stored again)", self.instance, self.expected)
            self._clear()
        applied_live = False
        for s, p in batches:
            if self.expected is not None and s != self.expected and s != batches[0][0]:
                break
            if live is not None and s == live[0]:
                applied_live = True
            else:
                self.stats.replayed += 1
            self._apply(s, p)
        return applied_live

    def _restart(self) -> int:
        self.stats.restarts += 1
        log.warning("kvblock.cluster: %s: the publisher no longer holds the batches applied (it restarted); "
                    "clearing and resynchronising", self.instance)
        self._reset()
        return self._rebuild()

    def _rebuild(self, got: list[tuple[int, bytes]] | None = None, live: int | None = None) -> int:
        """From nothing known: clear, then apply the buffered run that ends at the newest
        batch (``got``: an answer to ``replay(0)`` already in hand; ``live``: the number of a
        live batch the run may hold, not counted as replayed). Returns the batches applied."""
        if got is None:
            got = self._ask(0)
        if not got:
            return 0
        batches = sorted(got)
        k = len(batches)
        while k > 1 and batches[k - 2][0] == batches[k - 1][0] - 1:
            k -= 1
        run = batches[k - 1:]
        self._reset()
        if run[0][0] != 0:
            self.stats.lost += 1
        for s, p in run:
            self._apply(s, p)
            if s != live:
                self.stats.replayed += 1
        return len(run)

    def _reset(self, forget: bool = True) -> None:
        """Clear the instance and start over; ``forget=False`` keeps the digests of the
        batches applied, so a copy of one of them is still recognised (no publisher, old or
        new, sends the same bytes twice: each batch carries its wall time)."""
        self._clear()
        if forget:
            self._seen.clear()
        self.expected = None

    def _clear(self) -> None:
        self.sink.clear_instance(self.instance)

    def _start(self, seq: int, payload: bytes) -> None:
        """The first message: clear, then rebuild from the replay buffer, which holds this
        batch if it comes from the publisher now answering (it buffers a batch before anyone
        can ask for it); without a replay answer, apply ``seq`` alone. A copy of a batch
        applied before a resync or an unconfirmed reset, or a batch the publisher does not
        hold (a past publisher's, still in flight), is dropped."""
        if self._seen.get(seq) == _digest(payload):
            self.stats.stale += 1
            return
        got = self._ask(0)
        if got is None:
            self._reset()
            if seq > 0:
                self.stats.lost += 1  # the batches before it are unknown
            self._apply(seq, payload)
            return
        if not got:
            self._reset(forget=False)
            self.stats.stale += 1
            return
        self._rebuild(got, live=seq)
        assert self.expected is not None
        if seq == self.expected:  # published between the two: apply it
            self._apply(seq, payload)
        elif seq > self.expected or self._seen.get(seq) != _digest(payload):
            self.stats.stale += 1

    def _unreadable(self, seq: int, payload: bytes) -> None:
        """The live batch ``seq`` (the next one) could not be read: apply the publisher's
        copy if it holds another one (the channel damaged ours), else it is lost: clear."""
        self.stats.malformed += 1
        got = self._ask(seq - 1)
        if got is not None and any(s == seq and p != payload for s, p in got):
            verdict = self._verdict(got)
            if verdict == "restart":
                self._restart()
                return
            self._apply_tail(got, verdict)  # a copy that is malformed too clears the instance there
            if self.expected is not None and self.expected > seq:
                log.info("kvblock.cluster: %s: batch %d arrived damaged; applied the publisher's copy",
                         self.instance, seq)
                return
        log.warning("kvblock.cluster: %s: batch %d is malformed; clearing the instance", self.instance, seq)
        self._clear()
        self.expected = seq + 1

    def _try_apply(self, seq: int, payload: bytes) -> bool:
        """Apply one batch; False (nothing changed) if it is malformed."""
        try:
            self.sink.apply(self.instance, payload, self.clock_ms())
        except ValueError as e:
            log.debug("kvblock.cluster: %s: batch %d is malformed (%s)", self.instance, seq, e)
            return False
        self.stats.applied += 1
        self._record(seq, payload)
        return True

    def _apply(self, seq: int, payload: bytes) -> None:
        if not self._try_apply(seq, payload):
            self.stats.malformed += 1
            log.warning("kvblock.cluster: %s: batch %d is malformed; clearing the instance", self.instance, seq)
            self._clear()
            self._record(seq, payload)

    def _record(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        self._seen[seq] = _digest(payload)
        if len(self._seen) > 2 * self.history:
            floor = seq + 1 - self.history
            self._seen = {s: d for s, d in self._seen.items() if s >= floor}
