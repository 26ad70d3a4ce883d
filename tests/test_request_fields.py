"""The request attributes Rust reads are declared in one place on each side, and the two agree
(issue 34): ``rust/src/py/fields.rs`` (``Field`` / ``NAMES``, exported as
``kvblock._core.REQUEST_FIELDS``) and ``kvblock.request.RUST_READS``. Renaming a field of
``kvblock.Request`` without renaming it in Rust (or the other way round) fails here, not as a
slow path or an ``AttributeError`` at run time."""

from __future__ import annotations

import re
from pathlib import Path

from kvblock import _core
from kvblock.request import RUST_READS, VLLM_ONLY_READS, Request

REPO = Path(__file__).resolve().parent.parent
BINDINGS = REPO / "rust" / "src" / "py"


def test_the_rust_list_and_the_python_list_are_the_same():
    assert _core.REQUEST_FIELDS == RUST_READS
    assert len(set(RUST_READS)) == len(RUST_READS)


def test_the_rust_source_declares_the_same_list():
    """The Rust table itself (not only the installed binary, which may be stale)."""
    src = (BINDINGS / "fields.rs").read_text()
    table = re.search(r"pub const NAMES: \[&str; N\] = \[(.*?)\];", src, re.S)
    assert table is not None
    assert tuple(re.findall(r'"([^"]+)"', table[1])) == RUST_READS
    variants = re.search(r"pub enum Field \{(.*?)\n\}", src, re.S)
    assert variants is not None
    assert len(re.findall(r"^    [A-Z]\w*,", variants[1], re.M)) == len(RUST_READS)


def test_every_field_rust_reads_is_an_attribute_of_kvblock_request():
    slots = set(Request.__slots__)
    missing = [n for n in RUST_READS if n not in VLLM_ONLY_READS and n not in slots and not hasattr(Request, n)]
    assert not missing, f"kvblock.Request has no {missing}: rename them in rust/src/py/fields.rs too"
    assert VLLM_ONLY_READS <= set(RUST_READS)
    assert not [n for n in VLLM_ONLY_READS if n in slots or hasattr(Request, n)], "no longer vLLM-only"


def test_rust_reads_request_attributes_only_through_the_list():
    """No request attribute is read by a name spelled out elsewhere in the bindings: each read
    goes through ``Field`` (``fields.get`` / ``Field::X.interned(py)``)."""
    pat = re.compile(r"\b(request|req|r)\.(getattr|call_method0|call_method1|setattr|hasattr)\(\s*(pyo3::)?intern!")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sorted(BINDINGS.rglob("*.rs"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert not found, found
