#!/usr/bin/env python3
"""GPU check of kvblock's block table, slot mapping and paged-attention demo (< 5 minutes).

Run on a machine with CUDA (after ``pip install -e .[torch]``)::

    python scripts/gpu_check.py              # device cuda
    python scripts/gpu_check.py --device cpu --tokens 5000   # a dry run without a GPU

It prints one table and exits 0 if every check passed, 1 if one failed, 2 if the device is
missing. Checks:

* slot mappings of every implementation on the device (``triton`` when it imports, fused
  ``torch`` ops) and on the CPU (``numpy``, ``torch``) equal the per-token Python reference
  on random block tables (``--tokens`` scheduled tokens, 10^5 by default), padding included;
* positions outside their row give ``PAD_SLOT_ID`` with ``check=False`` and raise with
  ``check=True`` on every implementation (vLLM 0.33.0 reads the next row there, C22);
* the kernel block table on the device equals ``map_to_kernel_blocks`` on the CPU;
* slot-mapping time per call (CUDA events on CUDA) for 8,192 and ``--tokens`` tokens, with
  and without the value check (the check costs one device-to-host sync);
* the demo with prefix caching on and off on the device (identical greedy tokens, logits
  within 1e-4, prefill saved == reported hits), and its tokens/logits against a CPU run.

The functions are importable (the tests run them on the CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvblock.worker.block_table import (
    PAD_SLOT_ID,
    BlockTable,
    map_to_kernel_blocks,
    slot_mapping_reference,
    triton_available,
)


@dataclass
class SlotCase:
    """A random slot-mapping problem.

    Attributes:
        block_size: tokens per block.
        rows: each request's block ids (int64 numpy).
        width: block-table columns.
        query_start_loc: int32 numpy ``[num_reqs + 1]``.
        positions: int64 numpy ``[num_tokens]``.
        max_num_batched_tokens: slot-mapping length (a little more than the tokens, so that
            padding is checked).
        num_out_of_row: tokens placed at or past their row's blocks.
    """

    block_size: int
    rows: list[np.ndarray]
    width: int
    query_start_loc: np.ndarray
    positions: np.ndarray
    max_num_batched_tokens: int
    num_out_of_row: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.positions.size)


@dataclass
class Row:
    """One line of the report: a check (``ok`` True/False) or a measurement (``ok`` None)."""

    check: str
    result: str
    ok: bool | None = None


def make_case(
    num_tokens: int,
    *,
    num_reqs: int = 64,
    block_size: int = 16,
    width: int = 1024,
    num_blocks: int = 1 << 24,
    out_of_row: int = 0,
    seed: int = 0,
) -> SlotCase:
    """A random :class:`SlotCase`: ``num_reqs`` rows of random block counts (<= ``width``,
    enough in all for ``num_tokens``) and ids (< ``num_blocks``), tokens split at random between requests, each request's
    positions a contiguous run inside its row (a chunk of a prefill or a decode), then
    ``out_of_row`` tokens moved to positions at or past their row's blocks.
    """
    rng = np.random.default_rng(seed)
    need = -(-num_tokens // (num_reqs * block_size))  # blocks per row that hold every token
    if need > width:
        raise ValueError(f"num_tokens: {num_tokens} do not fit in {num_reqs} rows of {width} blocks")
    counts = rng.integers(max(1, need), width + 1, num_reqs)
    rows = [rng.integers(0, num_blocks, int(c)).astype(np.int64) for c in counts]
    lens = rng.multinomial(num_tokens, np.full(num_reqs, 1.0 / num_reqs))
    # Each request's run must fit in its row: cap it and give the excess to the longest row.
    cap = counts * block_size
    lens = np.minimum(lens, cap)
    short = num_tokens - int(lens.sum())
    order = np.argsort(-(cap - lens))
    for r in order:
        if short <= 0:
            break
        add = min(short, int(cap[r] - lens[r]))
        lens[r] += add
        short -= add
    if short > 0:
        raise ValueError(f"num_tokens: {num_tokens} do not fit in {num_reqs} rows of at most {width} blocks")
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.empty(num_tokens, dtype=np.int64)
    for r in range(num_reqs):
        n = int(lens[r])
        start = int(rng.integers(0, int(cap[r]) - n + 1))
        pos[qsl[r] : qsl[r + 1]] = np.arange(start, start + n)
    if out_of_row:
        idx = rng.choice(num_tokens, size=min(out_of_row, num_tokens), replace=False)
        req = np.searchsorted(qsl[1:], idx, side="right")
        pos[idx] = counts[req] * block_size + rng.integers(0, 3 * block_size, idx.size)
    return SlotCase(block_size, rows, width, qsl, pos, num_tokens + 37, int(out_of_row))


def build_block_table(case: SlotCase, device: Any, **kwargs: Any) -> BlockTable:
    """A :class:`BlockTable` on ``device`` holding ``case.rows``, committed."""
    bt = BlockTable(
        case.block_size, len(case.rows), case.width, case.max_num_batched_tokens, device, pin_memory=True, **kwargs
    )
    for r, ids in enumerate(case.rows):
        bt.add_row(ids, r)
    bt.commit_block_table(len(case.rows))
    return bt


def device_inputs(case: SlotCase, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_start_loc int32, positions int64)`` tensors on ``device``."""
    return (
        torch.from_numpy(case.query_start_loc).to(device),
        torch.from_numpy(case.positions).to(device),
    )


def reference_slots(case: SlotCase, check: bool = True) -> np.ndarray:
    """The per-token Python reference (:func:`slot_mapping_reference`) as int64 numpy."""
    rows = [r.tolist() for r in case.rows]
    return np.asarray(
        slot_mapping_reference(
            rows, case.block_size, case.query_start_loc.tolist(), case.positions.tolist(),
            case.max_num_batched_tokens, check=check,
        ),
        dtype=np.int64,
    )


def implementations(device: Any) -> list[tuple[str, str]]:
    """``(device, impl)`` pairs to check: the CPU paths, plus the device's paths."""
    pairs = [("cpu", "numpy"), ("cpu", "torch")]
    dev = torch.device(device)
    if dev.type != "cpu":
        pairs.append((str(dev), "torch"))
        if dev.type == "cuda" and triton_available():
            pairs.append((str(dev), "triton"))
    return pairs


def slot_mapping_on(case: SlotCase, device: Any, impl: str, check: bool = True) -> np.ndarray:
    """``compute_slot_mapping`` of ``case`` on ``device`` with ``impl``, as int64 numpy."""
    bt = build_block_table(case, device)
    qsl, pos = device_inputs(case, device)
    return bt.compute_slot_mapping(qsl, pos, check=check, impl=impl).cpu().numpy().copy()


def check_slot_mappings(case: SlotCase, device: Any) -> list[Row]:
    """Every implementation against the reference on ``case`` (no out-of-row tokens)."""
    want = reference_slots(case)
    rows = []
    for dev, impl in implementations(device):
        got = slot_mapping_on(case, dev, impl)
        bad = int(np.count_nonzero(got != want))
        rows.append(Row(f"slot mapping {dev}/{impl} == reference ({case.num_tokens} tokens)",
                        f"{bad} mismatches", bad == 0))
    return rows


def check_out_of_row(case: SlotCase, device: Any) -> list[Row]:
    """``case`` has out-of-row tokens: ``check=False`` must give the reference's PAD slots,
    ``check=True`` must raise ``ValueError`` naming ``positions``."""
    want = reference_slots(case, check=False)
    rows = []
    for dev, impl in implementations(device):
        got = slot_mapping_on(case, dev, impl, check=False)
        bad = int(np.count_nonzero(got != want))
        pads = int(np.count_nonzero(got[: case.num_tokens] == PAD_SLOT_ID))
        try:
            slot_mapping_on(case, dev, impl, check=True)
            raised = "no error"
        except ValueError as e:
            raised = "raised" if str(e).startswith("positions:") else f"wrong error: {e}"
        ok = bad == 0 and pads == case.num_out_of_row and raised == "raised"
        rows.append(Row(f"out-of-row positions {dev}/{impl}",
                        f"{pads}/{case.num_out_of_row} PAD, {bad} mismatches, check=True {raised}", ok))
    return rows


def check_kernel_block_table(device: Any, seed: int = 1) -> Row:
    """The expanded kernel block table on ``device`` equals :func:`map_to_kernel_blocks`."""
    case = make_case(512, num_reqs=8, block_size=32, width=64, num_blocks=1 << 20, seed=seed)
    bt = build_block_table(case, device, kernel_block_size=8, kernel_block_stride=5)
    got = bt.kernel_block_table(len(case.rows)).cpu().numpy()
    want = np.zeros_like(got)
    for r, ids in enumerate(case.rows):
        full = np.zeros(case.width, dtype=np.int64)
        full[: ids.size] = ids
        want[r] = map_to_kernel_blocks(full, 32, 8, 5)
    bad = int(np.count_nonzero(got != want))
    return Row(f"kernel block table {torch.device(device)} (32 -> 8-token blocks, stride 5)", f"{bad} mismatches", bad == 0)


def time_call(fn: Callable[[], Any], device: Any, reps: int) -> float:
    """Median seconds per call of ``fn`` (CUDA events on CUDA, perf_counter otherwise)."""
    dev = torch.device(device)
    for _ in range(3):
        fn()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def time_slot_mapping(case: SlotCase, device: Any, impl: str, check: bool, reps: int) -> Row:
    """One timing row: microseconds per call and nanoseconds per token."""
    bt = build_block_table(case, device)
    qsl, pos = device_inputs(case, device)
    sec = time_call(lambda: bt.compute_slot_mapping(qsl, pos, check=check, impl=impl), device, reps)
    return Row(
        f"time {torch.device(device)}/{impl} check={check} ({case.num_tokens} tokens)",
        f"{sec * 1e6:.1f} us/call, {sec * 1e9 / case.num_tokens:.2f} ns/token",
    )


def check_demo(device: Any, config: Any = None) -> list[Row]:
    """The demo on ``device`` (caching on vs off), and its outputs against a CPU run."""
    from kvblock.worker.demo import DemoConfig, run_demo

    config = config or DemoConfig(verify_dense=True)
    rep = run_demo(device, config)
    dense = rep.on.max_dense_logits_diff
    if dense is not None and rep.off.max_dense_logits_diff is not None:
        dense = max(dense, rep.off.max_dense_logits_diff)
    dense_ok = dense is None or dense <= 1e-4
    rows = [
        Row(
            f"demo on {rep.device}: caching on == off",
            f"tokens identical={rep.tokens_identical}, max|dlogits|={rep.max_logits_diff:.1e}, "
            f"prefill saved={rep.prefill_saved}, hits={rep.on.reported_hits}"
            + (f", |logits-dense|={dense:.1e}" if dense is not None else "")
            + (f"; {'; '.join(rep.failures)}" if rep.failures else ""),
            rep.ok and dense_ok,
        )
    ]
    if torch.device(device).type != "cpu":
        cpu = run_demo("cpu", config)
        same = cpu.on.outputs == rep.on.outputs
        diff = max(float((cpu.on.logits[k] - rep.on.logits[k]).abs().max()) for k in cpu.on.logits) if same else float("inf")
        rows.append(Row(f"demo {rep.device} vs cpu", f"tokens identical={same}, max|dlogits|={diff:.1e}", same and diff <= 1e-3))
    return rows


def run_checks(device: Any, num_tokens: int = 100_000, reps: int = 50, demo: bool = True) -> list[Row]:
    """Every check and timing of this script, as report rows."""
    rows: list[Row] = []
    case = make_case(num_tokens, seed=0)
    rows += check_slot_mappings(case, device)
    rows += check_out_of_row(make_case(min(num_tokens, 20_000), out_of_row=97, seed=1), device)
    rows.append(check_kernel_block_table(device))
    small = make_case(8192, seed=2)
    for dev, impl in implementations(device):
        for c in (small, case):
            for check in (True, False):
                rows.append(time_slot_mapping(c, dev, impl, check, reps if dev != "cpu" else max(3, reps // 5)))
    if demo:
        rows += check_demo(device)
    return rows


def print_table(rows: Sequence[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("check")
    table.add_column("result")
    table.add_column("pass", justify="center")
    for r in rows:
        mark = "" if r.ok is None else ("[green]yes[/green]" if r.ok else "[red]NO[/red]")
        table.add_row(r.check, r.result, mark)
    Console(width=200).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="device to check (default cuda)")
    p.add_argument("--tokens", type=int, default=100_000, help="scheduled tokens of the big random case")
    p.add_argument("--reps", type=int, default=50, help="timed calls per measurement")
    p.add_argument("--no-demo", action="store_true", help="skip the demo")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine (use --device cpu for a dry run)")
        return 2
    t0 = time.perf_counter()
    rows = run_checks(dev, args.tokens, args.reps, demo=not args.no_demo)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print_table(
        rows,
        f"kvblock GPU check on {name} (torch {torch.__version__}, triton "
        f"{'yes' if triton_available() else 'no'}, {time.perf_counter() - t0:.1f} s)",
    )
    failed = [r for r in rows if r.ok is False]
    print("ALL CHECKS PASSED" if not failed else f"{len(failed)} CHECK(S) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
