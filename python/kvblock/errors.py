"""kvblock's own exception classes, and which Python type each kind of core error raises.

Every class here subclasses the built-in exception a caller already catches, so code written
for the built-in type keeps working. Python code in kvblock picks an exception type or a
behaviour by the exception's *type*, never by its message text (``tests/test_error_types.py``
fails when a match on message text comes back).

The Rust core has one error enum (``rust/src/error.rs``); ``rust/src/py/errors.rs`` maps each
kind to one Python type:

* ``Value``: ``ValueError``; ``NotEnoughFreeBlocks`` and ``NoFreeBlocks``: ``ValueError``
  with vLLM's "Cannot get N free blocks from the pool" / "No free blocks available";
* ``Type``: ``TypeError``; ``NotFound``: ``KeyError``; ``State``: ``RuntimeError``;
* ``Assertion``: ``AssertionError`` (where vLLM ``assert``-s); ``Index``: ``IndexError``
  (vLLM's callers only); ``NotImplemented``: ``NotImplementedError``; ``Memory``:
  ``MemoryError``;
* ``StaleHit``: :class:`StaleHitError` (a ``ValueError``).

Which of vLLM's types a configuration error takes is decided in the core, by the caller
dialect (``spec::Caller``): for kvblock's own API a refused configuration is a ``ValueError``
naming the argument; for vLLM's callers (``kvblock.vllm``) it is an ``AssertionError`` where
vLLM's constructors assert and a ``ValueError`` with vLLM's own message where they raise one.
vLLM's callers only ever see built-in types (vLLM's tests compare exception types exactly).
"""

from __future__ import annotations

from . import _core

__all__ = ["IntOutOfRangeError", "MissingExtraError", "StaleHitError"]

#: Hit blocks passed to ``allocate_slots`` were evicted and handed out again after
#: ``get_computed_blocks`` returned them (kvblock's own API); nothing changed. A ``ValueError``.
StaleHitError = _core.StaleHitError

#: An int argument that does not fit in 64 bits: a ``ValueError`` (kvblock's API) and an
#: ``OverflowError`` (what Python raises where such an int is a size or an index).
IntOutOfRangeError = _core.IntOutOfRangeError


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed: the message says what needs it and what to
    ``pip install`` (raised by ``kvblock._optional.require``). A ``ModuleNotFoundError`` whose
    ``name`` is the missing module, so code catching that or ``ImportError`` sees it."""
