"""vLLM's schedulers (0.32.x-0.34.x) whose KV cache manager is kvblock's: ``--scheduler-cls
kvblock.vllm.Scheduler``, which is the scheduler vLLM itself picks for the configuration
(its ``AsyncScheduler`` with async scheduling on, vLLM's default; its synchronous
``Scheduler`` where async scheduling is off, as vLLM's CPU platform sets it), or
``kvblock.vllm.SyncScheduler`` (always the synchronous one).

They are vLLM's own ``AsyncScheduler`` / ``Scheduler`` with one change: the manager they
build is :class:`kvblock.vllm.KVCacheManager` (vLLM's own for a configuration kvblock does not
manage, with one warning). Use them without :func:`kvblock.vllm.patch`; the patch swaps
kvblock into every scheduler instead.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.core.sched import async_scheduler as _vasync
from vllm.v1.core.sched import scheduler as _vsched

from .manager import KVCacheManager

__all__ = ["Scheduler", "SyncScheduler"]

_lock = threading.Lock()


def _build(init: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    # vLLM's Scheduler.__init__ builds its manager from its module's KVCacheManager name
    with _lock:
        previous = _vsched.KVCacheManager
        _vsched.KVCacheManager = KVCacheManager
        try:
            init(self, *args, **kwargs)
        finally:
            _vsched.KVCacheManager = previous


class SyncScheduler(_vsched.Scheduler):
    """vLLM's synchronous ``Scheduler`` on kvblock's KV cache manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(_vsched.Scheduler.__init__, self, *args, **kwargs)


def _async_scheduling(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``vllm_config.scheduler_config.async_scheduling`` of a scheduler's arguments (vLLM
    passes ``vllm_config`` first, by keyword or position); True where it cannot be read."""
    cfg = kwargs.get("vllm_config", args[0] if args else None)
    return bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", True))


class Scheduler(_vasync.AsyncScheduler):
    """The scheduler vLLM picks for the configuration, on kvblock's KV cache manager: vLLM's
    ``AsyncScheduler`` with async scheduling on (vLLM's default); with it off
    (``--no-async-scheduling``, or vLLM's CPU platform, which turns it off), constructing this
    class gives a :class:`SyncScheduler`, vLLM's synchronous ``Scheduler``, as vLLM's own choice
    would. A subclass of this class is always built as itself."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Scheduler and not _async_scheduling(args, kwargs):
            return SyncScheduler(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(_vasync.AsyncScheduler.__init__, self, *args, **kwargs)
