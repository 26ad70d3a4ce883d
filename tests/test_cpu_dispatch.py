"""Runtime CPU dispatch: the token-id encoder is chosen at run time (AVX-512 VBMI2 where the
CPU has it, the portable scalar path elsewhere), and ``KVBLOCK_NO_SIMD`` forces the
portable path. Digests must be identical on both: this process (whatever this CPU picks)
against a child process forced onto the portable path, on inputs that reach every encoder
branch (1/2/3/5-byte ids, negatives, ids past 2^31 and 2^63, groups of eight and tails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvblock._core as core

SCRIPT = r"""
import json, random, sys
import numpy as np
import kvblock
from kvblock import hashing
from kvblock import _core

rng = random.Random(5)
inputs = []
for n in (0, 7, 8, 9, 64, 1000, 4099):
    for hi in (255, 65_535, 2**24, 2**31 - 1, 2**40):
        inputs.append([rng.randrange(-3 if hi > 300 else 0, hi) for _ in range(n)])
inputs.append([2**63 - 1, -(2**63), 2**70, 0, 1, 255, 256, 65535, 65536] * 9)
out = {"encoder": _core.token_encoder(), "digests": []}
for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    fn = hashing.get_hash_fn_by_name(algo)
    root = bytes(range(fn.digest_size))
    for toks in inputs:
        for bs in (1, 8, 16, 64):
            out["digests"].append([h.hex() for h in _core.hash_blocks(fn, toks, bs, root)])
            small = [t for t in toks if -(2**63) <= t < 2**63]
            arr = np.array(small, dtype=np.int64)
            out["digests"].append([h.hex() for h in _core.hash_blocks(fn, arr, bs, root)])
json.dump(out, sys.stdout)
"""


def _run(no_simd: bool) -> dict:
    env = dict(os.environ)
    env.pop("KVBLOCK_NO_SIMD", None)
    if no_simd:
        env["KVBLOCK_NO_SIMD"] = "1"
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def _cpu_has_vbmi2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512_vbmi2", "popcnt"))


def test_portable_path_gives_the_same_digests():
    default = _run(no_simd=False)
    portable = _run(no_simd=True)
    assert portable["encoder"] == "portable"
    if _cpu_has_vbmi2():
        assert default["encoder"] == "avx512vbmi2"
    assert len(default["digests"]) == len(portable["digests"]) > 1000
    assert default["digests"] == portable["digests"]


def test_encoder_is_reported():
    assert core.token_encoder() in ("avx512vbmi2", "portable")
