"""Reference block hashing: vLLM 0.33.0's functions in plain Python (spec §1).

``sha256(obj) = hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()``, the CBOR variants use
``cbor2.dumps(obj, canonical=True)``, the xxhash variants ``xxhash.xxh3_128_digest``. Chains are
built one block at a time with ``hash_block_tokens``, exactly as vLLM's request hasher does.

Roots as in :mod:`kvblock.hashing`: :data:`NONE_HASH` is vLLM's process-wide root; managers
chain from :func:`none_hash_for` their algorithm, fixed when they are built.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, Sequence

import cbor2
import xxhash as _xxhash

from ..extra_keys import generate_block_hash_extra_keys, get_mm_features_in_window

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
NONE_HASH: bytes | None = None
_NONE_HASH_SEED: str | None = None
#: Each algorithm's root for managers (:func:`none_hash_for`), by algorithm name.
_ALGO_ROOTS: dict[str, tuple[bytes, str]] = {}


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_BY_NAME: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    if hash_fn_name not in _BY_NAME:
        raise ValueError(
            f"Unsupported hash function: {hash_fn_name!r}; valid algorithms are "
            + ", ".join(_BY_NAME)
        )
    return _BY_NAME[hash_fn_name]


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if hash_fn in (xxhash, xxhash_cbor):
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def _check_hash_fn(hash_fn: Any) -> None:
    if isinstance(hash_fn, str):
        raise TypeError(
            f"hash_fn: expected a hash function, got the str {hash_fn!r} "
            f"(use get_hash_fn_by_name({hash_fn!r}))"
        )
    if not callable(hash_fn):
        raise TypeError(
            f"hash_fn: expected a hash function such as get_hash_fn_by_name('sha256'), "
            f"got {type(hash_fn).__name__}"
        )


def _root_digest(hash_fn: Callable[[Any], bytes], seed: str) -> bytes:
    root = hash_fn(seed)
    if not isinstance(root, bytes):
        raise TypeError(f"hash_fn: must return bytes, returned {type(root).__name__}")
    return root


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set NONE_HASH to ``hash_fn(seed)``; TypeError (NONE_HASH unchanged) for a
    ``hash_fn`` that is not callable or does not return bytes."""
    global NONE_HASH, _NONE_HASH_SEED
    _check_hash_fn(hash_fn)
    seed = resolve_none_hash_seed(hash_fn)
    root = _root_digest(hash_fn, seed)
    NONE_HASH = root
    _NONE_HASH_SEED = seed
    name = _name_of(hash_fn)
    if name is not None:
        _ALGO_ROOTS[name] = (root, seed)


def _name_of(hash_fn: Any) -> str | None:
    return next((n for n, f in _BY_NAME.items() if f is hash_fn), None)


def none_hash_for(hash_fn: Callable[[Any], bytes]) -> bytes:
    """The root a manager of ``hash_fn``'s algorithm chains from: the last
    :func:`init_none_hash` with it, else ``hash_fn(seed)`` made once; never changes
    :data:`NONE_HASH` (a foreign ``hash_fn`` gets it)."""
    _check_hash_fn(hash_fn)
    name = _name_of(hash_fn)
    if name is None:
        return _root(hash_fn)
    if name not in _ALGO_ROOTS:
        seed = resolve_none_hash_seed(hash_fn)
        _ALGO_ROOTS[name] = (_root_digest(hash_fn, seed), seed)
    return _ALGO_ROOTS[name][0]


def _root(hash_fn: Callable[[Any], bytes]) -> bytes:
    global NONE_HASH, _NONE_HASH_SEED
    if NONE_HASH is None:
        name = _name_of(hash_fn)
        if name in _ALGO_ROOTS:
            NONE_HASH, _NONE_HASH_SEED = _ALGO_ROOTS[name]
        else:
            init_none_hash(hash_fn)
    assert NONE_HASH is not None
    return NONE_HASH


def _root_state() -> tuple[Any, ...]:
    return NONE_HASH, _NONE_HASH_SEED, dict(_ALGO_ROOTS)


def _restore_root_state(state: tuple[Any, ...]) -> None:
    global NONE_HASH, _NONE_HASH_SEED
    NONE_HASH, _NONE_HASH_SEED, roots = state
    _ALGO_ROOTS.clear()
    _ALGO_ROOTS.update(roots)


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> bytes:
    if not parent_block_hash:
        parent_block_hash = _root(hash_function)
    return hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    algo: str = "sha256",
    parent: bytes | None = None,
    extra_keys: Sequence[tuple | None] | None = None,
) -> list[bytes]:
    fn = get_hash_fn_by_name(algo)
    if block_size <= 0:
        raise ValueError(f"block_size: must be > 0, got {block_size}")
    tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    out: list[bytes] = []
    prev = parent or none_hash_for(fn)
    for i in range(len(tokens) // block_size):
        extra = None if extra_keys is None else extra_keys[i]
        prev = hash_block_tokens(fn, prev, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(prev)
    return out


def get_request_block_hasher(
    block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
    *,
    none_hash: bytes | None = None,
) -> Callable[[Any], list[bytes]]:
    """vLLM's hasher; ``none_hash`` (not in vLLM): a fixed root (None: :data:`NONE_HASH` at
    each call)."""
    lookahead = num_hash_lookahead_tokens

    def request_block_hasher(request: Any) -> list[bytes]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size + lookahead > num_tokens:
            return []
        mm_idx = 0
        if start > 0:
            mm_idx = get_mm_features_in_window(request.mm_features, start, start + block_size)
        prev = request.block_hashes[-1] if request.block_hashes else none_hash
        tokens = request.all_token_ids
        out: list[bytes] = []
        while start + block_size + lookahead <= num_tokens:
            end = start + block_size
            if lookahead:
                idx = get_mm_features_in_window(request.mm_features, start, end + lookahead)
                keys, _ = generate_block_hash_extra_keys(request, start, end + lookahead, idx)
                extra: Any = (keys, *tokens[end : end + lookahead])
            else:
                extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            prev = hash_block_tokens(caching_hash_fn, prev, tokens[start:end], extra)
            out.append(prev)
            start = end
        return out

    return request_block_hasher
