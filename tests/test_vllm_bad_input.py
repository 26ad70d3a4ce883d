"""Bad input to the vLLM manager, judged by vLLM 0.33.0's own ``KVCacheManager``.

Every call below passes one wrong value (a bool, a float, a str, None, a negative or huge int,
a numpy int, an object, a list) in one argument of one manager method, on vLLM's manager and on
``kvblock.vllm.KVCacheManager`` in the same state, for full attention, full attention with a
sliding window, a sliding window alone, and Mamba with full attention. Then:

- vLLM raises: kvblock raises the same exception type (for an int past 64 bits, its
  ``IntOutOfRangeError``, both a ``ValueError`` and an ``OverflowError``), and its state is
  what it was before the call (where vLLM changes its state before it raises, kvblock still
  does not);
- vLLM accepts: kvblock returns the same answer and ends in the same state, unless the value
  is meaningless for its argument (a count that is not an int in ``[0, 2**63)``, an object
  passed as a request or a request id, a block list that is not one). There kvblock may refuse
  with a ``TypeError`` or ``ValueError`` instead (the README's "Stricter than vLLM" list), and
  its state is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import require_module

vllm = require_module("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import torch  # noqa: E402
from kvblock import IntOutOfRangeError  # noqa: E402
from vllm_oracle import A, both, request, state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BAD = {
    "True": True, "False": False, "0": 0, "np.int64(3)": np.int64(3), "1.5": 1.5, "2.0": 2.0,
    "'x'": "x", "None": None, "-1": -1, "2**70": 2**70, "-2**70": -(2**70), "object()": object(),
    "[]": [],
}

# How an argument is used, and so which of BAD are meaningful values for it
COUNT, FLAG, BLOCKS, GROUP_IDS, REQUEST, REQUEST_ID = "count", "flag", "blocks", "group ids", "request", "request id"


def _meaningful(kind: str, value) -> bool:
    if kind == COUNT:  # vLLM's arithmetic takes a bool as 0/1
        return isinstance(value, (bool, int, np.integer)) and 0 <= int(value) < 2**63
    if kind == FLAG:  # read for its truth value
        return True
    if kind == BLOCKS:
        return value is None
    if kind == GROUP_IDS:
        return value is None or value == []
    return False  # none of BAD is a request or a str request id


ALLOCATE_ARGS = {
    "num_new_computed_tokens": COUNT, "new_computed_blocks": BLOCKS, "num_lookahead_tokens": COUNT,
    "num_external_computed_tokens": COUNT, "delay_cache_blocks": FLAG, "num_encoder_tokens": COUNT,
    "full_sequence_must_fit": FLAG, "reserved_blocks": COUNT, "has_scheduled_reqs": FLAG,
    "skip_zeroing_group_ids": GROUP_IDS,
}


def _cases():
    """(case id, call(manager, running request, waiting request), argument kind, value)."""
    out = []
    for bn, bv in BAD.items():
        for who in ("running", "waiting"):
            def alloc_count(m, r0, r1, bv=bv, who=who):
                return m.allocate_slots(r0 if who == "running" else r1, bv)
            out.append((f"allocate_slots({who}, num_new_tokens={bn})", alloc_count, COUNT, bv))
            for arg, kind in ALLOCATE_ARGS.items():
                def alloc(m, r0, r1, bv=bv, who=who, arg=arg):
                    r, n = (r0, 1) if who == "running" else (r1, 10)
                    return m.allocate_slots(r, n, **{arg: bv})
                out.append((f"allocate_slots({who}, {arg}={bn})", alloc, kind, bv))
        calls = {
            f"allocate_slots({bn}, 1)": (lambda m, r0, r1, v=bv: m.allocate_slots(v, 1), REQUEST),
            f"get_computed_blocks({bn})": (lambda m, r0, r1, v=bv: m.get_computed_blocks(v), REQUEST),
            f"get_computed_blocks(waiting, max_cache_hit_length={bn})":
                (lambda m, r0, r1, v=bv: m.get_computed_blocks(r1, v), COUNT),
            f"free({bn})": (lambda m, r0, r1, v=bv: m.free(v), REQUEST),
            f"cache_blocks({bn}, 4)": (lambda m, r0, r1, v=bv: m.cache_blocks(v, 4), REQUEST),
            f"cache_blocks(running, {bn})": (lambda m, r0, r1, v=bv: m.cache_blocks(r0, v), COUNT),
            f"pop_blocks_for_free({bn})": (lambda m, r0, r1, v=bv: m.pop_blocks_for_free(v), REQUEST),
            f"estimate_cached_tokens({bn})": (lambda m, r0, r1, v=bv: m.estimate_cached_tokens(v), REQUEST),
            f"prefix_cache_lookup_enabled({bn})":
                (lambda m, r0, r1, v=bv: m.prefix_cache_lookup_enabled(v), REQUEST),
            f"finalize_partial_tail_offloads({bn})":
                (lambda m, r0, r1, v=bv: m.finalize_partial_tail_offloads(v), REQUEST),
            f"get_block_ids({bn})": (lambda m, r0, r1, v=bv: m.get_block_ids(v), REQUEST_ID),
            f"get_blocks({bn})": (lambda m, r0, r1, v=bv: m.get_blocks(v), REQUEST_ID),
            f"get_num_common_prefix_blocks({bn})":
                (lambda m, r0, r1, v=bv: m.get_num_common_prefix_blocks(v), REQUEST_ID),
            f"get_block_ids_for_computed_tokens('r0', {bn})":
                (lambda m, r0, r1, v=bv: m.get_block_ids_for_computed_tokens("r0", v), COUNT),
            f"get_block_ids_for_computed_tokens({bn}, 4)":
                (lambda m, r0, r1, v=bv: m.get_block_ids_for_computed_tokens(v, 4), REQUEST_ID),
            f"remove_skipped_blocks('r0', {bn})": (lambda m, r0, r1, v=bv: m.remove_skipped_blocks("r0", v), COUNT),
            f"remove_skipped_blocks('r0', 4, {bn})":
                (lambda m, r0, r1, v=bv: m.remove_skipped_blocks("r0", 4, v), COUNT),
            f"remove_skipped_blocks({bn}, 4)": (lambda m, r0, r1, v=bv: m.remove_skipped_blocks(v, 4), REQUEST_ID),
            f"record_blocks_for_zeroing('r0', {bn})":
                (lambda m, r0, r1, v=bv: m.record_blocks_for_zeroing("r0", v), COUNT),
            f"record_blocks_for_zeroing({bn}, 0)":
                (lambda m, r0, r1, v=bv: m.record_blocks_for_zeroing(v, 0), REQUEST_ID),
            f"record_prefix_cache_stats(running, {bn})":
                (lambda m, r0, r1, v=bv: m.record_prefix_cache_stats(r0, v), COUNT),
            f"evict_blocks({bn})": (lambda m, r0, r1, v=bv: m.evict_blocks(v), BLOCKS),
            f"evict_blocks([{bn}])": (lambda m, r0, r1, v=bv: m.evict_blocks([v]), COUNT),
            f"truncate_computed_blocks(blocks, {bn})":
                (lambda m, r0, r1, v=bv: m.truncate_computed_blocks(m.get_blocks("r0"), v), COUNT),
            f"truncate_computed_blocks({bn}, 4)": (lambda m, r0, r1, v=bv: m.truncate_computed_blocks(v, 4), BLOCKS),
            f"create_kv_cache_blocks({bn})": (lambda m, r0, r1, v=bv: m.create_kv_cache_blocks(v), BLOCKS),
        }
        out += [(name, call, kind, bv) for name, (call, kind) in calls.items()]
    return out


CASES = _cases()


def _mamba(bs: int) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")


CONFIGS = {
    "full": lambda: [FullAttentionSpec(block_size=4, **A)],
    "full + sliding window": lambda: [FullAttentionSpec(block_size=4, **A),
                                      SlidingWindowSpec(block_size=4, sliding_window=8, **A)],
    "sliding window": lambda: [SlidingWindowSpec(block_size=4, sliding_window=8, **A)],
    "mamba + full": lambda: [_mamba(4), FullAttentionSpec(block_size=4, **A)],
}

# vLLM's Mamba manager builds a list of that many null blocks: it fills the machine's memory
# before its MemoryError (kvblock refuses the count at once, the refusal the rule allows)
EXHAUSTS_VLLM = {("mamba + full", f"allocate_slots({who}, num_new_tokens=2**70)") for who in ("running", "waiting")}


def _setup(config: str = "full"):
    """Both managers with a running request r0 (10 prompt tokens computed, one sampled: 11) and
    a waiting request r1 (10 tokens, its first two blocks shared with r0)."""
    v, k = both(CONFIGS[config](), 32, 4, 4)
    reqs = []
    for m in (v, k):
        r0 = request("r0", list(range(1, 11)), 4)
        blocks, hit, _ = m.get_computed_blocks(r0)
        m.allocate_slots(r0, r0.num_tokens - hit, hit, blocks)
        r0.num_computed_tokens = r0.num_tokens
        r0.append_output_token_ids(100)
        reqs.append((r0, request("r1", list(range(1, 9)) + [50, 51], 4)))
    return (v, k), reqs


def _answer(value):
    """A call's result in a form both managers' answers compare in."""
    if isinstance(value, KVCacheBlocks):
        return ("blocks", value.get_block_ids())
    if isinstance(value, tuple) and value and isinstance(value[0], KVCacheBlocks):
        return ("blocks", value[0].get_block_ids(), value[1:])
    if isinstance(value, list):
        return [getattr(x, "block_id", x) for x in value]
    return value


def _call(f):
    try:
        return _answer(f()), None
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return None, e


def _same_kind(err_k, err_v) -> bool:
    """kvblock raised vLLM's exception type, or, for an int past 64 bits, its
    ``IntOutOfRangeError``: both the ``ValueError`` and the ``OverflowError`` vLLM's code
    raises for one, depending on where it lands."""
    if type(err_k) is IntOutOfRangeError:
        return isinstance(err_k, type(err_v))
    return type(err_k) is type(err_v)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bad_input_gets_vllms_exception_or_a_documented_refusal(config, case):
    name, call, kind, value = case
    if (config, name) in EXHAUSTS_VLLM:
        pytest.skip("vLLM's own manager would fill the machine's memory")
    (v, k), ((v0, v1), (k0, k1)) = _setup(config)
    before = state(k)
    got_v, err_v = _call(lambda: call(v, v0, v1))
    got_k, err_k = _call(lambda: call(k, k0, k1))
    if err_v is not None:
        assert _same_kind(err_k, err_v), f"vLLM raised {err_v!r}, kvblock {err_k!r} ({got_k!r})"
        assert state(k) == before, "kvblock changed its state before raising"
    elif err_k is not None:
        assert not _meaningful(kind, value), f"vLLM accepted a meaningful value; kvblock raised {err_k!r}"
        assert isinstance(err_k, (TypeError, ValueError)), repr(err_k)  # IntOutOfRangeError too
        assert state(k) == before, "kvblock changed its state before raising"
    else:
        assert got_k == got_v
        assert state(k) == state(v)


def test_the_cases_exercise_every_outcome():
    """The table above is not vacuous: vLLM raises in many of its calls, accepts in many, and
    kvblock's refusals of meaningless values are a minority of the calls vLLM accepts."""
    raised = accepted = stricter = 0
    for name, call, kind, value in CASES:
        (v, k), ((v0, v1), (k0, k1)) = _setup()
        _, err_v = _call(lambda: call(v, v0, v1))
        _, err_k = _call(lambda: call(k, k0, k1))
        raised += err_v is not None
        accepted += err_v is None
        stricter += err_v is None and err_k is not None
    assert raised > 100 and accepted > 100 and stricter < accepted / 2, (raised, accepted, stricter)


SPECS = {
    "full": lambda: [FullAttentionSpec(block_size=4, **A)],
    "sliding window": lambda: [SlidingWindowSpec(block_size=4, sliding_window=8, **A)],
    "chunked local": lambda: [ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **A)],
    "mamba": lambda: [_mamba(4)],
    "full + sliding window": lambda: [FullAttentionSpec(block_size=4, **A),
                                      SlidingWindowSpec(block_size=4, sliding_window=8, **A)],
}


@pytest.mark.parametrize("value", [1.5, 2.0, 8.0, "x", -1, -8, True, False, 0, 8], ids=repr)
@pytest.mark.parametrize("spec", list(SPECS))
def test_max_cache_hit_length_is_read_as_vllms_hit_finders_read_it(spec, value):
    """vLLM's full-attention finder slices by it (``islice``: ValueError for a float or a
    negative); the others use it in ``range``/arithmetic (TypeError for a float, a negative
    length is a miss). kvblock raises the same type, or finds the same hit."""
    v, k = both(SPECS[spec](), 32, 4, 4)
    out = []
    for m in (v, k):
        r = request("r", list(range(1, 11)), 4)
        got, err = _call(lambda m=m, r=r: m.get_computed_blocks(r, value)[1])
        out.append(type(err) if err is not None else got)
    assert out[0] == out[1]


@pytest.mark.parametrize("num_computed_tokens", [20, 48, 70, 100])
def test_cache_blocks_past_the_table_with_events_on_is_vllms_index_error_and_changes_nothing(num_computed_tokens):
    """A request holding 3 blocks of 16 asked to cache 70 or 100 tokens' blocks: vLLM's event
    path indexes past the table and raises IndexError (after caching the blocks it holds);
    kvblock raises IndexError before it caches anything. Within the table both cache the same
    blocks and emit the same events."""
    v, k = both([FullAttentionSpec(block_size=16, **A)], 32, 16, 16, enable_kv_cache_events=True)
    out = []
    for m in (v, k):
        r = request("r", list(range(1, 101)), 16)
        m.allocate_slots(r, 48)
        m.take_events()
        before = state(m)
        got, err = _call(lambda m=m, r=r: m.cache_blocks(r, num_computed_tokens))
        out.append((type(err) if err else got, len(m.take_events())))
        if m is k and err is not None:
            assert state(k) == before
    past = num_computed_tokens // 16 > 3
    assert out[0][0] is (IndexError if past else None)
    assert out[1][0] is out[0][0]
    if not past:
        assert out[1] == out[0] and state(k) == state(v)


def test_cache_blocks_past_the_table_with_events_off_is_what_vllm_does():
    """Without events vLLM's loop stops at the blocks the request holds (no error): kvblock
    caches the same blocks."""
    v, k = both([FullAttentionSpec(block_size=16, **A)], 32, 16, 16)
    for m in (v, k):
        r = request("r", list(range(1, 101)), 16)
        m.allocate_slots(r, 48)
        m.cache_blocks(r, 100)
    assert state(k) == state(v)
