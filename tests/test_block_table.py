"""Block table and slot mapping (spec §9, CASES.md C22): exact slot mappings, row operations,
kernel-block splitting, every bad input, a property test against the per-token Python
reference, the Triton kernel under the Triton interpreter, CUDA (when present), and the
GPU-check script's logic on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module

torch = require_module("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvblock.worker.block_table import (  # noqa: E402
    INT32_MAX,
    PAD_SLOT_ID,
    BlockTable,
    MultiGroupBlockTable,
    get_block_table_width,
    map_to_kernel_blocks,
    reshape_and_cache,
    slot_mapping_reference,
    triton_available,
)

REPO = Path(__file__).resolve().parent.parent
CPU_IMPLS = ("numpy", "torch")


def qsl(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def pos(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def committed(block_size: int, rows: list[list[int]], width: int, max_tokens: int, **kw) -> BlockTable:
    bt = BlockTable(block_size, max(len(rows), 1), width, max_tokens, "cpu", **kw)
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.commit_block_table(len(rows))
    return bt


# -- CASES.md C22 ---------------------------------------------------------------------------------
@pytest.fixture
def c22() -> BlockTable:
    """BS = 4, 10 blocks, 2 x 2 table: row 0 = [7, 2], row 1 = [5, 9], 12 batched tokens."""
    return committed(4, [[7, 2], [5, 9]], 2, 12)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_c22_call1_two_requests_and_padding(c22, impl):
    out = c22.compute_slot_mapping(qsl(0, 6, 9), pos(0, 1, 2, 3, 4, 5, 0, 1, 2), impl=impl)
    assert out.dtype == torch.int64 and out.shape == (12,)
    assert out.tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22, -1, -1, -1]


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_c22_call2_request0_alone(c22, impl):
    out = c22.compute_slot_mapping(qsl(0, 3), pos(5, 6, 7), impl=impl)
    assert out.tolist() == [9, 10, 11] + [-1] * 9


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_c22_call3_position_past_the_row_never_reads_the_next_row(c22, impl):
    # vLLM 0.33.0 returns 20 here (row 1's block 5 * 4 + 0).
    with pytest.raises(ValueError, match=r"positions: token 0 \(row 0\) is at position 8, block index 2, but row 0 holds 2 blocks"):
        c22.compute_slot_mapping(qsl(0, 1), pos(8), impl=impl)
    out = c22.compute_slot_mapping(qsl(0, 1), pos(8), check=False, impl=impl)
    assert out.tolist() == [-1] * 12
    # Row 1 of the same batch is unaffected; row 0's bad token only is padded.
    out = c22.compute_slot_mapping(qsl(0, 2, 3), pos(7, 8, 6), check=False, impl=impl)
    assert out.tolist()[:3] == [11, -1, 38]


def test_c22_call3_reference_agrees(c22):
    with pytest.raises(ValueError, match="positions"):
        slot_mapping_reference([[7, 2], [5, 9]], 4, [0, 1], [8], 12)
    assert slot_mapping_reference([[7, 2], [5, 9]], 4, [0, 1], [8], 12, check=False) == [-1] * 12


def test_c22_call4_padding_never_becomes_the_last_slot(c22):
    """-1 means skip: writing K/V through a padded slot mapping leaves slot 39 (block 9,
    offset 3, the cache's last slot) untouched."""
    slots = c22.compute_slot_mapping(qsl(0, 6, 9), pos(0, 1, 2, 3, 4, 5, 0, 1, 2))
    k_cache = torch.zeros(10, 4, 1, 1)
    v_cache = torch.zeros(10, 4, 1, 1)
    key = torch.arange(1, 13, dtype=torch.float32).view(12, 1, 1)  # 9 real tokens + 3 padding
    reshape_and_cache(key, -key, k_cache, v_cache, slots)
    flat = k_cache.view(-1)
    assert flat[39] == 0 and v_cache.view(-1)[39] == 0
    written = torch.nonzero(flat).squeeze(1).tolist()
    assert written == sorted([28, 29, 30, 31, 8, 9, 20, 21, 22])
    assert flat[[28, 29, 30, 31, 8, 9, 20, 21, 22]].tolist() == list(range(1, 10))
    assert int(slots[9]) == PAD_SLOT_ID
    # What a write that does not skip padding would do: index -1 is slot 39, (block 9, offset 3).
    naive = torch.zeros(10, 4, 1, 1)
    naive.view(40, 1, 1).index_put_((slots[:12],), key)
    assert naive.view(-1)[39] == 12


def test_reshape_and_cache_rejects_bad_slots():
    k = torch.ones(2, 1, 1)
    cache = torch.zeros(2, 2, 1, 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache.clone(), pos(0, 4))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache.clone(), pos(0, -2))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="key_cache"):
        reshape_and_cache(k, k, torch.zeros(2, 2, 2, 1), torch.zeros(2, 2, 2, 1), pos(0, 1))


# -- more exact slot mappings ----------------------------------------------------------------------
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_slot_mapping_block_size_not_a_power_of_two(impl):
    bt = committed(3, [[4, 1, 6], [2]], 3, 8)
    out = bt.compute_slot_mapping(qsl(0, 5, 7), pos(2, 3, 4, 5, 8, 0, 2), impl=impl)
    assert out.tolist() == [14, 3, 4, 5, 20, 6, 8, -1]


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_slot_mapping_empty_requests_and_empty_batch(impl):
    bt = committed(4, [[3], [], [5, 6]], 2, 6)
    out = bt.compute_slot_mapping(qsl(0, 0, 0, 2), pos(4, 7), impl=impl)
    assert out.tolist() == [24, 27, -1, -1, -1, -1]
    out = bt.compute_slot_mapping(qsl(0), torch.zeros(0, dtype=torch.int64), impl=impl)
    assert out.tolist() == [-1] * 6
    out = bt.compute_slot_mapping(qsl(0, 0, 0, 0), torch.zeros(0, dtype=torch.int64), impl=impl)
    assert out.tolist() == [-1] * 6


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_slot_mapping_fills_the_whole_buffer_and_overwrites_it(impl):
    bt = committed(2, [[1, 2, 3]], 3, 5)
    assert bt.compute_slot_mapping(qsl(0, 5), pos(0, 1, 2, 3, 4), impl=impl).tolist() == [2, 3, 4, 5, 6]
    out = bt.compute_slot_mapping(qsl(0, 1), pos(5), impl=impl)
    assert out.tolist() == [7, -1, -1, -1, -1]
    assert out.data_ptr() == bt.slot_mapping.data_ptr()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_negative_position(impl):
    bt = committed(4, [[1, 2]], 2, 4)
    with pytest.raises(ValueError, match=r"positions: token 1 \(row 0\) has a negative position -1"):
        bt.compute_slot_mapping(qsl(0, 2), pos(0, -1), impl=impl)
    assert bt.compute_slot_mapping(qsl(0, 2), pos(0, -1), check=False, impl=impl).tolist() == [4, -1, -1, -1]


# -- row operations ------------------------------------------------------------------------------
def table(bt: BlockTable) -> list[list[int]]:
    return bt.block_table_cpu.tolist()


def test_append_add_clear_rows():
    bt = BlockTable(4, 3, 4, 8, "cpu")
    bt.append_row([3, 4], 0)
    bt.append_row([], 0)
    bt.append_row(np.array([5], dtype=np.int32), 0)
    bt.add_row(torch.tensor([9, 8, 7, 6]), 2)
    assert table(bt) == [[3, 4, 5, 0], [0, 0, 0, 0], [9, 8, 7, 6]]
    assert bt.num_blocks_per_row.tolist() == [3, 0, 4]
    bt.add_row([1], 2)  # a shorter row: the stale tail is zeroed
    assert table(bt)[2] == [1, 0, 0, 0] and bt.row(2) == [1]
    bt.clear_row(0)
    assert table(bt)[0] == [0, 0, 0, 0] and bt.num_blocks_per_row[0] == 0
    bt.append_row([2**31 - 1], 0)
    assert bt.row(0) == [INT32_MAX]


def test_move_row_copies_and_zeroes_the_source():
    bt = BlockTable(4, 3, 3, 8, "cpu")
    bt.add_row([1, 2, 3], 0)
    bt.add_row([4, 5], 2)
    bt.move_row(2, 0)
    assert table(bt) == [[4, 5, 0], [0, 0, 0], [0, 0, 0]]
    assert bt.num_blocks_per_row.tolist() == [2, 0, 0]
    bt.move_row(0, 0)
    assert bt.row(0) == [4, 5]
    bt.commit_block_table(3)
    assert bt.block_table.tolist() == table(bt)
    assert bt.compute_slot_mapping(qsl(0, 1), pos(5)).tolist()[:1] == [21]


def test_swap_row():
    bt = BlockTable(2, 2, 3, 6, "cpu")
    bt.add_row([1, 2, 3], 0)
    bt.add_row([7], 1)
    bt.swap_row(0, 1)
    assert table(bt) == [[7, 0, 0], [1, 2, 3]]
    assert bt.num_blocks_per_row.tolist() == [1, 3]
    bt.commit_block_table(2)
    out = bt.compute_slot_mapping(qsl(0, 1, 3), pos(1, 4, 5))
    assert out.tolist() == [15, 6, 7, -1, -1, -1]
    with pytest.raises(ValueError, match="positions"):
        bt.compute_slot_mapping(qsl(0, 1), pos(2))  # row 0 now holds one block


def test_commit_is_required_and_copies_rows_and_counts():
    bt = BlockTable(4, 2, 2, 4, "cpu")
    bt.add_row([3, 4], 0)
    with pytest.raises(RuntimeError, match=r"rows \[0\] changed since the last commit_block_table"):
        bt.compute_slot_mapping(qsl(0, 1), pos(0))
    bt.commit_block_table(1)
    assert bt.get_device_tensor(1).tolist() == [[3, 4]]
    bt.add_row([5], 1)  # a row past num_reqs does not block a one-request batch
    assert bt.compute_slot_mapping(qsl(0, 1), pos(5)).tolist()[0] == 17
    with pytest.raises(RuntimeError, match=r"rows \[1\]"):
        bt.compute_slot_mapping(qsl(0, 1, 2), pos(5, 0))
    bt.commit_block_table(2)
    assert bt.compute_slot_mapping(qsl(0, 1, 2), pos(5, 0)).tolist() == [17, 20, -1, -1]
    bt.clear()
    assert bt.block_table.abs().sum() == 0 and bt.block_table_cpu.abs().sum() == 0
    assert bt.num_blocks_per_row.tolist() == [0, 0]
    with pytest.raises(ValueError, match="positions"):
        bt.compute_slot_mapping(qsl(0, 1), pos(0))


def test_failed_row_operations_change_nothing():
    bt = BlockTable(4, 2, 3, 4, "cpu")
    bt.add_row([1, 2], 0)
    for bad in ([3, 4], [-1], [2**31]):
        with pytest.raises(ValueError, match="block_ids"):
            bt.append_row(bad, 0)
    assert bt.row(0) == [1, 2] and table(bt)[0] == [1, 2, 0]


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ids, exc, match",
    [
        ([2**31], ValueError, r"block_ids: block id 2147483648 at index 0 is not int32-representable"),
        ([0, -1], ValueError, r"block_ids: block id -1 at index 1 is negative \(block ids are >= 0\)"),
        ([1, 2**70], ValueError, r"block_ids: block id 1180591620717411303424 at index 1"),
        (np.array([2**63 + 5], dtype=np.uint64), ValueError, r"block_ids: block id 9223372036854775813"),
        (torch.tensor([1, 2**40]), ValueError, r"block_ids: block id 1099511627776 at index 1"),
        ([1.0, 2.0], TypeError, r"block_ids: block ids must be integers"),
        ([True], TypeError, r"block_ids: block ids must be integers"),
        (torch.tensor([1.0]), TypeError, r"block_ids: block ids must be integers"),
        ([[1, 2]], ValueError, r"block_ids: must be 1-D"),
    ],
)
def test_bad_block_ids(ids, exc, match):
    bt = BlockTable(4, 2, 4, 4, "cpu")
    with pytest.raises(exc, match=match):
        bt.append_row(ids, 0)
    with pytest.raises(exc, match=match):
        bt.add_row(ids, 1)
    assert bt.num_blocks_per_row.tolist() == [0, 0]


def test_row_overflow():
    bt = BlockTable(4, 2, 3, 4, "cpu")
    bt.add_row([1, 2], 0)
    with pytest.raises(ValueError, match=r"block_ids: row 0 would hold 4 blocks, more than max_num_blocks_per_req=3"):
        bt.append_row([3, 4], 0)
    with pytest.raises(ValueError, match=r"block_ids: row 1 would hold 4 blocks"):
        bt.add_row([1, 2, 3, 4], 1)


def test_bad_rows():
    bt = BlockTable(4, 2, 3, 4, "cpu")
    with pytest.raises(IndexError, match=r"row_idx: row 2 is outside \[0, 2\)"):
        bt.append_row([1], 2)
    with pytest.raises(IndexError, match="row_idx"):
        bt.clear_row(-1)
    with pytest.raises(IndexError, match="src"):
        bt.move_row(5, 0)
    with pytest.raises(IndexError, match="tgt"):
        bt.swap_row(0, 2)
    with pytest.raises(TypeError, match="row_idx"):
        bt.add_row([1], 0.0)
    with pytest.raises(ValueError, match="num_reqs"):
        bt.commit_block_table(3)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_bad_slot_mapping_inputs(c22, impl):
    good_q, good_p = qsl(0, 2), pos(0, 1)
    cases = [
        (dict(query_start_loc=good_q.long()), TypeError, r"query_start_loc: must be torch.int32, got torch.int64"),
        (dict(positions=good_p.int()), TypeError, r"positions: must be torch.int64, got torch.int32"),
        (dict(positions=[0, 1]), TypeError, r"positions: must be a torch.Tensor"),
        (dict(query_start_loc=good_q.to("meta")), ValueError, r"query_start_loc: must be on the block table's device cpu, got meta"),
        (dict(positions=good_p.to("meta")), ValueError, r"positions: must be on the block table's device"),
        (dict(positions=good_p.view(1, 2)), ValueError, r"positions: must be 1-D"),
        (dict(query_start_loc=qsl(0, 2, 1, 2), positions=pos(0, 1)), ValueError, r"query_start_loc: \d+ requests exceed max_num_reqs=2"),
        (dict(query_start_loc=qsl(0, 2, 1)), ValueError, r"query_start_loc: must be non-decreasing, got 2 then 1 at index 1"),
        (dict(query_start_loc=qsl(1, 2)), ValueError, r"query_start_loc: must start at 0, got 1"),
        (dict(query_start_loc=qsl(0, 1)), ValueError, r"query_start_loc: must end at the number of positions \(2\), got 1"),
        (dict(query_start_loc=qsl()), ValueError, r"query_start_loc: needs num_reqs \+ 1 >= 1 entries"),
        (dict(query_start_loc=qsl(0, 13), positions=torch.zeros(13, dtype=torch.int64)), ValueError, r"positions: 13 tokens exceed max_num_batched_tokens=12"),
    ]
    for kw, exc, match in cases:
        args = dict(query_start_loc=good_q, positions=good_p)
        args.update(kw)
        for check in (True, False):
            with pytest.raises(exc, match=match):
                c22.compute_slot_mapping(args["query_start_loc"], args["positions"], check=check, impl=impl)


def test_bad_impl(c22):
    with pytest.raises(ValueError, match="impl: must be one of"):
        c22.compute_slot_mapping(qsl(0, 1), pos(0), impl="cuda")
    if not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="impl: 'triton' "):
            c22.compute_slot_mapping(qsl(0, 1), pos(0), impl="triton")
    assert c22.resolve_impl() == "numpy"


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(kernel_block_size=3), ValueError, r"kernel_block_size: 3 does not divide block_size 16"),
        (dict(kernel_block_size=32), ValueError, r"kernel_block_size: 32 does not divide block_size 16"),
        (dict(kernel_block_size=0), ValueError, r"kernel_block_size: must be positive"),
        (dict(kernel_block_size=8, kernel_block_stride=1), ValueError, r"kernel_block_stride: 1 is less than the 2 kernel blocks"),
        (dict(kernel_block_size=4.0), TypeError, r"kernel_block_size: must be an int"),
    ],
)
def test_bad_kernel_block_size(kw, exc, match):
    with pytest.raises(exc, match=match):
        BlockTable(16, 2, 4, 8, "cpu", **kw)
    with pytest.raises(exc, match=match):
        map_to_kernel_blocks([1], 16, kw["kernel_block_size"], kw.get("kernel_block_stride"))


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 2, 4, 8), "block_size"),
        ((4, 0, 4, 8), "max_num_reqs"),
        ((4, 2, -1, 8), "max_num_blocks_per_req"),
        ((4, 2, 4, 0), "max_num_batched_tokens"),
    ],
)
def test_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        BlockTable(*args, "cpu")


# -- kernel blocks --------------------------------------------------------------------------------
def test_map_to_kernel_blocks_examples():
    assert map_to_kernel_blocks([0, 1, 2], 32, 16) == [0, 1, 2, 3, 4, 5]  # vLLM's docstring example
    assert map_to_kernel_blocks([5, 2], 16, 4) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert map_to_kernel_blocks([5, 2], 16, 4, 6) == [30, 31, 32, 33, 12, 13, 14, 15]
    assert map_to_kernel_blocks([5, 2], 16, 16) == [5, 2]
    out = map_to_kernel_blocks(np.array([3]), 8, 2)
    assert isinstance(out, np.ndarray) and out.tolist() == [12, 13, 14, 15]
    t = map_to_kernel_blocks(torch.tensor([[1, 0], [2, 3]], dtype=torch.int32), 8, 4)
    assert t.dtype == torch.int32 and t.tolist() == [[2, 3, 0, 1], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="block_ids: block id 1073741824 at index 0 is not int32-representable after kernel-block expansion"):
        map_to_kernel_blocks([2**30], 8, 4)


def test_kernel_block_table_and_slot_mapping():
    bt = BlockTable(8, 2, 3, 8, "cpu", kernel_block_size=4)
    assert (bt.blocks_per_kv_block, bt.kernel_block_stride) == (2, 2)
    bt.add_row([5, 1], 0)
    bt.add_row([3], 1)
    bt.commit_block_table(2)
    assert bt.kernel_block_table(2).tolist() == [[10, 11, 2, 3, 0, 1], [6, 7, 0, 1, 0, 1]]
    # Slot mappings stay in manager-block units ...
    slots = bt.compute_slot_mapping(qsl(0, 3, 4), pos(3, 4, 9, 6)).tolist()
    assert slots == [43, 44, 9, 30, -1, -1, -1, -1]
    # ... and, with the default stride, equal the kernel-unit slots of the same tokens.
    kt = bt.kernel_block_table(2)
    for r, p, s in [(0, 3, 43), (0, 4, 44), (0, 9, 9), (1, 6, 30)]:
        assert int(kt[r, p // 4]) * 4 + p % 4 == s
    with pytest.raises(ValueError, match="after kernel-block expansion"):
        bt.append_row([2**30], 1)


def test_kernel_block_table_with_stride():
    bt = BlockTable(4, 1, 2, 4, "cpu", kernel_block_size=2, kernel_block_stride=3)
    bt.add_row([4, 1], 0)
    bt.commit_block_table(1)
    assert bt.kernel_block_table().tolist() == [[12, 13, 3, 4]]
    bt.add_row([(INT32_MAX - 1) // 3], 0)
    with pytest.raises(ValueError, match="block_ids"):
        bt.add_row([(INT32_MAX - 1) // 3 + 1], 0)


# -- multiple groups ------------------------------------------------------------------------------
def test_get_block_table_width():
    assert get_block_table_width(10, 16) == 16  # 128 / 16 = 8-block alignment
    assert get_block_table_width(16, 16) == 16
    assert get_block_table_width(5, 48) == 8  # gcd(128, 48) = 16 -> 8 blocks
    assert get_block_table_width(3, 256) == 3  # blocks larger than the alignment: no rounding
    assert get_block_table_width(0, 16) == 0
    assert get_block_table_width(10, 16, token_alignment=16) == 10
    with pytest.raises(ValueError, match="block_size"):
        get_block_table_width(1, 0)


def test_multi_group_fans_out():
    mg = MultiGroupBlockTable([4, 8], 2, 40, 6, "cpu")
    assert [bt.max_num_blocks_per_req for bt in mg.block_tables] == [32, 16]  # 10 -> 32, 5 -> 16
    mg.add_row(([1, 2], [7]), 0)
    mg.append_row(([3], []), 0)
    mg.add_row(([5], [6]), 1)
    mg.swap_row(0, 1)
    mg.move_row(0, 1)
    assert mg[0].row(1) == [5] and mg[1].row(1) == [6]
    assert mg[0].row(0) == [] and mg[1].row(0) == []
    mg.add_row(([1, 2, 3], [4, 9]), 0)
    mg.commit_block_table(2)
    s0, s1 = mg.compute_slot_mapping(qsl(0, 2, 3), pos(4, 9, 3))
    assert s0.tolist() == [8, 13, 23, -1, -1, -1]
    assert s1.tolist() == [36, 73, 51, -1, -1, -1]
    mg.clear_row(1)
    assert mg[0].row(1) == [] and mg[1].row(1) == []
    mg.clear()
    assert all(bt.num_blocks_per_row.sum() == 0 for bt in mg.block_tables)
    assert len(mg) == 2


def test_multi_group_validates_every_group_first():
    mg = MultiGroupBlockTable([4, 4], 1, 8, 4, "cpu", max_num_blocks=[2, 1])
    with pytest.raises(ValueError, match="block_ids: row 0 would hold 2 blocks, more than max_num_blocks_per_req=1"):
        mg.append_row(([1], [2, 3]), 0)
    with pytest.raises(ValueError, match="block_ids: has 1 groups, the table has 2"):
        mg.add_row(([1],), 0)
    assert mg[0].row(0) == [] and mg[1].row(0) == []
    with pytest.raises(ValueError, match="kernel_block_sizes: has 1 entries, block_sizes has 2"):
        MultiGroupBlockTable([4, 4], 1, 8, 4, "cpu", kernel_block_sizes=[2])
    with pytest.raises(ValueError, match="kernel_block_size: 3 does not divide block_size 4"):
        MultiGroupBlockTable([4, 4], 1, 8, 4, "cpu", kernel_block_sizes=[2, 3])


# -- property: vectorized == per-token reference ----------------------------------------------------
@st.composite
def slot_problems(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 16, 17]))
    num_reqs = draw(st.integers(1, 6))
    width = draw(st.integers(1, 6))
    rows = [
        draw(st.lists(st.integers(0, INT32_MAX), max_size=width))
        for _ in range(num_reqs)
    ]
    qsl_, positions = [0], []
    out_of_row = draw(st.booleans())
    for row in rows:
        n = draw(st.integers(0, 5))
        limit = len(row) * block_size
        for _ in range(n):
            if out_of_row:
                positions.append(draw(st.integers(-2, (width + 1) * block_size)))
            elif limit:
                positions.append(draw(st.integers(0, limit - 1)))
        qsl_.append(len(positions))
    max_tokens = len(positions) + draw(st.integers(0, 4))
    return block_size, width, rows, qsl_, positions, max(max_tokens, 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slot_problems())
def test_property_vectorized_equals_reference(problem):
    block_size, width, rows, q, p, max_tokens = problem
    bt = BlockTable(block_size, len(rows), width, max_tokens, "cpu")
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.commit_block_table(len(rows))
    qt, pt = torch.tensor(q, dtype=torch.int32), torch.tensor(p, dtype=torch.int64)
    want = slot_mapping_reference(rows, block_size, q, p, max_tokens, check=False)
    for impl in CPU_IMPLS:
        assert bt.compute_slot_mapping(qt, pt, check=False, impl=impl).tolist() == want
        try:
            expect = slot_mapping_reference(rows, block_size, q, p, max_tokens)
        except ValueError:
            with pytest.raises(ValueError, match="^positions: "):
                bt.compute_slot_mapping(qt, pt, impl=impl)
        else:
            assert bt.compute_slot_mapping(qt, pt, impl=impl).tolist() == expect


# -- the Triton kernel, run by the Triton interpreter on the CPU -----------------------------------
def test_triton_kernel_under_the_interpreter():
    require_module("triton")
    script = textwrap.dedent(
        """
        import sys, numpy as np, torch
        sys.path.insert(0, {scripts!r})
        import gpu_check as g
        from kvblock.worker.block_table import BlockTable
        # C22 exactly
        bt = BlockTable(4, 2, 2, 12, "cpu")
        bt.add_row([7, 2], 0); bt.add_row([5, 9], 1); bt.commit_block_table(2)
        q = torch.tensor([0, 6, 9], dtype=torch.int32); p = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
        assert bt.compute_slot_mapping(q, p, impl="triton").tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22, -1, -1, -1]
        q1, p8 = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([8])
        assert bt.compute_slot_mapping(q1, p8, check=False, impl="triton").tolist() == [-1] * 12
        try:
            bt.compute_slot_mapping(q1, p8, impl="triton")
            raise SystemExit("no error")
        except ValueError as e:
            assert str(e).startswith("positions: token 0 (row 0) is at position 8"), e
        # random tables, in-row and out-of-row; requests and padding longer than a 1024 tile
        for seed, oor in ((0, 0), (1, 13)):
            case = g.make_case(5000, num_reqs=3, block_size=16, width=512, out_of_row=oor, seed=seed)
            case.max_num_batched_tokens = 7500
            assert max(np.diff(case.query_start_loc)) > 1024
            got = g.slot_mapping_on(case, "cpu", "triton", check=False)
            want = g.reference_slots(case, check=False)
            assert (got == want).all(), (seed, int((got != want).sum()))
            assert (got == g.slot_mapping_on(case, "cpu", "numpy", check=False)).all()
        print("TRITON-INTERPRETER-OK")
        """
    ).format(scripts=str(REPO / "scripts"))
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "TRITON-INTERPRETER-OK" in res.stdout, res.stdout + res.stderr


# -- CUDA ------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cuda_matches_cpu(impl):
    if impl == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    gc = load_gpu_check()
    for seed, oor in ((0, 0), (1, 57)):
        case = gc.make_case(20_000, seed=seed, out_of_row=oor)
        want = gc.reference_slots(case, check=False)
        assert (gc.slot_mapping_on(case, "cuda", impl, check=False) == want).all()
    c22 = BlockTable(4, 2, 2, 12, "cuda", pin_memory=True)
    assert c22.block_table_cpu.is_pinned()
    c22.add_row([7, 2], 0)
    c22.add_row([5, 9], 1)
    c22.commit_block_table(2)
    q = torch.tensor([0, 6, 9], dtype=torch.int32, device="cuda")
    p = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2], device="cuda")
    assert c22.compute_slot_mapping(q, p, impl=impl).tolist() == [28, 29, 30, 31, 8, 9, 20, 21, 22, -1, -1, -1]
    with pytest.raises(ValueError, match="positions"):
        c22.compute_slot_mapping(q[:2], torch.tensor([8], device="cuda").expand(6).contiguous(), impl=impl)
    with pytest.raises(ValueError, match="query_start_loc: must be non-decreasing"):
        c22.compute_slot_mapping(torch.tensor([0, 6, 5], dtype=torch.int32, device="cuda"), p, impl=impl)
    with pytest.raises(ValueError, match="positions: must be on the block table's device"):
        c22.compute_slot_mapping(q, p.cpu(), impl=impl)


# -- the GPU-check script, on the CPU -------------------------------------------------------------
def load_gpu_check():
    """A fresh copy of scripts/gpu_check.py as a module (scripts/ is not a package)."""
    name = "kvblock_gpu_check"
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_logic_on_cpu():
    gc = load_gpu_check()
    case = gc.make_case(5000, num_reqs=16, seed=3)
    assert case.num_tokens == 5000 and case.query_start_loc[-1] == 5000
    rows = gc.check_slot_mappings(case, "cpu")
    assert [r.ok for r in rows] == [True, True]
    oor = gc.make_case(2000, num_reqs=8, out_of_row=11, seed=4)
    ref = gc.reference_slots(oor, check=False)
    assert int((ref[: oor.num_tokens] == PAD_SLOT_ID).sum()) == 11
    assert all(r.ok for r in gc.check_out_of_row(oor, "cpu"))
    assert gc.check_kernel_block_table("cpu").ok
    timing = gc.time_slot_mapping(case, "cpu", "numpy", True, 3)
    assert timing.ok is None and "ns/token" in timing.result


def test_gpu_check_detects_a_wrong_slot_mapping(monkeypatch):
    """The comparison can fail: an off-by-one slot mapping is reported as a mismatch."""
    gc = load_gpu_check()
    case = gc.make_case(500, num_reqs=4, seed=5)
    real = BlockTable.compute_slot_mapping

    def off_by_one(self, *a, **k):
        out = real(self, *a, **k)
        out[0] += 1
        return out

    monkeypatch.setattr(BlockTable, "compute_slot_mapping", off_by_one)
    rows = gc.check_slot_mappings(case, "cpu")
    assert [r.ok for r in rows] == [False, False]
    assert rows[0].result == "1 mismatches"


def test_gpu_check_main_dry_run_on_cpu(capsys):
    gc = load_gpu_check()
    from kvblock.worker.demo import DemoConfig, ModelConfig

    monkey_cfg = DemoConfig(
        model=ModelConfig(vocab_size=64, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32),
        num_conversations=2, num_turns=2, system_len=8, question_len=(2, 4), max_tokens=3, block_size=4,
        num_blocks=32, max_num_seqs=2, max_num_batched_tokens=32,
    )
    real = gc.check_demo
    gc.check_demo = lambda device, config=None: real(device, monkey_cfg)
    assert gc.main(["--device", "cpu", "--tokens", "3000", "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "ALL CHECKS PASSED" in out and "demo on cpu: caching on == off" in out
    if not torch.cuda.is_available():
        assert gc.main(["--device", "cuda"]) == 2


def test_kvblock_imports_without_torch():
    """torch is optional: ``import kvblock`` neither needs nor loads it; the torch modules
    say which extra to install."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        import kvblock, kvblock.cli, kvblock.manager, kvblock.request
        for name in ("kvblock.worker.block_table", "kvblock.worker.demo"):
            try:
                __import__(name)
            except ImportError as e:
                assert "pip install torch (kvblock's 'torch' extra)" in str(e), e
            else:
                raise SystemExit(name + " imported without torch")
        print("NO-TORCH-OK")
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "NO-TORCH-OK" in res.stdout, res.stdout + res.stderr
    res = subprocess.run(
        [sys.executable, "-c", "import sys, kvblock; print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.stdout.strip() == "False", res.stdout + res.stderr
