"""Pure-Python reference of kvblock: the readable spec and the oracle.

Everything here mirrors vLLM 0.33.0 with the standard library plus ``cbor2`` and ``xxhash``,
and has the same API as the Rust-backed package. Tests run both in lockstep; benchmarks
measure kvblock against it.
"""

from . import hashing
from .hashing import (
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    hash_blocks,
    init_none_hash,
)

__all__ = [
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_blocks",
    "hashing",
    "init_none_hash",
]
