"""Verify on hit: the cost of ``verify_hits=True`` against the same manager with it off, one run.

Long prompts with many hits: 8,192-token prompts in 16-token blocks (xxhash, the algorithm
verify is for). ``lookup``: ``get_computed_blocks`` of a prompt fully cached (511 hit blocks,
each verified: tokens read from the request, compared with the block's record, parent chained).
``admit``: ``get_computed_blocks`` + ``allocate_slots`` + ``free`` of a request sharing a
4,096-token prefix with a cached prompt and bringing 4,096 new tokens (256 hit blocks verified,
256 new blocks cached and recorded). The summary prints both times and the on/off ratio.
"""

from __future__ import annotations

import random

import pytest

import kvblock
from kvblock.request import Request

BS = 16
PROMPT = 8192
NUM_BLOCKS = 8192
ROUNDS = 40
_TIMES: dict[tuple[str, bool], float] = {}


def _manager(verify: bool):
    mgr = kvblock.KVCacheManager(NUM_BLOCKS, BS, hash_algo="xxhash", verify_hits=verify)
    rng = random.Random(0)
    base = [rng.randrange(32000) for _ in range(PROMPT)]
    warm = Request("warm", base, block_hasher=mgr.request_block_hasher)
    blocks, n, _ = mgr.get_computed_blocks(warm)
    mgr.allocate_slots(warm, warm.num_tokens - n, n, blocks)
    mgr.free(warm)
    return mgr, base, rng


def _report(report_line, what: str):
    if (what, False) in _TIMES and (what, True) in _TIMES:
        off, on = _TIMES[(what, False)], _TIMES[(what, True)]
        report_line(
            f"verify_hits {what}: off {off * 1e6:8.1f} us, on {on * 1e6:8.1f} us, on/off {on / off:4.2f}x (min)"
        )


@pytest.mark.parametrize("verify", [False, True], ids=["off", "on"])
def test_lookup(record, report_line, verify):
    mgr, base, _ = _manager(verify)
    req = Request("q", base, block_hasher=mgr.request_block_hasher)
    assert mgr.get_computed_blocks(req)[1] == PROMPT - BS

    def run():
        mgr.get_computed_blocks(req)

    group = f"verify_hits: get_computed_blocks, {PROMPT}-token prompt, {PROMPT // BS - 1} hit blocks"
    record(group, "kvblock verify" if verify else "kvblock", run)
    from conftest import _RESULTS

    _TIMES[("lookup", verify)] = _RESULTS[group]["kvblock verify" if verify else "kvblock"][0]
    assert mgr.hit_verification_failures == 0
    _report(report_line, "lookup")


@pytest.mark.parametrize("verify", [False, True], ids=["off", "on"])
def test_admit(record, report_line, verify):
    mgr, base, rng = _manager(verify)
    half = PROMPT // 2
    reqs = [
        Request(f"r{i}", base[:half] + [rng.randrange(32000) for _ in range(half)], block_hasher=mgr.request_block_hasher)
        for i in range(ROUNDS + 2)
    ]
    it = iter(reqs)

    def run():
        r = next(it)
        blocks, n, _ = mgr.get_computed_blocks(r)
        assert n == half
        mgr.allocate_slots(r, r.num_tokens - n, n, blocks)
        mgr.free(r)

    group = f"verify_hits: lookup+allocate+cache+free, {half} hit + {half} new tokens"
    record(group, "kvblock verify" if verify else "kvblock", run, rounds=ROUNDS)
    from conftest import _RESULTS

    _TIMES[("admit", verify)] = _RESULTS[group]["kvblock verify" if verify else "kvblock"][0]
    _report(report_line, "admit")
