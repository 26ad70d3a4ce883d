"""Errors are mapped by type, never by message text (issue 34).

The Rust core raises typed errors (``rust/src/error.rs``), ``rust/src/py/errors.rs`` maps each
kind to one Python type, and the caller dialect (``spec::Caller``) decides in the core whether a
configuration error is vLLM's ``ValueError`` or vLLM's ``AssertionError``. Python code in
kvblock then picks a type or a behaviour by ``isinstance``/``except``, never by reading the
message. ``vllm/manager.py`` once chose between ``ValueError`` and ``AssertionError`` by
matching ``"prefix_cache_retention_interval" in str(e)``; the source scans below fail when such
a match comes back, and the behaviour tests pin the types it produced.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvblock
from kvblock.errors import IntOutOfRangeError, MissingExtraError, StaleHitError

REPO = Path(__file__).resolve().parent.parent
PY_SOURCES = sorted((REPO / "python" / "kvblock").rglob("*.py"))
RUST_BINDINGS = sorted((REPO / "rust" / "src" / "py").rglob("*.rs"))

#: String methods that read text.
TEXT_METHODS = {"startswith", "endswith", "find", "rfind", "index", "rindex", "count", "split", "rsplit",
                "partition", "rpartition", "removeprefix", "removesuffix"}


def _exception_names(fn: ast.AST) -> set[str]:
    """Parameters annotated with an exception type (``e: ModuleNotFoundError``)."""
    out = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for a in fn.args.args + fn.args.kwonlyargs:
            ann = ast.unparse(a.annotation) if a.annotation is not None else ""
            if re.search(r"(Error|Exception|Exit|Interrupt)\b", ann):
                out.add(a.arg)
    return out


def _reads_text(node: ast.AST, names: set[str]) -> bool:
    """True if ``node`` is the text of one of the exceptions ``names``: ``str(e)``,
    ``repr(e)``, ``format(e)``, ``e.args``/``e.args[0]``, an f-string holding ``e``, or a
    name that holds such text."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr", "format"):
        return any(_reads_text(a, names) or (isinstance(a, ast.Name) and a.id in names) for a in node.args)
    if isinstance(node, ast.Subscript):
        return _reads_text(node.value, names)
    if isinstance(node, ast.Attribute) and node.attr in ("args", "msg", "message"):
        return isinstance(node.value, ast.Name) and node.value.id in names
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) and _reads_text(v.value, names) for v in node.values)
    return False


def text_matches(tree: ast.AST) -> list[int]:
    """Line numbers where an exception's message text is compared or searched."""
    hits: list[int] = []
    scopes: list[tuple[ast.AST, set[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.name:
            scopes.append((node, {node.name}))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (names := _exception_names(node)):
            scopes.append((node, names))
    for scope, exc in scopes:
        text: set[str] = set()  # names assigned the exception's text (msg = str(e))
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and _reads_text(node.value, exc):
                text |= {t.id for t in node.targets if isinstance(t, ast.Name)}

        def is_text(n: ast.AST) -> bool:
            return (_reads_text(n, exc) and not (isinstance(n, ast.Name) and n.id in exc)) or (
                isinstance(n, ast.Name) and n.id in text)

        for node in ast.walk(scope):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq))
                                                     for op in node.ops):
                if any(is_text(n) for n in [node.left, *node.comparators]):
                    hits.append(node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in TEXT_METHODS and is_text(node.func.value):
                    hits.append(node.lineno)
                elif (isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                      and any(is_text(a) for a in node.args)):
                    hits.append(node.lineno)
    return sorted(set(hits))


def test_the_scan_finds_the_matches_it_forbids():
    """The scan itself: each way of reading a message it must catch, and the type-based
    code it must let through."""
    bad = '''
try:
    f()
except ValueError as e:
    if "prefix_cache_retention_interval" in str(e):
        raise ValueError(str(e).split(": ", 1)[-1]) from None
    msg = str(e)
    if msg.startswith("Multi-module"):
        pass
    if e.args[0] == "x":
        pass
    if re.search("x", str(e)):
        pass

def hint(e: ModuleNotFoundError) -> str:
    msg = str(e)
    return msg if "pip install" in msg else msg + "!"
'''
    assert text_matches(ast.parse(bad)) == [5, 6, 8, 10, 12, 17]
    good = '''
try:
    f()
except ValueError as e:
    if isinstance(e, StaleHitError):
        raise
    print(f"kvblock: error: {e}")
    raise RuntimeError(str(e)) from e
'''
    assert text_matches(ast.parse(good)) == []


@pytest.mark.parametrize("path", PY_SOURCES, ids=lambda p: str(p.relative_to(REPO / "python")))
def test_python_never_picks_a_type_by_message_text(path):
    hits = text_matches(ast.parse(path.read_text(), str(path)))
    assert not hits, f"{path}: lines {hits} read an exception's message to decide; map by type (kvblock.errors)"


def test_the_bindings_never_read_an_error_message():
    """The Rust side maps error *kinds* (``errors::to_py``, ``asserted_for``): nothing in
    ``rust/src/py/`` searches an error's text."""
    pat = re.compile(r"(to_string\(\)|\.value\(py\)[^;]*|msg|message)\s*\.(contains|starts_with|ends_with|find)\(")
    found = [f"{p.relative_to(REPO)}:{i}" for p in RUST_BINDINGS
             for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert not found, found


def test_kvblock_error_classes_subclass_the_builtins_callers_catch():
    assert issubclass(StaleHitError, ValueError)
    assert issubclass(IntOutOfRangeError, ValueError) and issubclass(IntOutOfRangeError, OverflowError)
    assert issubclass(MissingExtraError, ModuleNotFoundError)
    assert kvblock.StaleHitError is StaleHitError and kvblock.MissingExtraError is MissingExtraError


FULL = {"kind": "full_attention", "block_size": 16}
#: (case, groups, the constructor's keywords, vLLM's type and message, kvblock's message)
CONFIG_CASES = [
    ("retention without a sparse group", [FULL], {"retention_interval": 16},
     ValueError, r"^is set but this model has no sliding-window", r"^prefix_cache_retention_interval: is set"),
    ("negative retention", [FULL], {"retention_interval": -16},
     ValueError, r"^\(-16\) must be non-negative", r"^prefix_cache_retention_interval: \(-16\)"),
    ("multi-module MTP", [FULL], {"use_eagle": True, "num_prefill_lookahead": 32},
     ValueError, r"^Multi-module MTP with prefix caching", r"^num_prefill_lookahead: Multi-module MTP"),
    ("scheduler block size", [FULL], {"scheduler_block_size": 24},
     AssertionError, r"^scheduler_block_size: 24 is not a multiple", r"^scheduler_block_size: 24 is not a multiple"),
    ("bad group dict", [{"kind": "nonsense", "block_size": 16}], {},
     AssertionError, r"^kv_cache_groups\[0\]: kvblock does not manage", r"^kv_cache_groups\[0\]: kvblock does not"),
    ("zero block size", [{"kind": "full_attention", "block_size": 0}], {"scheduler_block_size": 16},
     AssertionError, r"^kv_cache_groups\[0\]: block_size must be > 0", r"^kv_cache_groups\[0\]: block_size"),
]


@pytest.mark.parametrize("case, groups, kw, vllm_type, vllm_msg, kvblock_msg", CONFIG_CASES,
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_errors_take_their_type_from_the_caller_in_the_core(case, groups, kw, vllm_type, vllm_msg,
                                                                    kvblock_msg):
    """The type a refused configuration raises is decided in the core by the caller dialect:
    for vLLM's callers exactly vLLM's type (its ValueError with vLLM's own message, or the
    AssertionError of its ``assert``); for kvblock's API a ``ValueError`` naming the argument."""
    from kvblock import _core

    args = dict(kw)
    sched = args.pop("scheduler_block_size", 16)
    for caller, want, msg in (("vllm", vllm_type, vllm_msg), ("kvblock", ValueError, kvblock_msg)):
        pool = kvblock.BlockPool(64, True, 16, False)
        with pytest.raises(want, match=msg) as info:
            _core.KVCacheManagerCore(pool, groups, 256, sched, 16, caller=caller, **args)
        assert type(info.value) is want, (caller, info.value)


def test_missing_extra_is_typed(monkeypatch):
    """``missing_message`` adds the install hint to a bare ``No module named X`` only: a
    :class:`MissingExtraError` already carries it (decided by type, not by looking for
    "pip install" in the text)."""
    from kvblock._optional import missing_message, require

    monkeypatch.setitem(__import__("sys").modules, "kvblock_test_absent_extra", None)
    with pytest.raises(MissingExtraError) as info:
        require("kvblock_test_absent_extra", package="x", extra="x", what="y")
    assert missing_message(info.value) == str(info.value)
    bare = ModuleNotFoundError("No module named 'zmq'", name="zmq")
    assert missing_message(bare) == "No module named 'zmq': pip install pyzmq (kvblock's 'cluster' extra)"
    # a bare error whose text happens to say "pip install" still gets the hint: the type decides
    odd = ModuleNotFoundError("No module named 'zmq' (pip install failed)", name="zmq")
    assert missing_message(odd).endswith("pip install pyzmq (kvblock's 'cluster' extra)")


def _exported_exception_classes():
    """Every exception class kvblock exports: the ``__all__`` of the package and of the modules
    that define its errors (``kvblock.vllm``'s need vLLM and are left out)."""
    import importlib
    import inspect

    found = {}
    for mod in ("kvblock", "kvblock.errors", "kvblock.replay", "kvblock.replay.errors", "kvblock.cluster",
                "kvblock.cluster.errors"):
        m = importlib.import_module(mod)
        for name in getattr(m, "__all__", []):
            obj = getattr(m, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


#: One instance of each, built as kvblock raises it (classes whose constructor takes more than
#: a message).
_EXAMPLES = {
    "TraceFormatError": lambda cls: cls("trace.jsonl", 7, "not JSON"),
    "UnservableRequestsError": lambda cls: cls("2 requests need more blocks than the cache holds", 2),
    "SettingError": lambda cls: cls("num_blocks", "{name} must be >= 2, got 1"),
    "MissingExtraError": lambda cls: cls("No module named 'zmq': pip install pyzmq", name="zmq"),
}


@pytest.mark.parametrize("qualname", sorted(_exported_exception_classes()))
def test_every_exported_exception_pickles(qualname):
    """An error raised in a worker process (multiprocessing, Ray, vLLM's engine core) crosses
    the process boundary by pickle: each exported class is importable under its
    ``__module__`` (``kvblock.StaleHitError``, not ``_core.StaleHitError``) and round-trips
    with its type, message and attributes."""
    import pickle

    cls = _exported_exception_classes()[qualname]
    make = _EXAMPLES.get(cls.__name__, lambda c: c("what went wrong"))
    err = make(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(err).items()}
    module = __import__(cls.__module__, fromlist=["_"])
    assert getattr(module, cls.__qualname__) is cls


def test_stale_hit_error_is_named_by_its_public_module():
    assert StaleHitError.__module__ == "kvblock" and StaleHitError.__qualname__ == "StaleHitError"
