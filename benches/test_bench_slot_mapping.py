"""Slot mapping on the CPU: 8,192 scheduled tokens (a continuous-batching step of 56 decodes
and 8 prefill chunks over 64 rows, block size 16), kvblock's vectorized path vs the
per-token Python reference. Time is reported per token."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvblock.worker.block_table import BlockTable, slot_mapping_reference  # noqa: E402

BLOCK_SIZE = 16
NUM_REQS = 64
WIDTH = 512  # blocks per row: 8,192-token requests
NUM_TOKENS = 8192


def _step():
    """Rows, query_start_loc and positions of one scheduler step (seeded)."""
    rng = np.random.default_rng(1234567)
    counts = rng.integers(WIDTH // 2, WIDTH + 1, NUM_REQS)
    rows = [rng.integers(1, 1 << 20, int(c)).tolist() for c in counts]
    lens = np.ones(NUM_REQS, dtype=np.int64)  # 56 decodes ...
    lens[-8:] = (NUM_TOKENS - (NUM_REQS - 8)) // 8  # ... and 8 prefill chunks of 1017 tokens
    lens[-1] += NUM_TOKENS - int(lens.sum())
    qsl = [0] + np.cumsum(lens).tolist()
    pos: list[int] = []
    for r in range(NUM_REQS):
        n = int(lens[r])
        start = int(rng.integers(0, int(counts[r]) * BLOCK_SIZE - n + 1))
        pos.extend(range(start, start + n))
    assert qsl[-1] == len(pos) == NUM_TOKENS
    return rows, qsl, pos


def _table(rows) -> BlockTable:
    bt = BlockTable(BLOCK_SIZE, NUM_REQS, WIDTH, NUM_TOKENS, "cpu")
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.commit_block_table(NUM_REQS)
    return bt


@pytest.fixture
def one_torch_thread():
    """torch's intra-op threads spin-wait; on a loaded 2-core VM that inflates the median
    of 200 us calls tenfold. The torch path is timed on one thread (numpy uses one anyway)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_slot_mapping_8k_kvblock(record, impl, one_torch_thread):
    rows, qsl, pos = _step()
    bt = _table(rows)
    q = torch.tensor(qsl, dtype=torch.int32)
    p = torch.tensor(pos, dtype=torch.int64)
    want = slot_mapping_reference(rows, BLOCK_SIZE, qsl, pos, NUM_TOKENS)
    assert bt.compute_slot_mapping(q, p, impl=impl).tolist() == want
    label = "auto = numpy over the tensors" if impl == "numpy" else "torch ops"
    record(f"slot mapping, 8192 tokens, {label} (ns/token)", "kvblock",
           lambda: bt.compute_slot_mapping(q, p, impl=impl), per=NUM_TOKENS)


@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_slot_mapping_8k_reference(record, impl):
    rows, qsl, pos = _step()
    label = "auto = numpy over the tensors" if impl == "numpy" else "torch ops"
    record(f"slot mapping, 8192 tokens, {label} (ns/token)", "reference",
           lambda: slot_mapping_reference(rows, BLOCK_SIZE, qsl, pos, NUM_TOKENS), per=NUM_TOKENS, rounds=20)


def test_commit_and_slot_mapping_8k_kvblock(record):
    """A whole worker step's table work: re-add every row, commit, map (ns per token)."""
    rows, qsl, pos = _step()
    bt = _table(rows)
    q = torch.tensor(qsl, dtype=torch.int32)
    p = torch.tensor(pos, dtype=torch.int64)
    arrays = [np.asarray(r, dtype=np.int64) for r in rows]

    def step():
        for r, ids in enumerate(arrays):
            bt.add_row(ids, r)
        bt.commit_block_table(NUM_REQS)
        return bt.compute_slot_mapping(q, p)

    record("add_row x64 + commit + slot mapping, 8192 tokens (ns/token)", "kvblock", step, per=NUM_TOKENS)
