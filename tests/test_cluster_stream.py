"""EventStream, the sequencing of one engine's batches, on deterministic inputs: in order,
gaps filled from the replay buffer, gaps no longer buffered, restarts, malformed batches, late
joiners. The invariant throughout: the index never holds a block the engine does not."""

from __future__ import annotations

import subprocess
import sys

from kvblock.cluster import DictIndex, EventStream, PrefixIndex
from kvblock.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch


def stored(hashes, parent=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None)


class Engine:
    """An engine's truth (a DictIndex fed every batch) and its publisher's replay buffer."""

    def __init__(self, keep: int = 100) -> None:
        self.truth = DictIndex()
        self.buffer: list[tuple[int, bytes]] = []
        self.keep = keep
        self.seq = 0

    def batch(self, *events) -> tuple[int, bytes]:
        p = encode_batch(list(events), ts=0.0)
        self.truth.apply("e", p)
        s = self.seq
        self.seq += 1
        self.buffer = (self.buffer + [(s, p)])[-self.keep:]
        return s, p

    def replay(self, start: int):
        return [(s, p) for s, p in self.buffer if s >= start]


def never_over(ix, truth, chains):
    for ch in chains:
        got, want = ix.match(ch).get("e", 0), truth.match(ch).get("e", 0)
        assert got <= want, (ch, got, want)


A, B, C = [1, 2, 3, 4], [1, 2, 9], [5, 6]


def test_in_order_and_gap_filled():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    lost = eng.batch(BlockRemoved(block_hashes=[4], medium="GPU"))  # never delivered live
    st.on_message(*eng.batch(stored([9], 2)))
    assert st.stats.gaps == 1 and st.stats.replayed == 1 and st.stats.lost == 0
    assert lost[0] == 1 and st.expected == 3
    for ch in (A, B):
        assert ix.match(ch) == eng.truth.match(ch)


def test_gap_no_longer_buffered_clears():
    eng = Engine(keep=2)
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    for _ in range(3):  # lost, and pushed out of the 2-batch buffer
        eng.batch(BlockRemoved(block_hashes=[3], medium="GPU"))
    eng.batch(stored(C))
    st.on_message(*eng.batch(stored([9], 2)))
    assert st.stats.lost == 1
    never_over(ix, eng.truth, (A, B, C))
    assert ix.match(C) == {"e": 2}  # the buffered tail is applied
    assert ix.match(A) == {}  # A's blocks may have been removed meanwhile: forgotten


def test_restart_clears_and_replays_the_new_publisher():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    for ev in (stored(A), stored(C)):
        st.on_message(*eng.batch(ev))
    new = Engine()  # the engine restarted: empty cache, batch numbers from 0
    st.replay = new.replay
    new.batch(stored(B))
    st.on_message(*new.batch(stored([7], 9)))  # seq 1 < expected 2
    assert st.stats.restarts == 1
    assert ix.match(A) == {"e": 2} and ix.match(B) == {"e": 3} and ix.match(C) == {}


def test_malformed_batch_clears_the_instance():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    st.on_message(eng.seq, b"\x93 garbage")  # a batch we cannot read: maybe it removed blocks
    eng.seq += 1
    st.on_message(*eng.batch(stored(C)))
    assert st.stats.malformed == 1
    assert ix.match(A) == {} and ix.match(C) == {"e": 2}


def test_late_joiner_and_catch_up():
    eng = Engine()
    for ev in (stored(A), stored(C), AllBlocksCleared(), stored(B)):
        eng.batch(ev)
    ix = PrefixIndex()
    ix.store("e", [5, 6])  # stale state from before: dropped on the first contact
    st = EventStream("e", ix, eng.replay)
    assert st.catch_up() == 4 and st.expected == 4
    for ch in (A, B, C):
        assert ix.match(ch) == eng.truth.match(ch)
    eng.batch(BlockRemoved(block_hashes=[9], medium="GPU"))  # lost at the end of a burst
    assert st.catch_up() == 1
    assert ix.match(B) == eng.truth.match(B) == {"e": 2}
    st.on_message(*eng.batch(stored([9], 2)))
    assert ix.match(B) == {"e": 3} and st.stats.gaps == 0


def test_no_replay_endpoint():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, None)
    eng.batch(stored(C))  # missed by a late joiner without replay
    st.on_message(*eng.batch(stored(A)))
    assert ix.match(A) == {"e": 4} and ix.match(C) == {}
    eng.batch(BlockRemoved(block_hashes=[1], medium="GPU"))  # lost
    st.on_message(*eng.batch(stored(B[2:], 2)))
    never_over(ix, eng.truth, (A, B, C))
    assert st.stats.lost == 2  # the batch before joining, and the one lost later


def test_import_kvblock_imports_neither_zmq_nor_redis():
    code = ("import sys, kvblock, kvblock.cluster; ix = kvblock.cluster.PrefixIndex(); "
            "print('zmq' in sys.modules, 'redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# -- issue 32: a late or duplicated batch is not a restart ------------------------------------------


def test_late_copy_of_an_old_batch_is_dropped_not_taken_for_a_restart():
    # store 1, 2, 3; remove 3; a late copy of the first batch: the engine holds 2 blocks
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    first = eng.batch(stored([1, 2, 3]))
    st.on_message(*first)
    st.on_message(*eng.batch(BlockRemoved(block_hashes=[3], medium="GPU")))
    st.on_message(*first)
    assert eng.truth.match([1, 2, 3]) == {"e": 2}
    assert ix.match([1, 2, 3]) == {"e": 2}
    assert st.stats.restarts == 0 and st.stats.stale == 1 and st.expected == 2


def test_duplicate_of_the_last_batch_keeps_long_lived_blocks():
    # a 3-batch buffer: a hot prefix stored at batch 0 is long gone from the buffer
    eng = Engine(keep=3)
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    for i in range(4):
        last = eng.batch(stored([100 + i]))
        st.on_message(*last)
    st.on_message(*last)  # the network delivers it twice
    assert eng.truth.match(A) == {"e": 4}
    assert ix.match(A) == {"e": 4}
    assert st.stats.restarts == 0 and st.stats.lost == 0 and st.stats.stale == 1


def test_damaged_late_copy_is_told_from_a_restart_by_the_replay_buffer():
    eng = Engine(keep=3)
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    for i in range(4):
        st.on_message(*eng.batch(stored([100 + i])))
    probes = st.stats.probes
    st.on_message(2, b"\x93\xcb")  # a truncated copy of batch 2: same number, other bytes
    assert ix.match(A) == {"e": 4}
    assert st.stats.restarts == 0 and st.stats.stale == 1 and st.stats.probes == probes + 1


def test_catch_up_racing_the_live_stream_never_rebuilds():
    # the idle catch-up replays batches whose live copies are still in flight
    eng = Engine(keep=3)
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    in_flight = [eng.batch(stored([200 + i])) for i in range(3)]
    assert st.catch_up() == 3
    for s, p in in_flight:
        st.on_message(s, p)
    assert ix.match(A) == {"e": 4}
    assert st.stats.restarts == 0 and st.stats.stale == 3 and st.stats.applied == 4


def test_restart_seen_by_an_idle_catch_up():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    for ev in (stored(A), stored(C), stored([7], 9)):
        st.on_message(*eng.batch(ev))
    new = Engine()  # restarted while silent; its batches were published before we listened
    st.replay = new.replay
    new.batch(stored(B))
    assert st.catch_up() == 1
    assert st.stats.restarts == 1
    assert ix.match(A) == {"e": 2} and ix.match(B) == {"e": 3} and ix.match(C) == {}


def test_restarted_publisher_ahead_of_the_old_one_is_not_grafted_onto_the_old_state():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(C)))
    new = Engine()  # restarted; its first batches were lost, a later one arrives as a "gap"
    st.replay = new.replay
    new.batch(stored(A))
    new.batch(stored([8]))
    st.on_message(*new.batch(stored([9], 2)))
    assert st.stats.restarts == 1
    never_over(ix, new.truth, (A, B, C, [8]))
    assert ix.match(C) == {} and ix.match(B) == {"e": 3}


def test_went_back_without_replay_clears_rather_than_guess():
    eng = Engine()
    ix = PrefixIndex()
    st = EventStream("e", ix, None)
    first = eng.batch(stored([1, 2, 3]))
    st.on_message(*first)
    st.on_message(*eng.batch(BlockRemoved(block_hashes=[3], medium="GPU")))
    st.on_message(0, encode_batch([stored([1, 2, 3, 4])], ts=1.0))  # batch 0 again, other bytes
    never_over(ix, eng.truth, ([1, 2, 3, 4],))
    assert st.stats.unconfirmed == 1 and st.stats.restarts == 0
    st.on_message(*first)  # an exact duplicate is recognised without replay... once resynchronised
    never_over(ix, eng.truth, ([1, 2, 3, 4],))


def test_history_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="history"):
        EventStream("e", PrefixIndex(), None, history=0)


def test_damaged_next_batch_is_taken_from_the_replay_buffer():
    # a truncated live copy of the next batch: the publisher's intact copy is applied, the hot
    # prefix stored long before stays claimed
    eng = Engine(keep=3)
    ix = PrefixIndex()
    st = EventStream("e", ix, eng.replay)
    st.on_message(*eng.batch(stored(A)))
    for i in range(4):
        st.on_message(*eng.batch(stored([100 + i])))
    s, p = eng.batch(BlockRemoved(block_hashes=[103], medium="GPU"))
    st.on_message(s, p[: len(p) // 2])
    assert ix.match(A) == {"e": 4} and ix.match([103]) == {}
    assert st.stats.malformed == 1 and st.stats.lost == 0 and st.expected == s + 1


def test_first_message_from_a_past_publisher_is_not_grafted_onto_the_new_one():
    # after a resync, the first live batch is a late one of the publisher before a restart
    old = Engine()
    for ev in (stored(A), stored(C), stored([7], 9)):
        old.batch(ev)
    late = old.batch(stored(B[2:], 2))
    new = Engine()
    new.batch(stored([1, 2]))
    ix = PrefixIndex()
    st = EventStream("e", ix, new.replay)
    st.on_message(*late)  # seq 3: the new publisher holds batch 0 only
    never_over(ix, new.truth, (A, B, C))
    assert ix.match(A) == {"e": 2} and st.stats.stale == 1 and st.expected == 1
