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
@pytest.mark.parametrize("bad", ["tuple", "empty_hash", "not_bytes"])
def test_bad_block_hashes_fail_before_any_change(running, bad):
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(100)), block_hasher=mgr.request_block_hasher)
    if running:
        mgr.allocate_slots(r, 40)  # 3 blocks, 2 of them cached
        r.num_computed_tokens = 40
    before = _snapshot(mgr)
    if bad == "tuple":
        r.block_hashes = tuple(r.block_hashes)
    elif bad == "empty_hash":
        r.block_hashes[2] = b""  # a block this call caches (hashes are 1 to 32 bytes)
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
@pytest.mark.parametrize("bad", ["empty_hash", "not_bytes", "tuple", "no_status"])
def test_bad_request_in_a_batch_changes_nothing(api, bad):
    """The last request of the batch is bad: the first two must not be allocated either."""
    mgr = KVCacheManager(num_blocks=40, block_size=16, watermark=0.1)
    reqs = _batch_of_three(mgr, running=api == "allocate_slots_batch")
    if api == "allocate_slots_batch":
        for r in reqs:
            r.num_computed_tokens = 31
    before = _snapshot(mgr)
    bad_req = reqs[2]
    if bad == "empty_hash":
        bad_req.block_hashes[1] = b""
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
    with pytest.raises(ValueError, match="already holds blocks"):
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


def test_admit_batch_checks_max_model_len_before_admitting_any():
    mgr = KVCacheManager(num_blocks=40, block_size=16, max_model_len=200)
    ok = Request("ok", list(range(50)), block_hasher=mgr.request_block_hasher)
    too_long = Request("long", list(range(201)), block_hasher=mgr.request_block_hasher)
    before = _snapshot(mgr)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.admit_batch([ok, too_long])
    assert _snapshot(mgr) == before


@pytest.mark.parametrize("api", ["per_request", "batch"])
def test_event_tags_do_not_keep_requests_alive(api):
    """With KV events on, a decode loop must not accumulate references to its requests, and a
    call that raises must not leave one behind."""
    mgr = KVCacheManager(num_blocks=400, block_size=4, enable_kv_cache_events=True)
    reqs = [Request(f"r{i}", list(range(i * 100, i * 100 + 10 + i)), block_hasher=mgr.request_block_hasher)
            for i in range(2)]
    mgr.admit_batch(reqs)
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
        r.status = kvblock.RequestStatus.RUNNING
    mgr.take_events()
    base = sys.getrefcount(reqs[1])
    for _ in range(200):
        for r in reqs:
            r.append_output_token_ids(1)
        if api == "batch":
            mgr.allocate_slots_batch(reqs)
        else:
            for r in reqs:
                mgr.allocate_slots(r, 1)
        for r in reqs:
            r.num_computed_tokens += 1
        mgr.take_events()
    after = sys.getrefcount(reqs[1])  # (outside the assert: pytest's rewriting holds values)
    assert after == base
    x = Request("x", list(range(10)), block_hasher=mgr.request_block_hasher)
    base = sys.getrefcount(x)
    for _ in range(100):
        with pytest.raises(ValueError):
            mgr.allocate_slots(x, -1)
    after = sys.getrefcount(x)
    assert after == base


def test_adopting_into_a_request_that_holds_blocks_is_refused_without_leaking():
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(8)), block_hasher=mgr.request_block_hasher)
    mgr.allocate_slots(a, 8)  # caches blocks [1, 2]
    b = Request("b", list(range(8)) + [99], block_hasher=mgr.request_block_hasher)
    mgr.allocate_slots(b, 1)  # holds a block, nothing cached yet
    hit, n, _ = mgr.get_computed_blocks(b)
    assert n == 8
    before = _snapshot(mgr)
    # vLLM asserts an empty table when a request adopts computed tokens (half way through);
    # kvblock raises the same AssertionError before anything changes
    with pytest.raises(AssertionError, match="already holds blocks"):
        mgr.allocate_slots(b, 1, n, hit)
    with pytest.raises(AssertionError, match="already holds blocks"):
        mgr.allocate_slots(b, 4, num_external_computed_tokens=16)
    assert _snapshot(mgr) == before
    mgr.free(a)
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 9
    mgr.block_pool.check_invariants()


def test_hit_token_count_must_match_the_hit_blocks():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    a = Request("a", list(range(40)), block_hasher=mgr.request_block_hasher)
    mgr.allocate_slots(a, 40)
    b = Request("b", list(range(40)), block_hasher=mgr.request_block_hasher)
    hit, n, _ = mgr.get_computed_blocks(b)
    assert n == 32
    before = _snapshot(mgr)
    for wrong in (0, 16, 48):
        with pytest.raises(ValueError, match="num_new_computed_tokens"):
            mgr.allocate_slots(b, 8, wrong, hit)
    assert _snapshot(mgr) == before


def test_huge_counts_saturate_instead_of_wrapping():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(10)), block_hasher=mgr.request_block_hasher)
    m = 2**63 - 1
    assert mgr.allocate_slots(r, m, num_lookahead_tokens=m) is None  # needs max_model_len slots
    counts, _ = mgr.allocate_slots_batch([r], num_new_tokens=m, num_lookahead_tokens=m)
    assert counts.tolist() == [-1]
    with pytest.raises(ValueError, match="out of range"):
        mgr.allocate_slots_batch([r], num_new_tokens=2**70)
    with pytest.raises(ValueError, match=r"num_new_tokens\[0\]: out of range"):
        mgr.allocate_slots_batch([r], num_new_tokens=[2**70])


@pytest.mark.parametrize("dtype", [">i8", ">i4", ">u4"])
def test_non_native_byte_order_is_refused(dtype):
    toks = np.arange(64, dtype=dtype)
    with pytest.raises(TypeError, match="byte order"):
        kvblock.hash_blocks(toks, 16)
    assert kvblock.hash_blocks(toks.astype(toks.dtype.newbyteorder("=")), 16) == kvblock.hash_blocks(
        list(range(64)), 16)


def test_hash_requests_rejects_a_request_listed_twice():
    """A duplicate used to append the new hashes twice (and later cache blocks under wrong
    hashes); now it is refused before any request changes."""
    mgr = KVCacheManager(num_blocks=64, block_size=16)
    a = Request("a", list(range(40)))
    b = Request("b", list(range(100, 140)))
    for r in (a, b):
        r.attach_block_hasher(mgr.request_block_hasher, hash_now=False)
    with pytest.raises(ValueError, match='"b" is listed twice'):
        kvblock.hashing.hash_requests([a, b, b])
    assert a.block_hashes == [] and b.block_hashes == []
    assert kvblock.hashing.hash_requests([a, b]) == 4
    assert len(a.block_hashes) == 2 and len(b.block_hashes) == 2


@pytest.mark.parametrize("typecode", ["b", "h", "i", "l", "q", "B", "H", "I", "L", "Q"])
def test_empty_and_unaligned_buffers_hash(typecode):
    import array

    assert kvblock.hash_blocks(array.array(typecode), 16) == []
    raw = np.zeros(8 * 32 + 1, dtype=np.uint8)
    view = raw[1:].view(np.int64)  # items not 8-byte aligned
    view[:] = np.arange(32)
    assert kvblock.hash_blocks(view, 16) == kvblock.hash_blocks(list(range(32)), 16)


@pytest.mark.parametrize("call, arg", [
    (lambda pool, mgr, r: pool.ref_cnt(-1), "block_id"),
    (lambda pool, mgr, r: pool.is_free(2**40), "block_id"),
    (lambda pool, mgr, r: pool.lookup_prefix([], max_blocks=-1), "max_blocks"),
    (lambda pool, mgr, r: pool.lookup_prefix([], group_id=-1), "group_id"),
    (lambda pool, mgr, r: mgr.allocate_slots(r, 2**63), "num_new_tokens"),
    (lambda pool, mgr, r: mgr.allocate_slots(r, 4, num_lookahead_tokens=-(2**70)), "num_lookahead_tokens"),
    (lambda pool, mgr, r: kvblock.hash_blocks([1] * 16, 2**63), "block_size"),
])
def test_out_of_range_ints_are_value_errors_naming_the_argument(call, arg):
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(10)), block_hasher=mgr.request_block_hasher)
    before = _snapshot(mgr)
    with pytest.raises(ValueError, match=arg):
        call(mgr.block_pool, mgr, r)
    assert _snapshot(mgr) == before


def test_bool_counts_are_type_errors():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("r", list(range(10)), block_hasher=mgr.request_block_hasher)
    before = _snapshot(mgr)
    with pytest.raises(TypeError, match="num_new_tokens: expected int, got bool"):
        mgr.allocate_slots(r, True)
    with pytest.raises(TypeError, match="n: expected int, got bool"):
        mgr.block_pool.allocate_ids(True)
    assert _snapshot(mgr) == before


def test_none_where_a_request_belongs_is_a_type_error():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    before = _snapshot(mgr)
    for call in (lambda: mgr.allocate_slots(None, 1), lambda: mgr.allocate_slots_batch([None]),
                 lambda: mgr.admit_batch([None]), lambda: kvblock.hashing.hash_requests([None]),
                 lambda: mgr.free(None), lambda: mgr.get_computed_blocks(None)):
        with pytest.raises(TypeError, match="request: expected a request"):
            call()
    assert _snapshot(mgr) == before


@pytest.mark.parametrize("watermark", [1.5, -0.1, float("nan")])
def test_watermark_is_a_fraction(watermark):
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(num_blocks=20, block_size=16, watermark=watermark)


def test_block_id_errors_name_the_value():
    pool = BlockPool(10, True, 16)
    with pytest.raises(ValueError, match=r"block_ids\[0\]: 18446744073709551615 is not a block id"):
        pool.free_ids(np.array([2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match=r"block_ids\[0\]: 18446744073709551616 is not a block id"):
        pool.free_ids([2**64])
    with pytest.raises(TypeError, match="block_ids: expected integers, got a float buffer"):
        pool.free_ids(np.array([1.0]))
    assert pool.get_num_free_blocks() == 9


def test_admit_batch_names_an_empty_request():
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    r = Request("empty", [], block_hasher=mgr.request_block_hasher)
    with pytest.raises(ValueError, match='"empty" has no tokens'):
        mgr.admit_batch([r])


def test_two_dimensional_prompt_array_is_refused():
    with pytest.raises(ValueError, match="1-D"):
        Request("x", np.ones((2, 8), dtype=np.int64))
    assert Request("y", np.arange(8)).prompt_token_ids == list(range(8))


def test_block_queued_while_in_use_is_refused_not_queued_twice():
    # vLLM's raw free-queue API can append a block that is still allocated; freeing it or
    # handing it out again must then fail cleanly (it used to corrupt the queue and panic)
    p = BlockPool(4, True, 2)
    b = p.get_new_blocks(1)[0]
    p.free_block_queue.append(b)
    before = (p.get_num_free_blocks(), p.free_queue_ids(), b.ref_cnt)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        p.free_blocks([b])
    assert (p.get_num_free_blocks(), p.free_queue_ids(), b.ref_cnt) == before
    with pytest.raises(RuntimeError, match="in use"):
        p.get_new_blocks(3)  # the in-use block is among the three at the head
    assert (p.get_num_free_blocks(), p.free_queue_ids(), b.ref_cnt) == before
    assert [x.block_id for x in p.get_new_blocks(2)] == before[1][:2]  # the ones before it still work


def test_errors_reading_optional_request_fields_are_not_swallowed():
    mgr = KVCacheManager(num_blocks=20, block_size=4)

    class Interrupting:  # no num_tokens: its length is read from the token list, which raises
        request_id = "x"
        num_computed_tokens = 0
        block_hashes: list = []
        skip_reading_prefix_cache = False

        @property
        def _all_token_ids(self):
            raise KeyboardInterrupt

    free = mgr.block_pool.get_num_free_blocks()
    with pytest.raises(KeyboardInterrupt):
        mgr.allocate_slots(Interrupting(), 8)
    assert mgr.block_pool.get_num_free_blocks() == free and mgr.num_requests == 0


class _DuckRequest:
    """A duck-typed waiting request whose ``block_hashes`` property runs ``on_read`` first."""

    def __init__(self, request_id, tokens, on_read):
        self.request_id, self._all_token_ids, self._on_read = request_id, list(tokens), on_read
        self.num_computed_tokens = 0
        self.skip_reading_prefix_cache = False
        self.num_in_flight_tokens = 0
        self._hashes = kvblock.hash_blocks(self._all_token_ids, 4)

    @property
    def block_hashes(self):
        self._on_read()
        return self._hashes


def test_admit_batch_reads_every_request_before_admitting_any():
    # a request whose property reads the pool is admitted with the rest (phase 2 reads no
    # request attribute); one whose property changes the manager stops the whole batch
    mgr = KVCacheManager(num_blocks=32, block_size=4, max_model_len=256)
    first = Request("first", list(range(40, 60)), block_hasher=mgr.request_block_hasher)
    reads = []
    reader = _DuckRequest("reader", range(100, 110), lambda: reads.append(mgr.block_pool.get_num_free_blocks()))
    n, *_ = mgr.admit_batch([first, reader])
    assert n == 2 and reads and mgr.get_block_ids("reader")[0]

    mgr2 = KVCacheManager(num_blocks=32, block_size=4, max_model_len=256)
    keep = Request("keep", list(range(40, 44)), block_hasher=mgr2.request_block_hasher)
    mgr2.allocate_slots(keep, 4)
    first2 = Request("first", list(range(40, 60)), block_hasher=mgr2.request_block_hasher)
    writer = _DuckRequest("writer", range(100, 110), lambda: mgr2.free(keep))
    before = _snapshot(mgr2)
    with pytest.raises(RuntimeError, match="already borrowed"):
        mgr2.admit_batch([first2, writer])
    assert _snapshot(mgr2) == before and mgr2.get_block_ids("first") == ([],)


def test_uninitialised_core_refuses_before_allocating():
    from kvblock import _core

    core = _core.KVCacheManagerCore(
        _core.BlockPoolCore(10, True, 4), [{"kind": "full_attention", "block_size": 4}], 100, 4, 4
    )
    pool = core.block_pool
    free = pool.get_num_free_blocks()
    with pytest.raises(RuntimeError, match="not initialised"):
        core.allocate_slots(Request("z", [1, 2, 3, 4, 5]), 5)
    with pytest.raises(RuntimeError, match="not initialised"):
        core.get_computed_blocks(Request("z", [1, 2, 3, 4, 5]))
    assert core._block_ids("z") == [[]] and pool.get_num_free_blocks() == free


def test_core_caller_names_one_of_the_two_dialects():
    """The caller dialect is named ("kvblock" or "vllm"); anything else is refused before the
    manager takes a block of its pool."""
    from kvblock import _core

    pool = _core.BlockPoolCore(10, True, 4)
    groups = [{"kind": "full_attention", "block_size": 4}]
    for caller in ("kvblock", "vllm"):
        _core.KVCacheManagerCore(pool, groups, 100, 4, 4, caller=caller)
    for bad in ("strict", "", "KVBLOCK"):
        with pytest.raises(ValueError, match="caller: expected 'kvblock' or 'vllm'"):
            _core.KVCacheManagerCore(pool, groups, 100, 4, 4, caller=bad)
    assert pool.get_num_free_blocks() == 9


def test_block_pool_cannot_be_replaced():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    pool = mgr.block_pool
    with pytest.raises(AttributeError):
        mgr.block_pool = BlockPool(16, True, 4)
    assert mgr.block_pool is pool


def test_negative_block_counts_are_value_errors_naming_the_argument():
    pool = BlockPool(8, True, 4)
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    hashes = [bytes([i]) * 32 for i in range(2)]

    class Req:
        block_hashes = hashes

    before = pool.free_queue_ids()
    with pytest.raises(ValueError, match="num_full_blocks"):
        pool.cache_ids(ids, hashes, 0, -1)
    with pytest.raises(ValueError, match="num_cached_blocks"):
        pool.cache_full_blocks(Req(), blocks, -1, 2, 4, 0)
    with pytest.raises(ValueError, match="num_full_blocks"):
        pool.cache_full_blocks(Req(), blocks, 0, -2, 4, 0)
    assert pool.free_queue_ids() == before and pool.num_cached_keys() == 0


@pytest.mark.parametrize("api", ["pool", "manager"])
def test_block_stored_reports_the_tokens_of_caching_time(api):
    # vLLM builds BlockStored when it caches the blocks; a request changed before the events
    # are taken must not change what they report (as the reference does)
    from kvblock.reference.block_pool import BlockPool as RefPool

    def run(pool_cls):
        if api == "manager":
            mgr = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
            r = Request("r", list(range(8)), block_hasher=mgr.request_block_hasher)
            mgr.allocate_slots(r, 8)
            r._all_token_ids[:] = [-1] * 8
            return mgr.take_events()[0].token_ids
        r = Request("r", list(range(8)), block_hasher=KVCacheManager(num_blocks=8, block_size=4).request_block_hasher)
        pool = pool_cls(8, True, 4, True)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(r, blocks, 0, 2, 4, 0)
        r._all_token_ids[:] = [-1] * 8
        return pool.take_events()[0].token_ids

    assert run(BlockPool) == list(range(8))
    if api == "pool":
        assert run(RefPool) == list(range(8))


def test_block_stored_tokens_from_a_read_only_sequence():
    # vLLM's Request.all_token_ids is a ConstantList (a Sequence, not a list)
    from collections.abc import Sequence

    class ConstantList(Sequence):
        def __init__(self, x):
            self._x = x

        def __getitem__(self, i):
            return self._x[i]

        def __len__(self):
            return len(self._x)

    class Req:
        def __init__(self, tokens, hashes):
            self._all_token_ids, self.block_hashes = tokens, hashes
            self.lora_request = self.cache_salt = self.mm_features = self.prompt_embeds = None

        @property
        def all_token_ids(self):
            return ConstantList(self._all_token_ids)

    r = Req(list(range(8)), [bytes([1]) * 32, bytes([2]) * 32])
    pool = BlockPool(8, True, 4, True)
    pool.cache_full_blocks(r, pool.get_new_blocks(2), 0, 2, 4, 0)
    r._all_token_ids[:] = [-1] * 8
    assert pool.take_events()[0].token_ids == list(range(8))


def test_block_stored_reports_the_request_fields_of_caching_time():
    # LoRA, salt and multimodal items as they were when the blocks were cached (vLLM builds
    # the event then), on kvblock and the reference alike
    from kvblock import LoRARequest
    from kvblock.reference.manager import KVCacheManager as RefManager

    def run(cls):
        m = cls(num_blocks=8, block_size=4, enable_kv_cache_events=True)
        r = Request("r", list(range(8)), lora_request=LoRARequest("a", 1), cache_salt="s",
                    mm_features=[("img-0", 4, 4)], block_hasher=m.request_block_hasher)
        m.allocate_slots(r, 8)
        r.lora_request = r.cache_salt = r.mm_features = None
        (e,) = m.take_events()
        return e.lora_id, e.lora_name, e.extra_keys, e.token_ids

    expected = (1, "a", [("a", "s"), ("a", ("img-0", 0))], list(range(8)))
    assert run(KVCacheManager) == run(RefManager) == expected


def test_request_id_that_is_not_utf8_is_a_value_error_naming_it():
    # issue 32: a lone surrogate raised a UnicodeEncodeError naming no argument
    mgr = KVCacheManager(16, 4, enable_caching=True)
    r = Request("r\udc80", list(range(12)), block_hasher=mgr.request_block_hasher)
    free = mgr.block_pool.get_num_free_blocks()
    for call in (lambda: mgr.allocate_slots(r, 12), lambda: mgr.free(r), lambda: mgr.get_block_ids("r\udc80")):
        with pytest.raises(ValueError, match=r"^request_id: .*lone surrogate") as e:
            call()
        assert not isinstance(e.value, UnicodeError)
    assert mgr.block_pool.get_num_free_blocks() == free


def test_a_dropped_manager_and_its_pool_go_in_one_collection():
    # the manager's Rust state holds its pool (and the pool the requests behind pending
    # events): both tell the collector (__traverse__), so a manager caught in a cycle (a view
    # holding it) frees its pool, and the pool's own cycles, in the same collection
    import gc
    import weakref

    m = KVCacheManager(num_blocks=16, block_size=4, enable_kv_cache_events=True)
    pool = m.block_pool
    r = Request("r", list(range(8)), block_hasher=m.request_block_hasher)
    assert m.allocate_slots(r, 8) is not None
    m.cycle = m  # a cycle through the manager
    refs = [weakref.ref(m), weakref.ref(pool)]
    del m, pool, r
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
