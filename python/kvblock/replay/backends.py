"""The two KV cache manager implementations a replay can drive.

``kvblock``: :class:`kvblock.KVCacheManager` (Rust core) with :func:`kvblock.hash_blocks`.
``reference``: :class:`kvblock.reference.manager.KVCacheManager` (pure Python, vLLM 0.33.0
written for reading) with the reference hash functions. Both are built as vLLM's scheduler
builds its manager: one full-attention group, prefix caching and ``log_stats`` on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .errors import ReplayError

__all__ = ["IMPLS", "Impl", "get_impl"]


@dataclass(frozen=True)
class Impl:
    """One implementation: how to build its manager and hash token blocks with it.

    Attributes:
        name: ``"kvblock"`` or ``"reference"``.
        make_manager: ``(num_blocks, block_size, hash_algo, **retention) -> manager``
            (caching and ``log_stats`` on; it chains from ``root(hash_algo)``; ``retention``: the retention policy's manager arguments).
        hash_chain: ``(tokens, block_size, hash_algo, parent) -> digests`` of every full
            block of the int64 array ``tokens``, chained from ``parent``.
        root: ``(hash_algo) -> bytes``: the root the implementation's managers of that
            algorithm chain from (``none_hash_for``).
        token_lists: ``hash_chain`` wants a list of Python ints rather than an array (the
            conversion is done by the caller, outside the timed hashing).
    """

    name: str
    make_manager: Callable[..., Any]
    hash_chain: Callable[[np.ndarray, int, str, bytes], list]
    root: Callable[[str], bytes]
    token_lists: bool


def _kv_manager(num_blocks: int, block_size: int, hash_algo: str, **retention: Any) -> Any:
    from ..manager import KVCacheManager

    return KVCacheManager(num_blocks, block_size, hash_algo=hash_algo, log_stats=True, **retention)


def _kv_hash_chain(tokens: np.ndarray, block_size: int, hash_algo: str, parent: bytes) -> list:
    from .. import hashing

    return hashing.hash_blocks(tokens, block_size, algo=hash_algo, parent=parent)


def _kv_root(hash_algo: str) -> bytes:
    from .. import hashing

    return hashing.none_hash_for(hashing.get_hash_fn_by_name(hash_algo))


def _ref_manager(num_blocks: int, block_size: int, hash_algo: str, **retention: Any) -> Any:
    from ..reference.manager import KVCacheManager

    return KVCacheManager(num_blocks, block_size, hash_algo=hash_algo, log_stats=True, **retention)


def _ref_hash_chain(tokens: Any, block_size: int, hash_algo: str, parent: bytes) -> list:
    from ..reference import hashing

    return hashing.hash_blocks(tokens, block_size, algo=hash_algo, parent=parent)


def _ref_root(hash_algo: str) -> bytes:
    from ..reference import hashing

    return hashing.none_hash_for(hashing.get_hash_fn_by_name(hash_algo))


#: The implementations by name.
IMPLS: dict[str, Impl] = {
    "kvblock": Impl("kvblock", _kv_manager, _kv_hash_chain, _kv_root, False),
    "reference": Impl("reference", _ref_manager, _ref_hash_chain, _ref_root, True),
}


def get_impl(name: str) -> Impl:
    """The implementation called ``name``.

    Raises:
        ReplayError: an unknown name (the message lists the valid ones).
    """
    try:
        return IMPLS[name]
    except KeyError:
        raise ReplayError(f"unknown --impl {name!r}; choose from {', '.join(IMPLS)}") from None
