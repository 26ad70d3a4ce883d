"""The ``vllm.general_plugins`` entry point (``kvblock = "kvblock.vllm_plugin:register"``).

vLLM loads general plugins in every process it starts, whether kvblock is turned on or not,
so this module imports nothing from vLLM and nothing that checks vLLM's release: with
``KVBLOCK_VLLM`` off it does nothing, and a vLLM outside kvblock's window is only refused
(with :class:`kvblock.vllm.UnsupportedVllmRelease`, naming the window) when kvblock is on.
"""

from __future__ import annotations

from ._env import env_flag

__all__ = ["register"]


def register() -> None:
    """Swap kvblock into vLLM when ``KVBLOCK_VLLM`` is on (``1``, ``true``, ``yes``, ``on``):
    :func:`kvblock.vllm.patch`, in every vLLM process that loads plugins. Unset or off (``0``,
    ``false``, ``no``, ``off``) it does nothing. Idempotent. (The first kvblock manager an engine
    builds logs one INFO line, ``kvblock <version> manages the KV cache ...``, on either route.)

    Raises:
        kvblock.vllm.UnsupportedVllmRelease: kvblock is on and the installed vLLM is outside
            kvblock's window (a RuntimeError).
        ValueError: a ``KVBLOCK_VLLM`` value that is neither on nor off.
    """
    if not env_flag("KVBLOCK_VLLM"):
        return
    from .vllm import plugin

    plugin.register()
