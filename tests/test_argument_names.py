"""Errors name the argument they refuse, with the type a caller expects (new-user finding L3).

Each case raised an error that named nothing (PyO3's "can't convert negative int to
unsigned", "'int' object is not an instance of 'str'", a raw ``'<='`` comparison error), named
another argument (``num_gpu_blocks`` for ``num_blocks``) or another count (two blocks more than
asked). Each now names the argument, and changes nothing. (``Request``'s arguments:
tests/test_request_arguments.py.)
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvblock import BlockPool, KVCacheManager, _core
from kvblock.cluster import PrefixIndex


def _index() -> PrefixIndex:
    ix = PrefixIndex(16)
    ix.store("e0", [1, 2, 3])
    return ix


def _index_state(ix: PrefixIndex) -> tuple:
    return ix.instances(), ix.num_pairs(), ix.blocks_of("e0"), ix.totals()


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda ix: ix.apply("e0", b"", now_ms=-1), ValueError, r"^now_ms: must be >= 0, got -1"),
        (lambda ix: ix.expire(0, -1), ValueError, r"^ttl_ms: must be >= 0, got -1"),
        (lambda ix: ix.expire(-1, 0), ValueError, r"^now_ms: must be >= 0, got -1"),
        (lambda ix: ix.touch("e0", -5), ValueError, r"^now_ms: must be >= 0, got -5"),
        (lambda ix: ix.touch("e0", 1.5), TypeError, r"^now_ms: expected int, got float"),
        (lambda ix: ix.match([1, 2], 5), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.match_dense([1, 2], b"GPU"), TypeError, r"^medium: expected str or None, got bytes"),
        (lambda ix: ix.store("e0", [4], medium=3), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.remove("e0", [1], medium=3), TypeError, r"^medium: expected str or None, got int"),
        (lambda ix: ix.blocks_of("e0", 7), TypeError, r"^medium: expected str or None, got int"),
    ],
    ids=["apply-now", "expire-ttl", "expire-now", "touch-now", "touch-float", "match-medium", "match_dense-medium",
         "store-medium", "remove-medium", "blocks_of-medium"],
)
def test_prefix_index_names_the_argument(call, exc, msg):
    ix = _index()
    before = _index_state(ix)
    with pytest.raises(exc, match=msg):
        call(ix)
    assert _index_state(ix) == before


def test_prefix_index_defaults_still_work():
    ix = _index()
    assert ix.match([1, 2, 3]) == {"e0": 3} and ix.match([1, 2, 3], "GPU") == {"e0": 3}
    assert ix.match([1, 2, 3], None) == {"e0": 3}
    assert ix.expire(10, 5) == ["e0"]


@pytest.mark.parametrize("watermark", ["0.1", None, [0.1]])
def test_watermark_of_another_type_is_a_type_error(watermark):
    with pytest.raises(TypeError, match=r"^watermark: a fraction of the blocks"):
        KVCacheManager(16, 16, watermark=watermark)
    assert KVCacheManager(16, 16, watermark=0.5).watermark_blocks == 8


def test_num_blocks_past_the_block_id_range_names_num_blocks():
    with pytest.raises(ValueError, match=r"^num_blocks: 8589934592 exceeds the int32 block-id range"):
        KVCacheManager(num_blocks=2**33, block_size=16)


def test_a_pool_too_large_for_memory_names_the_blocks_asked_for():
    """Under a 6 GiB address-space limit the pool's first allocation fails: the message counts
    the blocks asked for (it said two more: the free queue's two sentinel links)."""
    code = (
        "import resource, kvblock\n"
        "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
        "try:\n"
        "    kvblock.BlockPool(2**31 - 1, True, 16)\n"
        "except MemoryError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("for 2147483647 blocks"), out.stdout



@pytest.mark.parametrize("bad", ["1", b"1", 5.0])
def test_a_block_id_list_of_another_type_says_ints(bad):
    """The message said "expected a sequence of int integers"."""
    from kvblock import BlockPool

    pool = BlockPool(8, True, 16)
    with pytest.raises(TypeError, match=r"^block_ids: expected a sequence of ints, got (str|bytes|float)$"):
        pool.free_ids(bad)
    assert pool.get_num_free_blocks() == 7


# ---- unsigned arguments of kvblock._core (were PyO3's nameless OverflowError for -1) --------

_BS = 16


def _pool() -> BlockPool:
    return BlockPool(8, True, _BS)


def _pool_state(p: BlockPool) -> tuple:
    return (p.get_num_free_blocks(), p.free_queue_ids(), p.cached_items(), [p.ref_cnt(i) for i in range(8)],
            p._watched_blocks(), p._residency_on(), p._residency_ids(),
            [p._residency_get(i) for i in p._residency_ids()])


def _metered_pool() -> BlockPool:
    p = _pool()
    p._residency_enable(1.0, 7)
    p._residency_hook("allocated", 1)
    return p


@pytest.mark.parametrize(
    "make, call, exc, msg",
    [
        (_pool, lambda p: p.unpin_ids([1], -1), ValueError, r"^watcher: must be >= 0, got -1"),
        (_pool, lambda p: p.unpin_ids([1], True), TypeError, r"^watcher: expected int, got bool"),
        (_pool, lambda p: p.unpin_ids([1], 1.0), TypeError, r"^watcher: expected int, got float"),
        (_pool, lambda p: p.map_reattach(b"k" * 32 + b"\0" * 4, [-1]), ValueError, r"^block_ids\[0\]: -1 is not a block id"),
        (_pool, lambda p: p.map_reattach(b"k" * 32 + b"\0" * 4, [True]), TypeError, r"^block_ids\[0\]: block ids must be int"),
        (_pool, lambda p: p._residency_enable(0.5, -1), ValueError, r"^seed: -1 is out of range"),
        (_pool, lambda p: p._residency_enable(0.5, 2**64), ValueError, r"^seed: "),
        (_pool, lambda p: p._residency_enable(0.5, 1.5), TypeError, r"^seed: expected int, got float"),
        (_metered_pool, lambda p: p._residency_set(1, -1, 0, []), ValueError, r"^birth_time_ns: must be >= 0, got -1"),
        (_metered_pool, lambda p: p._residency_set(1, 0, True, []), TypeError, r"^last_access_ns: expected int, got bool"),
        (_metered_pool, lambda p: p._residency_set(1, 0, 0, [5, -3]), ValueError, r"^history\[1\]: must be >= 0, got -3"),
        (_metered_pool, lambda p: p._residency_set(1, 0, 0, 5), TypeError, r"^history: expected a sequence of ints"),
    ],
    ids=["unpin-watcher-neg", "unpin-watcher-bool", "unpin-watcher-float", "reattach-neg", "reattach-bool",
         "enable-seed-neg", "enable-seed-2**64", "enable-seed-float", "set-birth-neg", "set-last-bool",
         "set-history-neg", "set-history-int"],
)
def test_block_pool_unsigned_arguments_are_named(make, call, exc, msg):
    p = make()
    before = _pool_state(p)
    with pytest.raises(exc, match=msg):
        call(p)
    assert _pool_state(p) == before


def test_the_largest_seed_is_taken():
    p = _pool()
    p._residency_enable(0.5, 2**64 - 1)
    assert p._residency_on()


def _requests() -> _core.CapacityRequests:
    return _core.CapacityRequests(_BS, np.array([32], np.int64), np.array([0, 2], np.int64), np.array([1, 2], np.uint32))


_IDS = (np.array([1, 2], np.int64), np.array([0, 2], np.int64), np.array([32], np.int64))


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda: _core.CapacityRequests(-16, *_requests_args()), ValueError, r"^block_size: must be >= 0, got -16"),
        (lambda: _core.CapacityRequests(16.0, *_requests_args()), TypeError, r"^block_size: expected int, got float"),
        (lambda: _core.CapacityRequests.from_trie_ids(*_IDS, -1, _BS), ValueError, r"^trace_block_size: must be >= 0"),
        (lambda: _core.CapacityRequests.from_trie_ids(*_IDS, _BS, True), TypeError, r"^block_size: expected int, got bool"),
        (lambda: _core.capacity_trie_ids(*_IDS, _BS, -1), ValueError, r"^block_size: must be >= 0, got -1"),
        (lambda: _requests().lru_curve(-1), ValueError, r"^warm_from: must be >= 0, got -1"),
        (lambda: _requests().lru_curve(True), TypeError, r"^warm_from: expected int, got bool"),
        (lambda: _requests().simulate([4, -1], "lru", 0, 1), ValueError, r"^capacities\[1\]: must be >= 0, got -1"),
        (lambda: _requests().simulate([4], "lru", -1, 1), ValueError, r"^warm_from: must be >= 0, got -1"),
        (lambda: _requests().simulate([4], "lru", 0, -1), ValueError, r"^threads: must be >= 0, got -1"),
        (lambda: _requests().simulate([4], "lru", 0, 1.0), TypeError, r"^threads: expected int, got float"),
        (lambda: _requests().lru_curve(0).point(-1), ValueError, r"^num_blocks: must be >= 0, got -1"),
        (lambda: _requests().lru_curve(0).exact_at(2.0), TypeError, r"^num_blocks: expected int, got float"),
        (lambda: PrefixIndex(16).instance_name(-1), ValueError, r"^id: -1 is out of range"),
        (lambda: PrefixIndex(16).instance_name(False), TypeError, r"^id: expected int, got bool"),
    ],
    ids=["requests-bs-neg", "requests-bs-float", "trie-tbs-neg", "trie-bs-bool", "trie_ids-bs-neg", "curve-warm-neg",
         "curve-warm-bool", "simulate-cap-neg", "simulate-warm-neg", "simulate-threads-neg", "simulate-threads-float",
         "point-neg", "exact_at-float", "instance_name-neg", "instance_name-bool"],
)
def test_capacity_and_index_unsigned_arguments_are_named(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def _requests_args() -> tuple:
    return np.array([32], np.int64), np.array([0, 2], np.int64), np.array([1, 2], np.uint32)


_GOOD = (0, _BS, [2], [4], [(1, 2)], 8, 64, 0)


def _residency() -> tuple:
    dev, host = BlockPool(8, False, _BS), BlockPool(8, False, _BS)
    r = _core.HiSparseResidency(*_GOOD, dev, host)
    r.set_table(2, "r", [1, 2])
    return r, dev, host


def _residency_state(r) -> tuple:
    return r.request_states(), r.pending_spills(), r.copies(), r.reserved_import_pages(), r.hot_required(0)


def _bad_layout(i: int, value) -> tuple:
    args = list(_GOOD)
    args[i] = value
    return tuple(args)


@pytest.mark.parametrize(
    "i, value, exc, msg",
    [
        (0, -1, ValueError, r"^host_group: must be >= 0, got -1"),
        (1, True, TypeError, r"^block_size: expected int, got bool"),
        (2, [-2], ValueError, r"^resident_groups\[0\]: must be >= 0, got -2"),
        (3, [4.0], TypeError, r"^admission_caps\[0\]: expected int, got float"),
        (4, [(1, -2)], ValueError, r"^hot_groups\[0\]\[1\]: must be >= 0, got -2"),
        (4, [(1, 2, 3)], TypeError, r"^hot_groups\[0\]: expected a tuple of 2 items, got 3"),
        (5, -8, ValueError, r"^num_blocks: must be >= 0, got -8"),
        (6, 64.0, TypeError, r"^max_model_len: expected int, got float"),
        (7, -1, ValueError, r"^num_reprefillable_tokens: must be >= 0, got -1"),
    ],
)
def test_hisparse_residency_layout_arguments_are_named(i, value, exc, msg):
    dev, host = BlockPool(8, False, _BS), BlockPool(8, False, _BS)
    with pytest.raises(exc, match=msg):
        _core.HiSparseResidency(*_bad_layout(i, value), dev, host)


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda r: r.set_table(-1, "r", [1]), ValueError, r"^group: must be >= 0, got -1"),
        (lambda r: r.set_table(2, "r", [1, -1]), ValueError, r"^ids\[1\]: -1 is out of range"),
        (lambda r: r.set_table(2, "r", [True]), TypeError, r"^ids\[0\]: expected int, got bool"),
        (lambda r: r.advance_scheduled([("r", -1)]), ValueError, r"^requests\[0\]\[1\]: must be >= 0, got -1"),
        (lambda r: r.advance_scheduled([(1, 1)]), TypeError, r"^requests\[0\]\[0\]: expected str, got int"),
        (lambda r: r.publish_when_ready("r", -1), ValueError, r"^num_computed_tokens: must be >= 0, got -1"),
        (lambda r: r.commit_computed_blocks("r", 1.0), TypeError, r"^num_host_pages: expected int, got float"),
        (lambda r: r.update_spills([(-1, 1)], []), ValueError, r"^enqueued\[0\]\[0\]: must be >= 0, got -1"),
        (lambda r: r.update_spills([], [(1, -1)]), ValueError, r"^completed\[0\]\[1\]: must be >= 0, got -1"),
        (lambda r: r.get_residency_row(-1, "r", 0), ValueError, r"^k: must be >= 0, got -1"),
        (lambda r: r.get_residency_row(0, "r", -1), ValueError, r"^start: must be >= 0, got -1"),
        (lambda r: r.hot_required(True), TypeError, r"^k: expected int, got bool"),
        (lambda r: r.record_pending_host_import("r", -1), ValueError, r"^num_tokens: must be >= 0, got -1"),
        (lambda r: r.size_import("r", -1), ValueError, r"^num_pages: must be >= 0, got -1"),
        (lambda r: r.update_import_reservation("r", 1.5), TypeError, r"^num_held_pages: expected int, got float"),
        (lambda r: r.build_row_mirrors([("r", 1, -1)]), ValueError, r"^requests\[0\]\[2\]: must be >= 0, got -1"),
        (lambda r: r.all_context_pages_resident([("r", -1, 1)]), ValueError, r"^requests\[0\]\[1\]: must be >= 0"),
    ],
    ids=["set_table-group", "set_table-ids-neg", "set_table-ids-bool", "advance-neg", "advance-name",
         "publish-neg", "commit-float", "spills-enqueued", "spills-completed", "row-k", "row-start",
         "hot_required-bool", "pending-import", "size_import", "reservation-float", "mirrors", "resident"],
)
def test_hisparse_residency_unsigned_arguments_are_named(call, exc, msg):
    r, dev, host = _residency()
    before = (_residency_state(r), _pool_state(dev), _pool_state(host))
    with pytest.raises(exc, match=msg):
        call(r)
    assert (_residency_state(r), _pool_state(dev), _pool_state(host)) == before
