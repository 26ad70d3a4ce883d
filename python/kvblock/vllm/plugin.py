"""Swapping kvblock into vLLM (0.32.x-0.34.x, :mod:`kvblock.vllm.releases`): :func:`patch` and the ``vllm.general_plugins`` entry
point :func:`register`.

:func:`patch` replaces, in vLLM's own modules, the names vLLM code builds its KV cache
management from:

* ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (and the scheduler's name for it) ->
  :class:`kvblock.vllm.KVCacheManager` (kvblock's Rust manager, or vLLM's own manager for a
  configuration kvblock does not manage, with one warning);
* ``vllm.v1.core.kv_cache_manager.KVCacheBlocks`` -> kvblock's subclass;
* ``vllm.v1.core.block_pool.BlockPool`` -> :class:`kvblock.BlockPool` (vLLM's object API over
  the Rust pool);
* ``get_request_block_hasher``, ``init_none_hash``, ``hash_block_tokens`` and the hash
  functions (``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``, ``get_hash_fn_by_name``)
  -> kvblock's byte-identical Rust hashing (``NONE_HASH`` is kept the same in both).

vLLM's coordinator and per-type managers, used only by the fallback, keep vLLM's own
``BlockPool``. :func:`unpatch` restores everything.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import releases
from .config import env_flag
from .originals import keep_original, original, original_key

__all__ = ["is_patched", "patch", "register", "unpatch"]

_PATCHED: list[tuple[Any, str, Any]] = []


def _set(module: Any, name: str, value: Any) -> None:
    keep_original(module, name)
    key = original_key(name)
    _PATCHED.append((module, name, getattr(module, key)))
    setattr(module, name, value)


def is_patched() -> bool:
    """True once :func:`patch` has run (and :func:`unpatch` has not)."""
    return bool(_PATCHED)


def hash_block_tokens(
    hash_function: Any, parent_block_hash: Any, curr_block_token_ids: Any, extra_keys: Any = None
) -> bytes:
    """vLLM's ``hash_block_tokens``: kvblock's Rust hashing for the shapes vLLM's block
    hashes have, and vLLM's own way (``hash_function`` on the 3-tuple) for anything else,
    as vLLM hashes whatever it is given."""
    from .. import hashing

    if not parent_block_hash:
        parent_block_hash = hashing._root(hash_function)
    if (
        isinstance(hash_function, hashing.HashFunction)
        and isinstance(parent_block_hash, bytes)
        and (extra_keys is None or isinstance(extra_keys, tuple))
    ):
        try:
            return hashing.hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)
        except (TypeError, ValueError):
            pass
    return hashing.BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Any, num_hash_lookahead_tokens: int = 0) -> Any:
    """vLLM's ``get_request_block_hasher`` (same arguments; bools count as ints, as in vLLM):
    kvblock's Rust request hasher for kvblock's hash functions, vLLM's per-block way for any
    other callable."""
    import operator

    from .. import hashing

    return hashing.get_request_block_hasher(
        operator.index(hash_block_size), caching_hash_fn, operator.index(num_hash_lookahead_tokens)
    )


def patch() -> None:
    """Swap kvblock into vLLM (idempotent). Raises :class:`~kvblock.vllm.releases.UnsupportedVllmRelease` (a RuntimeError) for a vLLM outside the window."""
    if _PATCHED:
        return
    releases.check()
    vkm = importlib.import_module("vllm.v1.core.kv_cache_manager")
    vbp = importlib.import_module("vllm.v1.core.block_pool")
    vku = importlib.import_module("vllm.v1.core.kv_cache_utils")
    vhash = importlib.import_module("vllm.utils.hashing")
    vsched = importlib.import_module("vllm.v1.core.sched.scheduler")
    vcore = importlib.import_module("vllm.v1.engine.core")

    from .. import hashing
    from .block_pool import BlockPool
    from .blocks import KVCacheBlocks
    from .manager import KVCacheManager

    _set(vkm, "KVCacheManager", KVCacheManager)
    _set(vkm, "KVCacheBlocks", KVCacheBlocks)
    _set(vsched, "KVCacheManager", KVCacheManager)
    if hasattr(vsched, "KVCacheBlocks"):
        _set(vsched, "KVCacheBlocks", KVCacheBlocks)
    _set(vbp, "BlockPool", BlockPool)

    # hashing: kvblock's functions are byte-identical to vLLM's
    fns = {}
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        if hasattr(vhash, name):
            fns[name] = hashing.get_hash_fn_by_name(name)
            _set(vhash, name, fns[name])
    _set(vhash, "get_hash_fn_by_name", hashing.get_hash_fn_by_name)

    original_init = original(vku, "init_none_hash")
    # vLLM picks a random root seed for its non-cryptographic functions by identity
    if hasattr(vku, "_NON_CRYPTO_HASH_FUNCTIONS"):
        kv = {fns[n] for n in ("xxhash", "xxhash_cbor") if n in fns}
        _set(vku, "_NON_CRYPTO_HASH_FUNCTIONS", frozenset(vku._NON_CRYPTO_HASH_FUNCTIONS) | kv)

    def init_none_hash(hash_fn: Any) -> None:
        """vLLM's ``init_none_hash``, also setting kvblock's root (the two stay equal)."""
        original_init(hash_fn)
        hashing._set_none_hash(vku.NONE_HASH, vku._NONE_HASH_SEED, hash_fn)

    init_none_hash.__wrapped__ = original_init  # type: ignore[attr-defined]
    for module in (vku, vcore):
        if hasattr(module, "init_none_hash"):
            _set(module, "init_none_hash", init_none_hash)
    for module in (vku, vcore):
        if hasattr(module, "get_request_block_hasher"):
            _set(module, "get_request_block_hasher", get_request_block_hasher)
    _set(vku, "hash_block_tokens", hash_block_tokens)
    # the engine core resolves the hash function by name from vllm.utils.hashing
    if hasattr(vcore, "get_hash_fn_by_name"):
        _set(vcore, "get_hash_fn_by_name", hashing.get_hash_fn_by_name)
    # vLLM's root, if set already, becomes kvblock's too
    if getattr(vku, "NONE_HASH", None) is not None:
        hashing._set_none_hash(vku.NONE_HASH, vku._NONE_HASH_SEED, None)


def unpatch() -> None:
    """Undo :func:`patch`."""
    while _PATCHED:
        module, name, original = _PATCHED.pop()
        setattr(module, name, original)


def register() -> None:
    """What the ``vllm.general_plugins`` entry point (:func:`kvblock.vllm_plugin.register`,
    which imports nothing of vLLM while kvblock is off) does: swaps kvblock in when ``KVBLOCK_VLLM`` is on (``1``, ``true``, ``yes``, ``on``), in every vLLM
    process that loads plugins; unset or off (``0``, ``false``, ``no``, ``off``) it does
    nothing. Idempotent.

    Raises:
        UnsupportedVllmRelease: a vLLM outside the window (a RuntimeError).
        ValueError: a ``KVBLOCK_VLLM`` value that is neither on nor off.
    """
    if not env_flag("KVBLOCK_VLLM"):
        return
    patch()
