"""Stock vLLM's own objects, kept where kvblock replaces them.

:func:`kvblock.vllm.patch` (and kvblock's HiSparse coordinator lookup) swaps names in vLLM's
modules; before replacing ``module.<name>`` it keeps the stock value on the module under a
private attribute, so that code running stock vLLM beside kvblock in one process (the
fallback manager, the oracles, lockstep tests and benchmarks) can still reach it, and
:func:`kvblock.vllm.unpatch` can restore it. Imports nothing of vLLM or of kvblock.
"""

from __future__ import annotations

from typing import Any

__all__ = ["keep_original", "original", "original_key"]


def original_key(name: str) -> str:
    """The module attribute that holds stock vLLM's ``<name>`` once kvblock replaced it."""
    return f"_kvblock_original_{name}"


def original(module: Any, name: str) -> Any:
    """Stock vLLM's ``module.<name>``: the value kvblock replaced, kept on the module, else
    the module's current one. Raises AttributeError if the module has no ``name``."""
    try:
        return getattr(module, original_key(name))
    except AttributeError:
        return getattr(module, name)


def keep_original(module: Any, name: str) -> None:
    """Keep ``module.<name>`` as stock vLLM's (see :func:`original`) before kvblock replaces
    it; a no-op when it is kept already. Raises AttributeError if the module has no ``name``."""
    key = original_key(name)
    if not hasattr(module, key):
        setattr(module, key, getattr(module, name))
