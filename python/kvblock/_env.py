"""Environment switches (``KVBLOCK_VLLM``, ``KVBLOCK_VLLM_STRICT``, ...), read the same way
everywhere. Imports nothing optional."""

from __future__ import annotations

import os

__all__ = ["env_flag"]


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` turns a switch on: unset, empty, ``0``,
    ``false``, ``no`` and ``off`` (any case) are off; ``1``, ``true``, ``yes`` and ``on`` are on.

    Raises:
        ValueError: any other value (naming the variable), rather than guessing.
    """
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/true/yes/on or 0/false/no/off")
