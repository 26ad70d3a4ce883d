"""The CPython fast paths (``rust/src/py/fast/``) and their one switch, ``KVBLOCK_NO_FAST_PATHS``.

The same workloads run in two fresh interpreters, one with the fast paths on and one with the
switch set, and must give identical results: vLLM 0.33's own scheduler driving
``kvblock.vllm``'s manager (the fastcall entries, vLLM ``Request`` fields read from the instance
dict, the request slot cache, small ints read from their digits) and kvblock's own manager on
``kvblock.Request`` (``__slots__`` read by offset, ``KVCacheBlocks`` built with ``tp_alloc``).
CI also runs the manager, pool, request, hashing, lockstep and vLLM plugin tests with the
switch set (``make test-no-fast-paths``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Prints one JSON line: which way the switch went and what each workload produced.
SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    sys.path.insert(0, {benches!r})
    from kvblock import KVCacheManager, _core
    from kvblock.replay import peer_workload as W

    out = {{"fast_paths": _core.FAST_PATHS}}
    # kvblock's own API: kvblock.Request's __slots__, KVCacheBlocks results
    res = W.run_e2e(lambda: KVCacheManager(16384, 16, max_model_len=8192, log_stats=True),
                    num_requests=96, record=True)
    out["kvblock_api"] = [res.fingerprint, hashlib.sha256(repr(res.records).encode()).hexdigest()]
    out["kvblock_api_hits"] = [res.hits, res.queries, res.steps, res.free_blocks, res.map_size]
    k = KVCacheManager(64, 16, max_model_len=1024)
    out["blocks_type"] = type(k.empty_kv_cache_blocks).__name__
    if {with_vllm}:
        # vLLM's scheduler on kvblock.vllm's manager: fast entries, dict reads, slot cache
        import vllm_sched as S
        r = S.run("kvblock", lambda: S.shared_workload(48, 16))
        out["vllm_scheduler"] = [r.kind, r.fingerprint, r.steps, r.hits, r.queries, r.finished]
    print(json.dumps(out))
""")


def _run(no_fast_paths: bool, with_vllm: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVBLOCK_NO_FAST_PATHS", None)
    if no_fast_paths:
        env["KVBLOCK_NO_FAST_PATHS"] = "1"
    script = SCRIPT.format(benches=str(REPO / "benches"), with_vllm=with_vllm)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _has_vllm_033() -> bool:
    try:
        import vllm
    except ImportError:
        return False
    return vllm.__version__.startswith(("0.33", "0.34"))


def test_both_ways_give_identical_results():
    with_vllm = _has_vllm_033()
    on, off = _run(False, with_vllm), _run(True, with_vllm)
    assert on.pop("fast_paths") is True and off.pop("fast_paths") is False
    assert on == off
    assert on["kvblock_api_hits"][0] > 0, "the workload should hit the prefix cache"
    if with_vllm:
        assert on["vllm_scheduler"][0] == "kvblock.vllm.manager" and on["vllm_scheduler"][3] > 0


@pytest.mark.parametrize("value, on", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_the_switch_is_read_at_import(value, on):
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "KVBLOCK_NO_FAST_PATHS": value}
    r = subprocess.run([sys.executable, "-c", "from kvblock import _core; print(_core.FAST_PATHS)"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(on)


def test_the_fast_paths_live_in_one_room():
    """Everything that reads CPython internals by layout sits under ``rust/src/py/fast/``:
    no other binding file names the internals the fast paths use."""
    internals = ("_PyObject_GetDictPtr", "tp_version_tag", "PyMemberDescrObject", "d_member", "tp_alloc",
                 "METH_FASTCALL", "PyDescr_NewMethod", "ob_item", ".add(24)", ".add(16)", "tp_vectorcall_offset",
                 "Py_TPFLAGS_HAVE_VECTORCALL")
    fast = REPO / "rust" / "src" / "py" / "fast"
    found = [f"{p.relative_to(REPO)}: {name}" for p in sorted((REPO / "rust" / "src" / "py").rglob("*.rs"))
             if fast not in p.parents for name in internals if name in p.read_text()]
    assert not found, found


def _outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # the same exception type and message from both
        return "raised", type(e), str(e)


def test_get_block_ids_entry_answers_as_the_python_method():
    """``KVCacheBlocks.get_block_ids`` is a fastcall method of the Rust core
    (``rust/src/py/fast/block_ids_method.rs``) for the scheduler's calls; on every call shape
    and every kind of group it gives what the Python method gives (or raises what it
    raises), with new lists on every call."""
    from kvblock import _core
    from kvblock.manager import IdsBackedBlocks, KVCacheBlocks, _get_block_ids_py

    assert type(IdsBackedBlocks.get_block_ids).__name__ == "method_descriptor"
    Ids = _core.BlockIds
    results = [
        ((),), ([],), (Ids([]),), (Ids([]), [], ()), (Ids([3, 1, 2]),), (Ids([]), [4, 5], (6,)), (Ids([7]), Ids([])),
    ]
    calls = [((), {}), ((True,), {}), ((False,), {}), ((), {"allow_none": True}), ((), {"allow_none": False}),
             ((1,), {}), ((0,), {}), ((None,), {}), ((), {"group_ids": [0]}), ((True,), {"group_ids": []}),
             ((True, True), {}), ((), {"allow_none": True, "group_ids": [0]}), ((), {"nope": 1}),
             ((), {"allow_none": True, "nope": 1})]
    for ids in results:
        b = KVCacheBlocks._from_ids(None, ids)
        for args, kwargs in calls:
            fast, slow = _outcome(b.get_block_ids, *args, **kwargs), _outcome(_get_block_ids_py, b, *args, **kwargs)
            assert fast == slow, (ids, args, kwargs, fast, slow)
        first, second = b.get_block_ids(), b.get_block_ids()
        assert all(x is not y for x, y in zip(first, second)), "every call gives new lists"
    # _ids that are not a tuple of BlockIds / list / tuple, or missing: the Python method's answer
    odd = KVCacheBlocks._from_ids(None, ())
    odd._ids = [Ids([1])]
    assert _outcome(odd.get_block_ids) == _outcome(_get_block_ids_py, odd)
    odd._ids = (range(3),)
    assert odd.get_block_ids() == ([0, 1, 2],) == _get_block_ids_py(odd)
    bare = object.__new__(KVCacheBlocks)
    assert _outcome(bare.get_block_ids)[:2] == ("raised", AttributeError)
    assert _outcome(bare.get_block_ids) == _outcome(_get_block_ids_py, bare)
    with pytest.raises(ValueError):
        _core._fast_get_block_ids(KVCacheBlocks, _get_block_ids_py)  # made once, for IdsBackedBlocks
