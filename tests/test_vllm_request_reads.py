"""How kvblock.vllm reads the fields of vLLM's ``Request``.

Fields that nothing on ``Request`` overrides are read from the instance ``__dict__``
(``rust/src/py/instance_dict.rs``); everything else goes through ``getattr``. These tests
hold kvblock to ``getattr``'s answer in the cases where the two could differ: a data
descriptor added to the class after the manager learnt it, a field missing from the
instance, a class attribute standing in for it. Each case runs on vLLM's own manager and on
kvblock's side by side and compares answers, errors and state.
"""

from __future__ import annotations

import pytest

from conftest import require_module

vllm = require_module("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_oracle import A  # noqa: E402
from vllm_oracle import both as _both  # noqa: E402
from vllm_oracle import request as _request  # noqa: E402
from vllm_oracle import state as _state  # noqa: E402
from kvblock import _core

#: For the tests of a CPython fast path's own state (rust/src/py/fast/): they skip where
#: KVBLOCK_NO_FAST_PATHS=1 turned the fast paths off.
FAST_PATHS_ONLY = pytest.mark.skipif(not _core.FAST_PATHS, reason="the CPython fast paths are off (KVBLOCK_NO_FAST_PATHS)")


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _decode_ready_pair():
    """vLLM's manager and kvblock's, each holding a request "r" of 7 tokens (6 computed, two
    4-token blocks) that has made one no-op decode call (kvblock's slot cache knows it)."""
    v, k = _both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)
    pairs = []
    for m in (v, k):
        r = _request("r", list(range(1, 7)), 4)
        blocks, hit, _ = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(100)
        assert m.allocate_slots(r, 1, num_lookahead_tokens=0) is m.empty_kv_cache_blocks
        pairs.append((m, r))
    return pairs


def _answer(call):
    try:
        x = call()
    except Exception as e:  # noqa: BLE001 - the exception type is the answer compared
        return ("raised", type(e))
    return ("returned", None if x is None else x.get_block_ids())


def _decode_step_alike(v, rv, k, rk):
    """One decode call (``allocate_slots(r, 1, num_lookahead_tokens=0)``) on each manager:
    the same answer (or exception type) and the same state after it. Returns the answer."""
    a_v = _answer(lambda: v.allocate_slots(rv, 1, num_lookahead_tokens=0))
    a_k = _answer(lambda: k.allocate_slots(rk, 1, num_lookahead_tokens=0))
    assert a_v == a_k
    assert _state(v) == _state(k)
    return a_v


@FAST_PATHS_ONLY
def test_a_property_added_to_the_class_afterwards_is_read_as_getattr_reads_it():
    """A ``num_computed_tokens`` property put on ``Request`` after both managers have read
    the field takes precedence over the instance attribute: both managers see 2 more
    computed tokens, so the decode call crosses into a new block, and both allocate it. Once
    the property is gone, both read the instance attribute again."""
    (v, rv), (k, rk) = _decode_ready_pair()

    def get(self):
        return self.__dict__["num_computed_tokens"] + 2

    def put(self, value):
        self.__dict__["num_computed_tokens"] = value

    assert {"request_id", "num_computed_tokens"} <= set(k._dict_read_fields(rk))
    Request.num_computed_tokens = property(get, put)
    try:
        assert rv.num_computed_tokens == rk.num_computed_tokens == 8
        answer = _decode_step_alike(v, rv, k, rk)
        assert answer[0] == "returned" and answer[1] != ([],)
        # the changed class was checked again: the property's field goes through getattr,
        # the others are read from the dict again
        fields = set(k._dict_read_fields(rk))
        assert "num_computed_tokens" not in fields and "request_id" in fields
    finally:
        del Request.num_computed_tokens
    assert rv.num_computed_tokens == rk.num_computed_tokens == 6
    _decode_step_alike(v, rv, k, rk)
    # and once the property is gone, the field is read from the dict again
    assert {"request_id", "num_computed_tokens"} <= set(k._dict_read_fields(rk))


def test_a_field_missing_from_the_instance_raises_attribute_error_and_changes_nothing():
    """A request whose ``num_computed_tokens`` was deleted: both managers raise
    ``AttributeError`` for the decode call, and neither changes."""
    (v, rv), (k, rk) = _decode_ready_pair()
    before = _state(k)
    del rv.num_computed_tokens
    del rk.num_computed_tokens
    assert _decode_step_alike(v, rv, k, rk) == ("raised", AttributeError)
    assert _state(k) == before


def test_a_class_attribute_stands_in_for_a_missing_instance_field():
    """With ``num_computed_tokens`` deleted from the instances and a class attribute of 8 on
    ``Request``, both managers read 8 (the class attribute, as ``getattr`` finds it): the
    decode call covers token 9, in a third block, and both allocate it."""
    (v, rv), (k, rk) = _decode_ready_pair()
    del rv.num_computed_tokens
    del rk.num_computed_tokens
    Request.num_computed_tokens = 8
    try:
        answer = _decode_step_alike(v, rv, k, rk)
        assert answer[0] == "returned" and answer[1] != ([],)
    finally:
        del Request.num_computed_tokens


def test_reading_fields_leaves_the_request_as_it_was():
    """kvblock's reads change nothing a caller of the request can see: its attributes and
    their values are those of an identical request that no manager touched."""
    (_, rk), = _decode_ready_pair()[1:]
    untouched = _request("r", list(range(1, 7)), 4)
    untouched.num_computed_tokens = untouched.num_tokens
    untouched.append_output_token_ids(100)
    skip = {"arrival_time", "_block_hasher", "block_hashes", "sampling_params", "structured_output_request"}
    assert sorted(vars(rk)) == sorted(vars(untouched))
    for name, value in vars(untouched).items():
        if name not in skip:
            got = getattr(rk, name)
            if type(value).__name__ == "ConstantList":  # vLLM's read-only list view: no __eq__
                got, value = list(got), list(value)
            assert got == value, name
    assert rk.block_hashes == untouched.block_hashes


@FAST_PATHS_ONLY
def test_a_manager_built_before_any_request_reads_fields_from_the_dict():
    """vLLM's engine builds its scheduler, and so the manager, before the first ``Request``
    exists; until an attribute lookup goes through it, the ``Request`` type has no version
    tag to pin the manager's check to. The manager gives it one, so that the requests made
    afterwards are read from their ``__dict__`` (in a fresh interpreter, where nothing has
    looked ``Request`` up yet)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from vllm.v1.kv_cache_interface import FullAttentionSpec\n"
        "from vllm_oracle import A, both, request\n"
        "v, k = both([FullAttentionSpec(block_size=4, **A)], 32, 4, 4)\n"
        "r = request('r', list(range(1, 7)), 4)\n"
        "print(sorted(k._dict_read_fields(r)))\n"
        "blocks, hit, _ = k.get_computed_blocks(r)\n"
        "assert k.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None\n"
        "print(sorted(k._dict_read_fields(r)))\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # before the manager's first read of the request (the type was tagged when the manager
    # was built) and after its calls
    for line in out.stdout.strip().splitlines()[-2:]:
        fields = eval(line)  # noqa: S307 - our own printed list
        assert {"request_id", "num_computed_tokens", "block_hashes", "status"} <= set(fields), fields
