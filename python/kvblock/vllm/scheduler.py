"""vLLM 0.33.0 schedulers whose KV cache manager is kvblock's: ``--scheduler-cls
kvblock.vllm.Scheduler`` (async scheduling, vLLM's default) or ``kvblock.vllm.SyncScheduler``.

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


class Scheduler(_vasync.AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling is vLLM's default) on kvblock's KV cache
    manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(_vasync.AsyncScheduler.__init__, self, *args, **kwargs)
