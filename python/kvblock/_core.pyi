"""Typed surface of ``kvblock._core``, the compiled Rust core (checked against the binary by
``tests/test_stubs.py``). Use the Python modules (``kvblock.hashing``, ``kvblock.BlockPool``,
``kvblock.KVCacheManager``) rather than these names directly."""

from typing import Any, Callable, Sequence, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

__all__ = [
    "__version__",
    "BUILD_PROFILE",
    "ALGORITHMS",
    "HashFunction",
    "RequestBlockHasher",
    "BlockPoolCore",
    "BlockIds",
    "KVCacheManagerCore",
    "hash_block_tokens",
    "hash_blocks",
    "hash_requests",
    "hashing_threads",
    "check_token_ids",
    "token_encoder",
]

__version__: str
#: "release" or "debug" (never benchmark a debug build).
BUILD_PROFILE: str
#: The valid block-hash algorithm names, in vLLM's order.
ALGORITHMS: tuple[str, ...]

_Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
_Ids = Sequence[int] | npt.NDArray[np.integer[Any]]

@final
class HashFunction:
    """A vLLM block-hash function: ``fn(obj) -> bytes`` digests the pickle-protocol-5
    (``sha256``, ``xxhash``) or canonical-CBOR (``sha256_cbor``, ``xxhash_cbor``) bytes of
    ``obj`` with SHA-256 (32 bytes) or XXH3-128 (16 bytes). Raises ValueError for an unknown
    name, TypeError for objects block hashing does not use (floats, lists, dicts, ...)."""

    def __new__(cls, name: str) -> HashFunction: ...
    @property
    def name(self) -> str: ...
    @property
    def digest_size(self) -> int: ...
    def __call__(self, obj: Any) -> bytes: ...
    def serialize(self, obj: Any) -> bytes:
        """The bytes fed to the digest for ``obj``."""

@final
class RequestBlockHasher:
    """``hasher(request) -> list[bytes]``: the hashes of the request's newly completed blocks
    (vLLM's ``get_request_block_hasher`` closure, in Rust)."""

    def __new__(
        cls,
        block_size: int,
        hash_fn: HashFunction,
        num_hash_lookahead_tokens: int,
        extra_keys: Callable[[Any, int, int, int, int], list[Any]],
        root: Callable[[], bytes],
        digest_memo_blocks: int = 0,
    ) -> RequestBlockHasher: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_hash_lookahead_tokens(self) -> int: ...
    @property
    def hash_fn(self) -> HashFunction: ...
    @property
    def digest_memo_blocks(self) -> int:
        """Digest-memo slots (0: off; else a power of two)."""
    def digest_memo_info(self) -> tuple[int, int, int]:
        """``(hits, stores, held)``: blocks served from the memo, digests stored, entries held."""
    def clear_digest_memo(self) -> None: ...
    def __call__(self, request: Any) -> list[bytes]: ...

def hash_block_tokens(
    algo: str | HashFunction,
    parent_block_hash: bytes,
    curr_block_token_ids: _Tokens,
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """``HASH((parent_block_hash, tuple(tokens), extra_keys))`` (the parent is used as given)."""

def hash_blocks(
    algo: str | HashFunction,
    token_ids: _Tokens,
    block_size: int,
    parent: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    start: int = 0,
    end: int | None = None,
) -> list[bytes]:
    """Hash every full block of ``token_ids[start:end]`` as one chain from ``parent``; the GIL
    is released for long inputs."""

def hash_requests(requests: list[Any]) -> int:
    """Bring the ``block_hashes`` of many requests up to date; returns blocks hashed in Rust."""

def hashing_threads() -> int:
    """Start the worker threads of ``hash_requests`` (if not started) and return their number."""

def token_encoder() -> str:
    """``"avx512vbmi2"`` or ``"portable"``: the token-id encoder chosen at run time
    (``KVBLOCK_NO_SIMD`` set before the first hash forces the portable one)."""

def check_token_ids(token_ids: list[Any], arg: str = "token_ids") -> None:
    """Raise ``TypeError`` naming ``arg[i]`` at the first item that is not a token id (an int
    of any size or an integer-like with ``__index__``; not a bool)."""

@final
class BlockIds:
    """An immutable sequence of block ids held in Rust (no Python int per block until read)."""

    def __new__(cls, ids: _Ids) -> BlockIds: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int | slice, /) -> Any: ...
    def __iter__(self) -> Any: ...
    def __contains__(self, block_id: int, /) -> bool: ...
    def tolist(self) -> list[int]: ...
    def numpy(self) -> npt.NDArray[np.int32]: ...

@disjoint_base
class BlockPoolCore:
    """The Rust block pool (vLLM 0.33.0 semantics). ``kvblock.BlockPool`` subclasses it with
    vLLM's object API; the methods here are the fast id API (ints and numpy arrays)."""

    def __new__(
        cls, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
        enable_kv_cache_events: bool = False, *args: Any, **kwargs: Any,
    ) -> Self: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    @property
    def enable_caching(self) -> bool: ...
    @property
    def hash_block_size(self) -> int: ...
    @property
    def enable_kv_cache_events(self) -> bool: ...
    @property
    def null_block_id(self) -> int: ...
    def get_num_free_blocks(self) -> int: ...
    def get_usage(self) -> float: ...
    @staticmethod
    def bytes_per_block() -> int: ...
    def allocate_ids(self, n: int) -> npt.NDArray[np.int32]:
        """Allocate ``n`` blocks (ref_cnt 1 each, cached ones evicted); ValueError, with no
        change, if fewer are free."""
    def allocate_id(self) -> int: ...
    def free_ids(self, ids: _Ids, reverse: bool = False) -> None:
        """Drop one reference per block in order (``reverse=True``: last to first); ValueError,
        with no change, for a bad id, the null block or a double free."""
    def free_id(self, block_id: int) -> None: ...
    def touch_ids(self, ids: _Ids) -> None: ...
    def cache_ids(
        self, block_ids: _Ids, block_hashes: list[bytes], num_cached_blocks: int, num_full_blocks: int,
        block_size: int | None = None, group_id: int = 0,
    ) -> None: ...
    def lookup_prefix(
        self, block_hashes: list[bytes], group_id: int = 0, max_blocks: int | None = None
    ) -> npt.NDArray[np.int32]: ...
    def lookup_ids(self, block_hashes: list[bytes], group_id: int = 0) -> npt.NDArray[np.int32]: ...
    def evict_ids(self, ids: _Ids) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def ref_cnt(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> bytes | None: ...
    def is_free(self, block_id: int) -> bool: ...
    def free_queue_ids(self) -> list[int]: ...
    def num_cached_keys(self) -> int: ...
    def cached_items(self) -> dict[bytes, list[int]]: ...
    def lookup_key(self, key: bytes) -> int | None: ...
    def lookup_key_all(self, key: bytes) -> list[int]: ...
    def check_invariants(self) -> None: ...
    def take_raw_events(self) -> list[tuple[Any, ...]]: ...
    def _queue_popleft_n(self, n: int) -> list[int]: ...
    def _queue_remove(self, block_id: int) -> None: ...
    def _queue_insert(self, ids: _Ids, at_head: bool) -> None: ...
    def _cache_for_request(
        self, request: Any, block_ids: _Ids, block_hashes: list[bytes], num_cached_blocks: int,
        num_full_blocks: int, block_size: int, group_id: int,
    ) -> None: ...

@disjoint_base
class KVCacheManagerCore:
    """The Rust manager of one KV-cache group; ``kvblock.KVCacheManager`` subclasses it."""

    def __new__(
        cls, block_pool: BlockPoolCore, block_size: int, max_model_len: int, enable_caching: bool = True,
        use_eagle: bool = False, sliding_window: int | None = None, watermark_blocks: int = 0,
        *args: Any, **kwargs: Any,
    ) -> Self: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
    @property
    def block_pool(self) -> Any: ...
    @property
    def num_requests(self) -> int: ...
    def _init_python(self, empty: Any, blocks_type: type, waiting: Any, preempted: Any, request_type: type) -> None: ...
    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]: ...
    def allocate_slots(
        self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True, skip_zeroing_group_ids: Any = None,
    ) -> Any: ...
    def allocate_slots_batch(
        self, requests: list[Any], num_new_tokens: int | _Ids | None = None, num_lookahead_tokens: int = 0
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
    def admit_batch(
        self, requests: list[Any], num_lookahead_tokens: int = 0, has_scheduled_reqs: bool = True
    ) -> tuple[int, npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
    def free(self, request: Any) -> None: ...
    def free_request_id(self, request_id: str) -> None: ...
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None: ...
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None: ...
    def _block_ids(self, request_id: str) -> list[int]: ...
    def _num_cached_blocks(self, request_id: str) -> int | None: ...
