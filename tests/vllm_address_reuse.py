"""Run as a script (``PYTHONMALLOC=malloc``) by ``test_vllm_lockstep_cases``: a vLLM
``Request`` kvblock knows in its slot cache dies while the manager still holds its blocks, and
another request, with another id, is made at the dead request's address. vLLM's manager and
kvblock's must then give the newcomer the same answer: blocks for an unknown request. Prints
``reused <tries>`` and exits 0 when they agree.

The newcomer lands on the dead request's address by construction, not by luck: the victim's
attributes are dropped first (which breaks the cycle through its block-hash partial), so the
victim is freed at once by ``del``, its object chunk last. glibc's malloc hands the most
recently freed chunk of a size back to the next allocation of that size, as long as its
per-thread cache for the size has room (a full one sends the chunk to another list, behind the
cached ones); so that cache is emptied first, by allocating requests that are kept until the
end. The very next allocation after the victim's free is the newcomer's ``Request.__new__``;
its ``__init__`` runs after."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import test_vllm_lockstep_cases as T  # noqa: E402
from vllm_oracle import get_request_block_hasher  # noqa: E402


def _newcomer_at(address: int) -> Request | None:
    """A ``Request`` allocated straight after the victim at ``address`` was freed, initialised
    (id ``x``, the victim's tokens) when it landed there; None when it did not."""
    x = Request.__new__(Request)  # the first allocation after the victim's free
    if id(x) != address:
        return None
    hasher = get_request_block_hasher(4, sha256)
    Request.__init__(x, "x", list(range(1, 7)), SamplingParams(max_tokens=64), None, block_hasher=hasher)
    return x


def main() -> int:
    v, k = T._both([FullAttentionSpec(block_size=4, **T.A)], 256, 4, 4)
    for victim in range(1, 33):
        rid = f"r{victim}"
        rv = T._request(rid, list(range(1, 7)), 4)
        T._decode_ready(v, rv)
        rk = T._request(rid, list(range(1, 7)), 4)
        T._decode_ready(k, rk)
        address, alive = id(rk), weakref.ref(rk)
        gc.disable()  # no collection between the free and the newcomer's allocation
        vars(rk).clear()  # the partial that refers back to it goes: ``del`` frees it now
        drained = [Request.__new__(Request) for _ in range(64)]  # empties malloc's cache
        del rk
        x = _newcomer_at(address)
        gc.enable()
        del drained
        if alive() is not None:
            print("the manager kept the dead request alive")
            return 1
        if x is not None:
            break
    else:
        print(f"no dead request's address was reused in {victim} tries")
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
    print(f"reused after {victim} tries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
