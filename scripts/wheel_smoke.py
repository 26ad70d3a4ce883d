"""Smoke test of an installed kvblock wheel, run by ``scripts/build_wheels.sh`` in a fresh
venv outside the checkout (``python -I``): it must import the installed package, hash as the
pure-Python reference does with all four algorithms, manage blocks atomically and replay the
built-in workload with vLLM's result."""

from __future__ import annotations

import os
import sys
import sysconfig


def main() -> int:
    import kvblock
    from kvblock import KVCacheManager, Request, _core
    from kvblock import hashing as kh
    from kvblock.reference import hashing as rh

    site = sysconfig.get_paths()["purelib"]
    where = os.path.dirname(kvblock.__file__)
    if not where.startswith(site):
        return print(f"kvblock imported from {where}, not from this venv's {site}") or 1
    print(f"kvblock {kvblock.__version__} ({_core.BUILD_PROFILE}) on Python {sys.version.split()[0]}, "
          f"token encoder {_core.token_encoder()}, from {where}")
    tokens = [(i * 7919) % 151_000 for i in range(1000)] + [2**40, -5, 2**70]
    for algo in _core.ALGORITHMS:
        for mod in (kh, rh):
            mod.init_none_hash(mod.get_hash_fn_by_name(algo))
        kh.NONE_HASH = rh.NONE_HASH  # xxhash roots are random per call: compare one chain
        fast = kvblock.hash_blocks(tokens, 16, algo=algo)
        ref = rh.hash_blocks(tokens, 16, algo=algo, parent=rh.NONE_HASH)
        if [bytes(h) for h in fast] != ref:
            return print(f"{algo}: kvblock and the reference disagree") or 1
    # a failed allocation changes nothing (issue 13's case)
    kh.init_none_hash(kh.get_hash_fn_by_name("sha256"))
    mgr = KVCacheManager(40, 4, max_model_len=64)
    a = Request("a", list(range(12)), block_hasher=mgr.request_block_hasher)
    blocks, hit, _ = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 12 - hit, hit, blocks)
    mgr.free(a)
    b = Request("b", list(range(13)), block_hasher=mgr.request_block_hasher)
    blocks, hit, _ = mgr.get_computed_blocks(b)
    try:
        mgr.allocate_slots(b, 1, hit, blocks, num_external_computed_tokens=200)
        return print("allocate_slots accepted computed tokens past max_model_len") or 1
    except ValueError:
        pass
    if mgr.block_pool.get_num_free_blocks() != 39 or not mgr.reset_prefix_cache():
        return print("a failed allocate_slots changed the pool") or 1
    # the main job: the built-in workload replay, vLLM 0.33.0's hit count
    import contextlib
    import io
    import json

    from kvblock.cli import main as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(["replay", "--json"])
    d = json.loads(out.getvalue())
    hits = (d["prefix_cache"]["hits"], d["prefix_cache"]["queries"])
    if code != 0 or hits != (1_150_464, 2_048_000):
        return print(f"kvblock replay: exit {code}, {hits[0]} / {hits[1]} hit tokens") or 1
    print("smoke test passed: hashing (4 algorithms), atomic allocation, workload replay")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
