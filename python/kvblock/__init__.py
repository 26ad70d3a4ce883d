"""kvblock: vLLM's Automatic Prefix Caching block manager with a Rust core.

Block hashes, block ids and free-queue order are identical to vLLM's (0.32, 0.33 and 0.34):

* :mod:`kvblock.hashing` — chained block hashing (``sha256``, ``sha256_cbor``, ``xxhash``,
  ``xxhash_cbor``), :func:`hash_blocks`, vLLM's request block hasher;
* :class:`BlockPool` — the block pool (vLLM's object API plus a fast id API);
* :class:`KVCacheManager` — a drop-in for vLLM's ``KVCacheManager``, one KV-cache group or
  several (hybrid models: full, sliding window, chunked local, Mamba, cross attention);
* :mod:`kvblock.vllm` — vLLM's own scheduler on kvblock's manager, pool and hasher;
* :mod:`kvblock.cluster` — the fleet prefix index, KV-event subscriber and cache-aware router;
* :class:`Request` — request bookkeeping with incremental block hashes;
* :mod:`kvblock.events` — KV events in vLLM's msgpack wire format;
* :mod:`kvblock.errors` — kvblock's exception classes (each a subclass of a built-in one);
* :mod:`kvblock.reference` — the pure-Python reference of all of the above.
"""


def _is_the_kvblock_command() -> bool:
    """True while this process is the ``kvblock`` command (its console script, or
    ``python -m kvblock``) rather than a program importing the library."""
    import os
    import sys

    if sys.argv and os.path.basename(sys.argv[0]).removesuffix(".exe") == "kvblock":
        return True
    orig = list(getattr(sys, "orig_argv", ()))
    return sys.argv[:1] == ["-m"] and any(a == "-m" and b == "kvblock" for a, b in zip(orig, orig[1:]))


try:
    from . import _core, hashing
    from .block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
    from .errors import IntOutOfRangeError, MissingExtraError, StaleHitError
    from .hashing import (
        get_hash_fn_by_name,
        get_request_block_hasher,
        hash_block_tokens,
        hash_blocks,
        hash_requests,
        init_none_hash,
    )
    from .manager import KVCacheBlocks, KVCacheManager
    from .request import (
        LoRARequest,
        MultiModalFeatureSpec,
        PlaceholderRange,
        Request,
        RequestStatus,
        SamplingParams,
    )
    from .stats import PrefixCacheStats
except KeyboardInterrupt:
    # Ctrl-C while the package itself imports, before cli.main() can catch it: the command
    # ends as Ctrl-C later does (one line, exit status 130); a library user's import still
    # raises KeyboardInterrupt
    if not _is_the_kvblock_command():
        raise
    import sys as _sys

    print("kvblock: interrupted", file=_sys.stderr)
    raise SystemExit(130) from None

__version__ = _core.__version__


def __getattr__(name: str):
    # NONE_HASH is reassigned by init_none_hash: always read the current value.
    if name == "NONE_HASH":
        return hashing.NONE_HASH
    if name in ("BlockTable", "MultiGroupBlockTable", "PAD_SLOT_ID"):
        from .worker import block_table  # imports torch: only when asked for

        return getattr(block_table, name)
    raise AttributeError(f"module 'kvblock' has no attribute {name!r}")


__all__ = [
    "BlockPool",
    "BlockTable",
    "FreeKVCacheBlockQueue",
    "IntOutOfRangeError",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "LoRARequest",
    "MissingExtraError",
    "MultiGroupBlockTable",
    "MultiModalFeatureSpec",
    "NONE_HASH",
    "PAD_SLOT_ID",
    "PlaceholderRange",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StaleHitError",
    "__version__",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_blocks",
    "hash_requests",
    "hashing",
    "init_none_hash",
]
