"""Run as a script (``PYTHONMALLOC=malloc``) by ``test_vllm_lockstep_cases``: a vLLM
``Request`` kvblock knows in its slot cache dies while the manager still holds its blocks, and
another request, with another id, is made until it lands at the dead request's address (C
malloc reuses a freed chunk of the same size soon; CPython's own allocator may never hand that
address back to a request in the test process). vLLM's manager and kvblock's must then give the
newcomer the same answer: blocks for an unknown request. Prints ``reused <tries>`` and exits 0
when they agree."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import test_vllm_lockstep_cases as T  # noqa: E402


def _newcomer_at(address: int, tries: int) -> tuple[int, object]:
    """Make requests (ids ``x<n>``, the victims' tokens) until one lands at ``address``:
    (tries made, the request or None)."""
    for n in range(1, tries + 1):
        gc.collect()  # a vLLM Request is in a cycle (its block-hash partial): it dies here
        x = T._request(f"x{n}", list(range(1, 7)), 4)
        if id(x) == address:
            return n, x
        del x
    return tries, None


def main() -> int:
    # a victim whose address never comes back (its chunk taken by another object first: about
    # half of them on vLLM 0.34) is left holding its 2 blocks; 32 victims make a miss of all
    # of them unlikely (8 missed in about one run in three)
    v, k = T._both([FullAttentionSpec(block_size=4, **T.A)], 256, 4, 4)
    total = 0
    for victim in range(32):
        rid = f"r{victim}"
        rv = T._request(rid, list(range(1, 7)), 4)
        T._decode_ready(v, rv)
        rk = T._request(rid, list(range(1, 7)), 4)
        T._decode_ready(k, rk)
        address, alive = id(rk), weakref.ref(rk)
        gc.collect()
        gc.freeze()  # the collections below walk only what is made since
        del rk
        n, x = _newcomer_at(address, 4_000)
        gc.unfreeze()
        total += n
        if alive() is not None:
            print("the manager kept the dead request alive")
            return 1
        if x is not None:
            break
    else:
        print(f"no dead request's address was reused in {total} tries")
        return 2
    # the newcomer in the very state of the dead request (prompt computed, one token
    # sampled), so that only its identity tells it apart: vLLM allocates its blocks
    xv = T._request(x.request_id, list(range(1, 7)), 4)
    for r in (x, xv):
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(100)
    res = T._same(
        v, k, lambda: v.allocate_slots(xv, 1, num_lookahead_tokens=0), lambda: k.allocate_slots(x, 1, num_lookahead_tokens=0)
    )
    if res is None or res is v.empty_kv_cache_blocks:
        print(f"vLLM itself gave {res!r}")
        return 1
    if not [len(b) for b in k.get_block_ids(rid)] == [len(b) for b in v.get_block_ids(rid)] == [2]:
        print("the dead request's blocks changed")
        return 1
    print(f"reused after {total} tries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
