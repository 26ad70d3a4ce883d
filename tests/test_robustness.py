"""Bad input and odd call orders: a clear Python exception, never a PanicException or a
crash, and the state exactly as it was (regressions found by trying to break kvblock)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvblock
from kvblock import BlockPool, KVCacheManager, Request


def _snapshot(mgr):
    pool = mgr.block_pool
    return (pool.free_queue_ids(), [pool.ref_cnt(b) for b in range(pool.num_gpu_blocks)],
            pool.cached_items(), mgr.num_requests)


@pytest.mark.parametrize("n", [2**31, 2**33, 2**62])
def test_huge_allocation_request_is_a_value_error(n):
    pool = BlockPool(100, True, 16)
    with pytest.raises(ValueError, match="Cannot get"):
        pool.allocate_ids(n)
    with pytest.raises(ValueError, match="Cannot get"):
        pool.get_new_blocks(n)
    assert pool.get_num_free_blocks() == 99


def test_pool_beyond_int32_ids_is_a_value_error():
    with pytest.raises(ValueError, match="int32"):
        BlockPool(2**31, True, 16)


@pytest.mark.parametrize("running", [False, True])
@pytest.mark.parametrize("bad", ["tuple", "short_hash", "not_bytes"])
def test_bad_block_hashes_fail_before_any_change(running, bad):
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(100)), block_hasher=mgr.request_block_hasher)
    if running:
        mgr.allocate_slots(r, 40)  # 3 blocks, 2 of them cached
        r.num_computed_tokens = 40
    before = _snapshot(mgr)
    if bad == "tuple":
        r.block_hashes = tuple(r.block_hashes)
    elif bad == "short_hash":
        r.block_hashes[2] = b"x" * 5  # a block this call caches
    else:
        r.block_hashes[2] = "not bytes"
    with pytest.raises((TypeError, ValueError)):
        mgr.allocate_slots(r, 60)
    assert _snapshot(mgr) == before
    mgr.block_pool.check_invariants()


def _batch_of_three(mgr, running):
    reqs = [Request(f"r{i}", [i] * 16 + list(range(48)), block_hasher=mgr.request_block_hasher) for i in range(3)]
    if running:
        for r in reqs:
            mgr.allocate_slots(r, 31)  # 2 blocks, 1 cached; decode caches the next
            r.num_computed_tokens = 31
    return reqs


@pytest.mark.parametrize("api", ["allocate_slots_batch", "admit_batch"])
@pytest.mark.parametrize("bad", ["short_hash", "not_bytes", "tuple", "no_status"])
def test_bad_request_in_a_batch_changes_nothing(api, bad):
    """The last request of the batch is bad: the first two must not be allocated either."""
    mgr = KVCacheManager(num_blocks=40, block_size=16, watermark=0.1)
    reqs = _batch_of_three(mgr, running=api == "allocate_slots_batch")
    if api == "allocate_slots_batch":
        for r in reqs:
            r.num_computed_tokens = 31
    before = _snapshot(mgr)
    bad_req = reqs[2]
    if bad == "short_hash":
        bad_req.block_hashes[1] = b"x" * 5
    elif bad == "not_bytes":
        bad_req.block_hashes[1] = 7
    elif bad == "tuple":
        bad_req.block_hashes = tuple(bad_req.block_hashes)
    else:
        del bad_req.status
    with pytest.raises((TypeError, ValueError, AttributeError)):
        if api == "allocate_slots_batch":
            mgr.allocate_slots_batch(reqs, num_new_tokens=1)
        else:
            mgr.admit_batch(reqs)
    assert _snapshot(mgr) == before
    mgr.block_pool.check_invariants()


@pytest.mark.parametrize("api,running", [("allocate_slots_batch", True), ("allocate_slots_batch", False),
                                         ("admit_batch", False)])
def test_request_listed_twice_in_a_batch_is_rejected(api, running):
    mgr = KVCacheManager(num_blocks=40, block_size=16)
    reqs = _batch_of_three(mgr, running=running)
    twin = Request(reqs[0].request_id, reqs[0].prompt_token_ids, block_hasher=mgr.request_block_hasher)
    twin.num_computed_tokens = reqs[0].num_computed_tokens
    before = _snapshot(mgr)
    for batch in ([reqs[0], reqs[1], reqs[0]], [reqs[0], reqs[1], twin]):  # same object, same id
        with pytest.raises(ValueError, match="listed twice"):
            getattr(mgr, api)(batch)
        assert _snapshot(mgr) == before
    getattr(mgr, api)(reqs)  # a batch after a rejected one still works
    assert mgr.num_requests == 3


def test_admit_batch_takes_only_waiting_requests():
    mgr = KVCacheManager(num_blocks=40, block_size=16)
    running, waiting = _batch_of_three(mgr, running=True), _batch_of_three(mgr, running=False)
    waiting = [Request(f"w{i}", r.prompt_token_ids, block_hasher=mgr.request_block_hasher) for i, r in enumerate(waiting)]
    before = _snapshot(mgr)
    with pytest.raises(ValueError, match="already running"):
        mgr.admit_batch([waiting[0], running[1]])
    waiting[1].num_computed_tokens = 16
    with pytest.raises(ValueError, match="not waiting"):
        mgr.admit_batch([waiting[0], waiting[1]])
    assert _snapshot(mgr) == before
    waiting[1].num_computed_tokens = 0
    n, hit_tokens, *_ = mgr.admit_batch(waiting)
    assert n == 3 and hit_tokens.tolist() == [16, 16, 16]  # each shares the running twin's first block


def test_reentrant_call_is_a_runtime_error_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=20, block_size=4)

    class Sneaky:
        """A duck-typed request whose block_hashes property calls back into the manager."""

        request_id = "s"
        num_computed_tokens = 0
        _all_token_ids = list(range(10))
        skip_reading_prefix_cache = False
        num_in_flight_tokens = 0

        @property
        def block_hashes(self):
            mgr.free(inner)
            return []

    inner = Request("i", [1, 2, 3, 4, 5], block_hasher=mgr.request_block_hasher)
    mgr.allocate_slots(inner, 5)
    before = _snapshot(mgr)
    with pytest.raises(RuntimeError):
        mgr.allocate_slots(Sneaky(), 10)
    assert _snapshot(mgr) == before


def test_id_api_events_without_a_request():
    pool = BlockPool(10, True, 16, enable_kv_cache_events=True)
    hs = kvblock.hash_blocks(list(range(32)), 16)
    ids = pool.allocate_ids(2)
    pool.cache_ids(ids, hs, 0, 2)
    (ev,) = pool.take_events()
    assert ev.block_hashes == [kvblock.hashing.block_hash_to_event_int(h) for h in hs]
    assert ev.token_ids == [] and ev.extra_keys == [None, None] and ev.block_size == 16
    assert pool.take_events() == []


def test_rejected_output_token_is_not_appended():
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    r = Request("r", list(range(15)), block_hasher=mgr.request_block_hasher)
    with pytest.raises(TypeError):
        r.append_output_token_ids(True)
    assert r.num_tokens == 15 and r.output_token_ids == []
    r.append_output_token_ids(7)
    assert len(r.block_hashes) == 4


def test_bools_are_not_block_ids():
    pool = BlockPool(10, True, 16)
    pool.allocate_ids(2)
    with pytest.raises(TypeError, match="bool"):
        pool.free_ids([True])
    assert pool.ref_cnt(1) == 1


def test_odd_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="token_ids"):
        kvblock.hash_blocks(np.array(5), 16)
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(40)), block_hasher=mgr.request_block_hasher)
    with pytest.raises(TypeError, match="new_computed_blocks"):
        mgr.allocate_slots(r, 20, 16, [[1]])
    with pytest.raises(ValueError, match=r"num_new_tokens\[1\]"):
        mgr.allocate_slots_batch([r, r], num_new_tokens=np.array([1, -1]))
    pool = mgr.block_pool
    with pytest.raises(ValueError, match="block_size"):
        pool.cache_ids([1], [b"x" * 32], 0, 1, block_size=0)
    with pytest.raises(ValueError):
        pool.is_free(1000)


@pytest.mark.parametrize(
    "args",
    [
        ["replay", "--num-blocks", "2147483648", "--no-progress"],
        ["replay", "--bogus"],
        ["sweep", "x.jsonl", "--capacities", "0"],
    ],
)
def test_cli_errors_are_one_line(args):
    out = subprocess.run([sys.executable, "-m", "kvblock", *args], capture_output=True, text=True)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
