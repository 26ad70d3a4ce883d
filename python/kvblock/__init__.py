"""kvblock: vLLM's Automatic Prefix Caching block manager with a Rust core.

Block hashes, block ids and free-queue order are identical to vLLM 0.33.0.
"""

from . import _core
from . import hashing
from .hashing import (
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    hash_blocks,
    init_none_hash,
)
from .request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
    SamplingParams,
)

__version__ = _core.__version__


def __getattr__(name: str):
    # NONE_HASH is reassigned by init_none_hash: always read the current value.
    if name == "NONE_HASH":
        return hashing.NONE_HASH
    raise AttributeError(f"module 'kvblock' has no attribute {name!r}")


__all__ = [
    "LoRARequest",
    "MultiModalFeatureSpec",
    "NONE_HASH",
    "PlaceholderRange",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "__version__",
    "get_hash_fn_by_name",
    "hashing",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_blocks",
    "init_none_hash",
]
