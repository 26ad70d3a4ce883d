"""``BlockPool.unpin_blocks`` and its reuse watchers (the pool half of vLLM's HiSparse
residency: a GPU page whose host copy is durable is released while still being read) against
vLLM's own ``BlockPool``, in lockstep.

A hypothesis state machine drives kvblock's pool (``kvblock.vllm.block_pool.BlockPool``, the
Rust pool) and the installed vLLM's unpatched pool through random ``get_new_blocks``,
``free_blocks``, ``touch``, ``unpin_blocks`` (each call with its own watcher), ``evict_blocks``
and ``reset_prefix_cache`` sequences. After every step: the same block ids handed out, the same
free-queue order, every block's ref count, the free block count, and the same watcher firings
in the same order (which watcher, which block).
"""

from __future__ import annotations

import os

import pytest

from conftest import require_module

require_module("vllm")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from kvblock.vllm.block_pool import BlockPool, _VllmBlockPool  # noqa: E402

EXAMPLES = int(os.environ.get("KVBLOCK_LOCKSTEP_EXAMPLES", "150"))


class UnpinLockstep(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.n = num_blocks
        self.ours = BlockPool(num_blocks, caching, 16)
        self.theirs = _VllmBlockPool(num_blocks, caching, 16)
        # (our blocks, their blocks): one entry per reference taken (allocation or touch)
        self.held: list[tuple[list, list]] = []
        self.log_ours: list[tuple[int, int]] = []
        self.log_theirs: list[tuple[int, int]] = []
        self.next_tag = 0

    def _watcher(self, log: list[tuple[int, int]], tag: int):
        return lambda block: log.append((tag, block.block_id))

    @rule(n=st.integers(0, 4))
    def get_new_blocks(self, n: int) -> None:
        if n > self.theirs.get_num_free_blocks():
            with pytest.raises(ValueError):
                self.theirs.get_new_blocks(n)
            with pytest.raises(ValueError):
                self.ours.get_new_blocks(n)
            return
        theirs = self.theirs.get_new_blocks(n)
        ours = self.ours.get_new_blocks(n)
        assert [b.block_id for b in ours] == [b.block_id for b in theirs]
        if n:
            self.held.append((ours, theirs))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        ours, theirs = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.theirs.free_blocks(theirs)
        self.ours.free_blocks(ours)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        # any non-null block: a free one leaves the queue (a prefix hit on it)
        ids = data.draw(st.lists(st.integers(1, self.n - 1), min_size=1, max_size=3, unique=True))
        self.theirs.touch([self.theirs.blocks[i] for i in ids])
        self.ours.touch([self.ours.blocks[i] for i in ids])
        self.held.append(([self.ours.blocks[i] for i in ids], [self.theirs.blocks[i] for i in ids]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unpin_blocks(self, data: st.DataObject) -> None:
        ours, theirs = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        tag = self.next_tag
        self.next_tag += 1
        self.theirs.unpin_blocks(theirs, self._watcher(self.log_theirs, tag))
        self.ours.unpin_blocks(ours, self._watcher(self.log_ours, tag))

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.integers(1, self.n - 1), max_size=3))
        self.theirs.evict_blocks(ids)
        self.ours.evict_blocks(ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.ours.reset_prefix_cache() == self.theirs.reset_prefix_cache()

    @rule()
    def unpin_null_block(self) -> None:
        # vLLM asserts; kvblock raises the same AssertionError and changes nothing
        with pytest.raises(AssertionError):
            self.theirs.unpin_blocks([self.theirs.null_block], lambda b: None)
        with pytest.raises(AssertionError):
            self.ours.unpin_blocks([self.ours.null_block], lambda b: None)

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "ours"):
            return
        assert self.log_ours == self.log_theirs
        assert self.ours.get_num_free_blocks() == self.theirs.get_num_free_blocks()
        assert [b.block_id for b in self.ours.free_block_queue.get_all_free_blocks()] == [
            b.block_id for b in self.theirs.free_block_queue.get_all_free_blocks()
        ]
        assert [b.ref_cnt for b in self.ours.blocks] == [b.ref_cnt for b in self.theirs.blocks]


UnpinLockstep.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_unpin_lockstep = UnpinLockstep.TestCase


def test_unpin_refuses_a_block_without_a_reference_changing_nothing() -> None:
    """A free block holds no reference to release: vLLM's assertion, and kvblock's pool is left
    exactly as it was (vLLM would have released the earlier blocks of the call first)."""
    pool = BlockPool(6, True, 16)
    held = pool.get_new_blocks(2)
    before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    with pytest.raises(AssertionError):
        pool.unpin_blocks([held[0], pool.blocks[5]], lambda b: None)
    assert [b.ref_cnt for b in held] == [1, 1]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before
