"""kvblock inside vLLM: one wheel for vLLM 0.32.x, 0.33.x and 0.34.x (:mod:`kvblock.vllm.releases`).

* :class:`KVCacheManager`: vLLM's ``KVCacheManager`` (same constructor, methods and result
  types) on kvblock's Rust core; :class:`BlockPool` is kvblock's vLLM-compatible pool.
* :class:`Scheduler` / :class:`SyncScheduler`: vLLM's schedulers on that manager, for
  ``vllm serve MODEL --scheduler-cls kvblock.vllm.Scheduler`` or
  ``LLM(..., scheduler_cls="kvblock.vllm.Scheduler")``.
* :func:`patch`: swap kvblock into vLLM in this process (the manager, the block pool, the
  request block hasher, ``init_none_hash`` and the hash functions); :func:`register` is the
  ``vllm.general_plugins`` entry point that does it when ``KVBLOCK_VLLM=1``.
* :func:`describe`: which manager a ``KVCacheConfig`` gets, and why.
* ``python -m pytest -p kvblock.vllm.testing ...`` runs any vLLM test with kvblock swapped in.

Importing this package imports vLLM; ``import kvblock`` never does.
"""

from __future__ import annotations

from .._optional import require

require("vllm", package="vLLM (0.32.x-0.34.x)", extra="vllm", what="kvblock.vllm")

from . import releases  # noqa: E402

# both routes (the scheduler classes, the plugin / patch()) import this package first: a vLLM
# outside the window is refused here, before any engine state exists
releases.check()

from .block_pool import BlockPool  # noqa: E402
from .config import Path, describe  # noqa: E402
from .manager import KVCacheManager, UnsupportedConfiguration  # noqa: E402
from .plugin import is_patched, patch, register, unpatch  # noqa: E402
from .releases import WINDOW, UnsupportedVllmRelease  # noqa: E402
from .scheduler import Scheduler, SyncScheduler  # noqa: E402

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "Path",
    "Scheduler",
    "SyncScheduler",
    "UnsupportedConfiguration",
    "UnsupportedVllmRelease",
    "WINDOW",
    "describe",
    "is_patched",
    "patch",
    "register",
    "unpatch",
]
