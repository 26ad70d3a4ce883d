"""``cache_blocks`` for more full blocks than the request holds (issue 32): vLLM 0.33.0 slices
its table with KV events off (the held blocks are cached, the full count recorded) and fails
with events on; kvblock and the reference agree on both."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from kvblock.manager import KVCacheManager
from kvblock.reference.manager import KVCacheManager as RefManager
from kvblock.request import Request


def _held_past_table(cls, events: bool):
    m = cls(16, 1, enable_caching=True, enable_kv_cache_events=events)
    r = Request("r", list(range(1, 10)), SamplingParams(max_tokens=1), block_hasher=m.request_block_hasher)
    m.allocate_slots(r, 8, delay_cache_blocks=True)  # 8 blocks held, 9 hashes
    return m, r


def _cached(m, r) -> list[bool]:
    return [m.block_pool.get_cached_block(h, [0]) is not None for h in r.block_hashes]


@pytest.mark.parametrize("cls", [KVCacheManager, RefManager], ids=["kvblock", "reference"])
def test_events_off_caches_the_held_blocks(cls):
    m, r = _held_past_table(cls, events=False)
    m.cache_blocks(r, 9)
    assert _cached(m, r) == [True] * 8 + [False]
    # the full count is what vLLM records: a 9th block allocated later is not cached by it
    r.append_output_token_ids(5)
    m.allocate_slots(r, 1, delay_cache_blocks=True)
    m.cache_blocks(r, 9)
    assert _cached(m, r)[:9] == [True] * 8 + [False]


@pytest.mark.parametrize("cls", [KVCacheManager, RefManager], ids=["kvblock", "reference"])
def test_events_on_refuses_and_changes_nothing(cls):
    m, r = _held_past_table(cls, events=True)
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError, match="list index out of range"):
        m.cache_blocks(r, 9)
    assert _cached(m, r) == [False] * 9
    assert m.take_events() == [] and m.block_pool.get_num_free_blocks() == free
    m.cache_blocks(r, 8)  # within the table: cached as usual
    assert _cached(m, r) == [True] * 8 + [False]
