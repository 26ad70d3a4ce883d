"""Block hashing: a 4096-token prompt (256 blocks of 16), kvblock's batch path vs the
reference, for all four algorithms. Time is reported per block."""

from __future__ import annotations

import numpy as np
import pytest

import kvblock
from kvblock.reference import hashing as R

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ROOT = bytes(32)


def _prompt() -> np.ndarray:
    # The workload's hashing prompt distribution: ids in [0, 128000).
    return np.random.default_rng(1234567).integers(0, 128000, size=4096, dtype=np.int64)


@pytest.mark.parametrize("algo", ALGOS)
def test_hash_4096_numpy_kvblock(record, algo):
    toks = _prompt()
    record(f"hash_blocks[{algo}] 4096 tokens (ns/block)", "kvblock",
           lambda: kvblock.hash_blocks(toks, 16, algo=algo, parent=ROOT), per=256)


@pytest.mark.parametrize("algo", ALGOS)
def test_hash_4096_reference(record, algo):
    toks = _prompt().tolist()
    record(f"hash_blocks[{algo}] 4096 tokens (ns/block)", "reference",
           lambda: R.hash_blocks(toks, 16, algo=algo, parent=ROOT), per=256, rounds=30)


@pytest.mark.parametrize("algo", ALGOS)
def test_hash_4096_list_kvblock(record, algo):
    toks = _prompt().tolist()
    record(f"hash_blocks[{algo}] list input (ns/block)", "kvblock",
           lambda: kvblock.hash_blocks(toks, 16, algo=algo, parent=ROOT), per=256)


@pytest.mark.parametrize("algo", ALGOS)
def test_hash_4096_list_reference(record, algo):
    toks = _prompt().tolist()
    record(f"hash_blocks[{algo}] list input (ns/block)", "reference",
           lambda: R.hash_blocks(toks, 16, algo=algo, parent=ROOT), per=256, rounds=30)
