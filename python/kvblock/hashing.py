"""Chained block hashing with vLLM 0.33.0's names and byte-identical digests (spec §1).

``hash_i = HASH((parent, tuple(tokens_i), extra_keys_i))`` with ``parent = hash_{i-1}`` and the
first parent :data:`NONE_HASH`. The four algorithms (``sha256`` - vLLM's default -,
``sha256_cbor``, ``xxhash``, ``xxhash_cbor``) serialize the 3-tuple with pickle protocol 5 or
canonical CBOR in Rust and digest it with SHA-256 (32 bytes) or XXH3-128 (16 bytes).

The root :data:`NONE_HASH` is one value per process, as in vLLM: :func:`init_none_hash` sets it
(vLLM's engine calls it once at start-up); if nothing set it before the first hash, it is
initialised with the algorithm being used. vLLM's API reads it: :func:`hash_block_tokens` and
the hashers of :func:`get_request_block_hasher` (at each call), as vLLM's do.

kvblock's own managers and hashers carry their own root instead (:func:`none_hash_for`, fixed
when they are built), one per algorithm: building a manager with another algorithm, or
re-initialising :data:`NONE_HASH` for one, never changes the hashes (and so the hits) of a
manager built before.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, NewType, Sequence

import kvblock._core as _core
from .extra_keys import generate_block_hash_extra_keys, get_mm_features_in_window

__all__ = [
    "ALGORITHMS",
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockHashListWithBlockSize",
    "DEFAULT_DIGEST_MEMO_BLOCKS",
    "DIGEST_MEMO_MAX_BLOCK_SIZE",
    "MAX_DIGEST_MEMO_BLOCKS",
    "DEFAULT_NONE_HASH_SEED",
    "HashFunction",
    "NONE_HASH",
    "block_hash_to_event_int",
    "default_digest_memo_blocks",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_none_hash_seed",
    "none_hash_for",
    "get_request_block_hasher",
    "hash_block_tokens",
    "hash_blocks",
    "hash_requests",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "maybe_convert_block_hash",
    "resolve_block_hashes",
    "resolve_none_hash_seed",
    "sha256",
    "sha256_cbor",
    "xxhash",
    "xxhash_cbor",
]

#: A block hash: the raw digest bytes (32 for sha256*, 16 for xxhash*).
BlockHash = NewType("BlockHash", bytes)
#: ``block_hash + group_id.to_bytes(4, "big")``: the key of the hash -> block map.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

HashFunction = _core.HashFunction
#: The valid algorithm names, in vLLM's order.
ALGORITHMS: tuple[str, ...] = tuple(_core.ALGORITHMS)

sha256 = HashFunction("sha256")
sha256_cbor = HashFunction("sha256_cbor")
xxhash = HashFunction("xxhash")
xxhash_cbor = HashFunction("xxhash_cbor")
_BY_NAME = {f.name: f for f in (sha256, sha256_cbor, xxhash, xxhash_cbor)}

#: The seed string of the root hash when ``PYTHONHASHSEED`` is unset (sha256, sha256_cbor).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

#: Digest-memo slots of a request block hasher (see :func:`get_request_block_hasher`) for
#: blocks of up to :data:`DIGEST_MEMO_MAX_BLOCK_SIZE` tokens.
DEFAULT_DIGEST_MEMO_BLOCKS = 16384

#: The largest block size whose request block hashers get a digest memo by default. Measured
#: on 2,048-token prompts (docs/benchmarks.md): at 16 tokens a block the memo saves time on
#: prompts that share a prefix; at 32 and 64 a memo lookup (hashing and comparing the key)
#: costs about what the SHA-256 it saves does, so a prompt with no shared prefix pays 15-20%
#: more and one with 24 of its 32 blocks shared gains nothing.
DIGEST_MEMO_MAX_BLOCK_SIZE = 16

#: Most digest-memo slots a request block hasher can be asked for.
MAX_DIGEST_MEMO_BLOCKS = 1 << 24


def _count_arg(name: str, value: Any, minimum: int) -> int:
    """An int argument (or one with ``__index__``, e.g. a numpy integer) of at least
    ``minimum``: TypeError naming it for a bool or a non-int, ValueError below the minimum."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    value = operator.index(value)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name}: {value} is out of range (must fit in a signed 64-bit integer)")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def default_digest_memo_blocks(block_size: int, algo: str = "sha256") -> int:
    """Digest-memo slots a request block hasher gets by default.

    For ``sha256`` and ``sha256_cbor``: :data:`DEFAULT_DIGEST_MEMO_BLOCKS` (16384) for blocks
    of up to :data:`DIGEST_MEMO_MAX_BLOCK_SIZE` (16) tokens, vLLM 0.32 and 0.33's default
    block size; 0 (no memo) for larger blocks, vLLM 0.34's default of 64 among them, where a
    memo lookup costs about what the digest it saves does. For ``xxhash`` and
    ``xxhash_cbor``: 0, since an XXH3 digest costs about what a memo lookup does (the lookup
    hashes the key with XXH3 too). A memo can still be asked for at any block size
    (``digest_memo_blocks=`` of :func:`get_request_block_hasher`).

    Raises:
        ValueError: ``block_size <= 0``.
        TypeError: ``block_size`` is not an int.
    """
    block_size = _count_arg("block_size", block_size, 1)
    if algo.startswith("xxhash") or block_size > DIGEST_MEMO_MAX_BLOCK_SIZE:
        return 0
    return DEFAULT_DIGEST_MEMO_BLOCKS

#: The root of every chain; ``None`` until :func:`init_none_hash` runs (or the first hash).
NONE_HASH: BlockHash | None = None
_NONE_HASH_SEED: str | None = None
_NONE_HASH_ALGO: str | None = None
#: Each algorithm's root for kvblock's own managers and hashers (:func:`none_hash_for`): the
#: last one :func:`init_none_hash` made with it, else one made with vLLM's seed rules.
_ALGO_ROOTS: dict[str, tuple[BlockHash, str]] = {}


def get_hash_fn_by_name(hash_fn_name: str) -> HashFunction:
    """The hash function for a vLLM algorithm name.

    Returns a callable ``fn(obj) -> bytes`` equal to vLLM's function of that name.

    Raises:
        ValueError: for an unknown name; the message lists the valid algorithms.
    """
    try:
        return _BY_NAME[hash_fn_name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unsupported hash function: {hash_fn_name!r}; valid algorithms are "
            + ", ".join(ALGORITHMS)
        ) from None


def _algo_name(hash_fn: Any) -> str | None:
    """The algorithm name of a kvblock hash function, else None (a foreign callable)."""
    if isinstance(hash_fn, HashFunction):
        return hash_fn.name
    return None


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    """The root seed string vLLM 0.33.0 uses (spec §1.3).

    ``PYTHONHASHSEED`` if set (any algorithm); else ``os.urandom(32).hex()`` for the
    non-cryptographic xxhash algorithms; else ``"vllm-none-hash"``.
    """
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    name = _algo_name(hash_fn) or getattr(hash_fn, "__name__", "")
    if name in ("xxhash", "xxhash_cbor"):
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
    """Set :data:`NONE_HASH` to ``hash_fn(seed)`` with vLLM's seed rules.

    Raises:
        TypeError: ``hash_fn`` is not callable (a name such as ``"sha256"`` goes through
            :func:`get_hash_fn_by_name` first), or it does not return ``bytes``. NONE_HASH
            is then unchanged.
    """
    global NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO
    _check_hash_fn(hash_fn)
    seed = resolve_none_hash_seed(hash_fn)
    root = _root_digest(hash_fn, seed)
    NONE_HASH = BlockHash(root)
    _NONE_HASH_SEED = seed
    _NONE_HASH_ALGO = _algo_name(hash_fn)
    if _NONE_HASH_ALGO is not None:
        _ALGO_ROOTS[_NONE_HASH_ALGO] = (NONE_HASH, seed)


def _set_none_hash(value: bytes, seed: str | None, hash_fn: Any) -> None:
    """Set the root to ``value`` (derived elsewhere from ``seed`` with ``hash_fn``; None: find
    which of kvblock's algorithms made it from ``seed``): how :mod:`kvblock.vllm` keeps
    kvblock's root equal to vLLM's."""
    global NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO
    NONE_HASH = BlockHash(value)
    _NONE_HASH_SEED = seed
    if hash_fn is None and seed is not None:
        hash_fn = next((f for f in _BY_NAME.values() if f(seed) == value), None)
    _NONE_HASH_ALGO = _algo_name(hash_fn)
    if _NONE_HASH_ALGO is not None and seed is not None:
        _ALGO_ROOTS[_NONE_HASH_ALGO] = (NONE_HASH, seed)


def none_hash_for(hash_fn: Callable[[Any], bytes]) -> BlockHash:
    """The root a kvblock manager or hasher of ``hash_fn``'s algorithm chains from.

    One per algorithm and process: the last :func:`init_none_hash` made with that algorithm,
    else ``hash_fn(seed)`` with vLLM's seed rules, made once (a random seed for the xxhash
    algorithms without ``PYTHONHASHSEED``, the same for every manager of the process).
    It never changes :data:`NONE_HASH`. A hash function that is not kvblock's gets
    :data:`NONE_HASH` (initialised with it if nothing has, as vLLM does).

    Raises:
        TypeError: ``hash_fn`` is not callable or does not return bytes.
    """
    _check_hash_fn(hash_fn)
    name = _algo_name(hash_fn)
    if name is None:
        return _root(hash_fn)
    if name not in _ALGO_ROOTS:
        seed = resolve_none_hash_seed(hash_fn)
        _ALGO_ROOTS[name] = (BlockHash(_root_digest(hash_fn, seed)), seed)
    return _ALGO_ROOTS[name][0]


def _root_state() -> tuple[Any, ...]:
    """Every root this module holds, for :func:`_restore_root_state` (tests, seeded runs)."""
    return NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO, dict(_ALGO_ROOTS)


def _restore_root_state(state: tuple[Any, ...]) -> None:
    global NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO
    NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO, roots = state
    _ALGO_ROOTS.clear()
    _ALGO_ROOTS.update(roots)


def get_none_hash_seed() -> str:
    """The seed actually used for :data:`NONE_HASH` (the default string before init)."""
    return _NONE_HASH_SEED if _NONE_HASH_SEED is not None else DEFAULT_NONE_HASH_SEED


def _root(hash_fn: Any) -> bytes:
    """:data:`NONE_HASH`; if nothing set it yet, the root kvblock's managers of ``hash_fn``'s
    algorithm already use, else a new one (:func:`init_none_hash`)."""
    global NONE_HASH, _NONE_HASH_SEED, _NONE_HASH_ALGO
    if NONE_HASH is None:
        name = _algo_name(hash_fn)
        if name in _ALGO_ROOTS:
            NONE_HASH, _NONE_HASH_SEED = _ALGO_ROOTS[name]
            _NONE_HASH_ALGO = name
        else:
            init_none_hash(hash_fn)
    assert NONE_HASH is not None
    return NONE_HASH


def _check_extra(extra_keys: Any) -> None:
    if extra_keys is not None and not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys: must be None or a tuple, got {type(extra_keys).__name__}")


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash one block: ``hash_function((parent, tuple(tokens), extra_keys))``.

    Args:
        hash_function: a kvblock hash function (fast path in Rust) or any callable on the
            3-tuple (called as vLLM calls it).
        parent_block_hash: the previous block's digest; a falsy value (``None``, ``b""``)
            means the chain root :data:`NONE_HASH`.
        curr_block_token_ids: the block's token ids (a list/tuple of int, or a 1-D integer
            array).
        extra_keys: ``None`` or a non-empty tuple of tagged keys.

    Returns:
        The digest (32 or 16 bytes).

    Raises:
        TypeError: a parent that is not bytes, non-integer tokens, or extra keys of types
            block hashing does not use.
    """
    if not parent_block_hash:
        parent_block_hash = _root(hash_function)
    if not isinstance(parent_block_hash, bytes):
        raise TypeError(
            f"parent_block_hash: expected bytes, got {type(parent_block_hash).__name__}"
        )
    _check_extra(extra_keys)
    if isinstance(hash_function, HashFunction):
        return BlockHash(
            _core.hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)
        )
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def hash_blocks(
    token_ids: Any,
    block_size: int,
    *,
    algo: str | HashFunction = "sha256",
    parent: bytes | None = None,
    extra_keys: Sequence[tuple | None] | None = None,
) -> list[BlockHash]:
    """Hash every full block of a token sequence as one chain, in one call.

    Args:
        token_ids: a list or tuple of int, an ``array.array``, or a 1-D integer numpy array
            (int32/int64/uint32/uint64; read zero-copy through the buffer protocol). Ints of any
            size hash as vLLM hashes the Python int.
        block_size: tokens per block (> 0). A trailing partial block is not hashed.
        algo: ``"sha256"`` (default), ``"sha256_cbor"``, ``"xxhash"`` or ``"xxhash_cbor"``.
        parent: the hash the chain continues from; ``None`` or ``b""`` means the root of
            ``algo`` that kvblock's managers use, :func:`none_hash_for` (:data:`NONE_HASH`
            when :func:`init_none_hash` last ran with ``algo``).
        extra_keys: ``None``, or one entry (``None`` or a tuple) per full block.

    Returns:
        ``len(token_ids) // block_size`` digests (``bytes``: 32 for sha256*, 16 for xxhash*),
        in block order.

    Raises:
        ValueError: unknown ``algo``, ``block_size <= 0``, a 2-D array, or an ``extra_keys``
            length that is not the number of full blocks.
        TypeError: non-integer tokens or a float array, a ``parent`` that is not bytes, or
            malformed extra keys.

    The GIL is released while hashing 1,024 blocks or more. Numpy integer scalars in a list
    hash as the ints they hold.
    """
    fn = get_hash_fn_by_name(algo) if isinstance(algo, str) else algo
    if not isinstance(fn, HashFunction):
        raise TypeError(f"algo: expected an algorithm name, got {type(algo).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size: expected int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size: must be > 0, got {block_size}")
    if not parent:
        parent = none_hash_for(fn)
    return _core.hash_blocks(fn, token_ids, block_size, parent, extra_keys)


def get_request_block_hasher(
    block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
    *,
    digest_memo_blocks: int | None = None,
    none_hash: bytes | None = None,
) -> Callable[[Any], list[BlockHash]]:
    """vLLM's ``get_request_block_hasher``: a closure that hashes a request's new full blocks.

    The hasher starts at ``len(request.block_hashes) * block_size``, returns ``[]`` when no
    new block is complete, and otherwise hashes every newly completed block, chained from
    ``request.block_hashes[-1]``, with the per-block extra keys of
    :func:`kvblock.extra_keys.generate_block_hash_extra_keys`. It does not mutate the request.
    With a kvblock hash function it is a ``kvblock._core.RequestBlockHasher``: one Rust call
    hashes all new blocks, and its ``block_size`` lets :class:`kvblock.Request` skip calls
    that cannot complete a block. Any other callable gets a Python closure, called per block
    as vLLM does.

    With ``num_hash_lookahead_tokens = L > 0`` (EAGLE), a block is hashed only once ``L``
    tokens past its end exist, its extra keys cover ``[start, end + L)``, and the value hashed
    as extra keys is ``(E, t_end, ..., t_end+L-1)``.

    Digest memo (kvblock hash functions only; not in vLLM, same results): the Rust hasher
    remembers the digests of prompt blocks (a request's blocks hashed from its first one,
    without extra keys) that it has hashed twice, keyed by their exact input (parent digest
    and token ids, compared in full), so a prefix that many requests share (a system prompt)
    is hashed twice, not once per request. A new prompt walks the memo block by block: a
    memoized block is served — the same ``bytes`` object — and a missing one is hashed and
    offered; after a run of misses (4, plus one per 8 blocks served) the rest of the prompt
    is hashed in bulk. Blocks completed by output tokens, and blocks with extra keys (LoRA,
    multimodal, cache_salt, prompt embeds, lookahead), are always hashed.

    ``digest_memo_blocks`` slots (None: :func:`default_digest_memo_blocks`: 16384 for sha256
    blocks of up to 16 tokens, else 0; 0: no memo; rounded up to a power of two, at least 4), in sets of 4 that each
    drop their least recently used entry: ``8 * block_size + 68`` bytes per slot (3.1 MiB for
    16384 slots at block size 16) plus the ``bytes`` objects it keeps alive. Keep the shared
    prefixes it should hold under a quarter of its slots: beyond that more sets overflow, and
    their blocks are hashed again on each request. A served block costs about 90 ns instead
    of about 220 (its token ids are still read); an unshared sha256 block pays about 30 ns
    more for its offer. The hasher's ``digest_memo_info()`` gives ``(hits, stores, held)``;
    ``clear_digest_memo()`` empties it. It is ignored for a hash function that is not
    kvblock's (it is still checked).

    ``none_hash`` (not in vLLM): the root a request's first block chains from. None (vLLM's
    behaviour): :data:`NONE_HASH` as it is at each call, so :func:`init_none_hash` changes what
    the hasher makes; bytes: that root, always (a kvblock manager's hasher gets
    :func:`none_hash_for` its algorithm, so nothing done elsewhere changes its hits).

    Raises:
        ValueError: ``block_size <= 0``, ``num_hash_lookahead_tokens < 0``, or
            ``digest_memo_blocks`` outside ``[0, 2**24]`` or over 1 GiB of keys.
        TypeError: any of them not an int (``digest_memo_blocks`` may be None), or a
            ``none_hash`` that is neither None nor non-empty bytes.
    """
    if none_hash is not None and (not isinstance(none_hash, bytes) or not none_hash):
        raise TypeError(f"none_hash: expected None or non-empty bytes, got {type(none_hash).__name__} {none_hash!r:.40}")
    block_size = _count_arg("block_size", block_size, 1)
    num_hash_lookahead_tokens = _count_arg("num_hash_lookahead_tokens", num_hash_lookahead_tokens, 0)
    lookahead = num_hash_lookahead_tokens
    if digest_memo_blocks is None:
        name = caching_hash_fn.name if isinstance(caching_hash_fn, HashFunction) else "sha256"
        digest_memo_blocks = default_digest_memo_blocks(block_size, name)
    else:
        if isinstance(digest_memo_blocks, bool) or not hasattr(type(digest_memo_blocks), "__index__"):
            raise TypeError(f"digest_memo_blocks: expected int or None, got {type(digest_memo_blocks).__name__}")
        digest_memo_blocks = operator.index(digest_memo_blocks)
    if not 0 <= digest_memo_blocks <= MAX_DIGEST_MEMO_BLOCKS:
        raise ValueError(f"digest_memo_blocks: must be in [0, {MAX_DIGEST_MEMO_BLOCKS}], got {digest_memo_blocks}")
    if isinstance(caching_hash_fn, HashFunction):
        return _core.RequestBlockHasher(
            block_size, caching_hash_fn, lookahead, _request_extra_keys,
            (lambda: _root(caching_hash_fn)) if none_hash is None else none_hash,
            digest_memo_blocks,
        )

    def request_block_hasher(request: Any) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * block_size
        tokens = request._all_token_ids
        num_new = (len(tokens) - lookahead - start) // block_size
        if num_new <= 0:
            return []
        parent = block_hashes[-1] if block_hashes else (none_hash or _root(caching_hash_fn))
        extra: list | None = None
        if (
            request.lora_request
            or request.mm_features
            or request.cache_salt
            or request.prompt_embeds is not None
            or lookahead
        ):
            extra = _request_extra_keys(request, start, num_new, block_size, lookahead)
        out: list[BlockHash] = []
        for i in range(num_new):
            s = start + i * block_size
            # vLLM calls any other function on the 3-tuple, whatever it returns
            parent = BlockHash(
                caching_hash_fn((parent, tuple(tokens[s : s + block_size]), None if extra is None else extra[i]))
            )
            out.append(parent)
        return out

    return request_block_hasher


def hash_requests(requests: list[Any]) -> int:
    """Bring the ``block_hashes`` of many requests up to date in one call.

    The batch form of ``request.update_block_hashes()`` for a scheduler step: requests whose
    hasher comes from :func:`get_request_block_hasher` with a kvblock hash function are hashed
    in Rust, prompts through the hasher's digest memo — a running request's new block right
    away, prompts together, without the GIL when there is enough work and, with 3 or more
    worker threads (``RAYON_NUM_THREADS``, default one per CPU), on the workers when there is
    a lot (the step's new prompts; with fewer, one by one, which measured faster on 2 vCPUs);
    other hashers are called as usual, after them.
    Results are identical to per-request updates. A request has work to do once its hasher
    is attached (``Request(..., block_hasher=...)``, or ``request.attach_block_hasher(hasher,
    hash_now=False)`` to leave its prompt for this call) and blocks complete.

    Args:
        requests: a list of :class:`kvblock.Request`, each at most once.

    Returns:
        The number of blocks added by the Rust path (hashed, or served from a digest memo).

    Raises:
        ValueError: a request listed twice.
        TypeError: ``requests`` is not a list, or a request's ``block_hashes`` is not a list
            of bytes.

    Every request is checked before any ``block_hashes`` changes, so these errors leave all
    of them as they were (a digest memo may have served and stored blocks meanwhile: its
    counters move, its results never change); only a Python hasher that raises while it runs
    (they run last) can leave the requests before it updated.
    """
    return _core.hash_requests(requests)


def _request_extra_keys(
    request: Any, start: int, num_new: int, block_size: int, lookahead: int
) -> list:
    mm_features = request.mm_features
    mm_idx = get_mm_features_in_window(mm_features, start, start + block_size) if start > 0 else 0
    out: list = []
    tokens = request._all_token_ids
    for i in range(num_new):
        s = start + i * block_size
        e = s + block_size
        if lookahead:
            # keys over [s, e + L); the scan restarts at the first item still open at s
            idx = get_mm_features_in_window(mm_features, s, e + lookahead)
            keys, _ = generate_block_hash_extra_keys(request, s, e + lookahead, idx)
            out.append((keys, *tokens[e : e + lookahead]))
        else:
            keys, mm_idx = generate_block_hash_extra_keys(request, s, e, mm_idx)
            out.append(keys)
    return out


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """``block_hash + group_id.to_bytes(4, "big")`` (the key of the hash -> block map).

    Raises TypeError naming ``group_id`` for a bool or a non-int, ValueError naming it for an
    int outside ``[0, 2**32)`` (``int.to_bytes`` raised an OverflowError naming nothing).
    """
    if type(group_id) is not int:
        if isinstance(group_id, bool) or not hasattr(type(group_id), "__index__"):
            raise TypeError(f"group_id: expected int, got {type(group_id).__name__}")
        group_id = operator.index(group_id)
    if not 0 <= group_id < 1 << 32:
        raise ValueError(f"group_id: {group_id} is out of range (must be in [0, 2**32))")
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: bytes) -> BlockHash:
    """The block hash part of a :data:`BlockHashWithGroupId`."""
    return BlockHash(key[:-4])


def get_group_id(key: bytes) -> int:
    """The KV-cache group id of a :data:`BlockHashWithGroupId`."""
    return int.from_bytes(key[-4:], "big", signed=False)


def block_hash_to_event_int(block_hash: bytes) -> int:
    """The 64-bit int KV events publish: the last 8 digest bytes, big-endian."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def maybe_convert_block_hash(block_hash: bytes, use_int: bool | None = None) -> int | bytes:
    """vLLM's event hash form: the 64-bit int unless ``use_int`` is False (or
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), then the raw digest."""
    if use_int is None:
        use_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    return block_hash_to_event_int(block_hash) if use_int else block_hash


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """The hashes of a coarser block size ``B = k * H`` over a list of ``H``-token hashes.

    Block ``j``'s hash is the last fine hash inside it, ``hashes[(j + 1) * k - 1]`` (valid
    because every hash chains its whole prefix); the length is ``len(hashes) // k``. The view
    follows the underlying list as it grows. Mirrors vLLM 0.33.0 (spec §1.9).
    """

    __slots__ = ("block_hashes", "hash_block_size", "target_block_size", "scale_factor")

    def __init__(self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int):
        if hash_block_size <= 0 or target_block_size <= 0:
            raise ValueError("block sizes must be > 0")
        if target_block_size % hash_block_size != 0:
            raise ValueError(
                f"target_block_size ({target_block_size}) must be a multiple of "
                f"hash_block_size ({hash_block_size})"
            )
        self.block_hashes = block_hashes
        self.hash_block_size = hash_block_size
        self.target_block_size = target_block_size
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError("block index out of range")
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __iter__(self):
        k = self.scale_factor
        return iter(self.block_hashes[k - 1 : len(self) * k : k])

    def __repr__(self) -> str:
        return f"BlockHashListWithBlockSize(len={len(self)}, {self.hash_block_size}->{self.target_block_size})"


def resolve_block_hashes(
    block_hashes: Any,
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> Any:
    """The hash list a group of block size ``block_size`` uses (spec §1.9).

    The raw list if ``block_size == hash_block_size``; an existing view unchanged (its factor
    must match); the raw list for fine-grained managers when ``alignment_tokens < block_size``;
    else a :class:`BlockHashListWithBlockSize` view.
    """
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        if block_hashes.target_block_size != block_size:
            raise ValueError(
                f"a view for block size {block_hashes.target_block_size} cannot serve block size {block_size}"
            )
        return block_hashes
    if supports_fine_grained_hash_lookup and alignment_tokens is not None and alignment_tokens < block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
