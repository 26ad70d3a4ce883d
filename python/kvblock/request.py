"""Request bookkeeping, shaped like vLLM 0.33.0's ``vllm.v1.request.Request``.

A :class:`Request` holds the prompt and output token ids, ``num_computed_tokens``, its status,
the LoRA / multimodal / salt / prompt-embeds inputs that enter block hashes, and
``block_hashes``, kept up to date incrementally: when a ``block_hasher`` is given, the
constructor hashes every full prompt block and :meth:`Request.append_output_token_ids` hashes
only the blocks that the new tokens complete (spec §1.7).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import kvblock._core as _core

__all__ = [
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "validate_cache_salt",
]

#: The longest cache_salt vLLM's API accepts, in characters.
MAX_CACHE_SALT_LEN = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\0")


class RequestStatus(enum.IntEnum):
    """Status of a request, as in vLLM (only the ordering ``> PREEMPTED`` = finished matters)."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        """True for the ``FINISHED_*`` statuses (those after ``PREEMPTED``), as vLLM's
        ``RequestStatus.is_finished``.
        """
        return status > RequestStatus.PREEMPTED


@dataclass
class LoRARequest:
    """A LoRA adapter: ``lora_name`` and ``lora_path`` enter block hashes; the int id does not
    (vLLM 0.33.0; an open question upstream, see spec §13)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def adapter_id(self) -> int:
        """``lora_int_id`` (vLLM's ``LoRARequest.adapter_id``)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """``lora_name`` (vLLM's ``LoRARequest.name``)."""
        return self.lora_name


@dataclass(frozen=True)
class PlaceholderRange:
    """Token range ``[offset, offset + length)`` of a multimodal item in the prompt."""

    offset: int
    length: int


@dataclass
class MultiModalFeatureSpec:
    """A multimodal item: ``identifier`` (its encoder-cache hash string) and its placeholder
    range. Only these two enter block hashes."""

    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"
    data: Any = None


@dataclass
class SamplingParams:
    """The sampling parameters the block manager reads.

    ``skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not None`` (such requests
    must compute every prompt position, so they never read the prefix cache but still write
    it). ``extra_args["kv_cache_report_mode"] == "full"`` makes cache hits publish
    ``BlockStored`` events.
    """

    max_tokens: int | None = 16
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None


def validate_cache_salt(cache_salt: Any) -> None:
    """Raise unless ``cache_salt`` is None or what vLLM's API accepts: a non-empty ``str`` of
    at most 128 characters without ``@``, ``/``, ``\\`` or NUL (``TypeError`` for another
    type, ``ValueError`` otherwise).

    vLLM's engine core accepts anything and treats ``""`` as no salt, which silently isolates
    nothing (CASES.md C06); kvblock applies the API rule by default.
    """
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt: must be a str or None, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt: must not be empty (an empty salt would isolate nothing)")
    if len(cache_salt) > MAX_CACHE_SALT_LEN:
        raise ValueError(
            f"cache_salt: at most {MAX_CACHE_SALT_LEN} characters, got {len(cache_salt)}"
        )
    for ch in _FORBIDDEN_SALT_CHARS:
        if ch in cache_salt:
            raise ValueError(f"cache_salt: must not contain {ch!r}")


_check_salt = validate_cache_salt


def _check_max_tokens(max_tokens: Any, arg: str) -> None:
    """``max_tokens``: None or an int >= 0 (vLLM's ``SamplingParams`` refuses < 1)."""
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
        raise TypeError(f"{arg}: must be an int or None, got {type(max_tokens).__name__}")
    if max_tokens < 0:
        raise ValueError(f"{arg}: must be >= 0, got {max_tokens}")


def _check_scalars(lora_request: Any, priority: Any, arrival_time: Any, max_tokens: Any) -> None:
    """The constructor's scalar arguments, each named in its error: a ``lora_request`` with
    vLLM's ``lora_name`` (a :class:`LoRARequest`, or vLLM's), a ``priority`` that is a number
    and not NaN (schedulers sort by it), an ``arrival_time`` that is None or a finite number
    of seconds, a ``max_tokens`` that is None or an int >= 0."""
    if lora_request is not None and not hasattr(lora_request, "lora_name"):
        raise TypeError(
            f"lora_request: expected a LoRARequest (with lora_name) or None, got {type(lora_request).__name__}"
        )
    if isinstance(priority, bool) or not isinstance(priority, (int, float, np.integer, np.floating)):
        raise TypeError(f"priority: must be a number, got {type(priority).__name__}")
    if priority != priority:  # NaN
        raise ValueError("priority: must not be NaN (requests are ordered by it)")
    if arrival_time is not None:
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float, np.integer, np.floating)):
            raise TypeError(f"arrival_time: must be a number of seconds or None, got {type(arrival_time).__name__}")
        if not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time: must be finite, got {arrival_time}")
    _check_max_tokens(max_tokens, "max_tokens")


def _check_mm_within_prompt(mm_features: Sequence[Any] | None, num_prompt_tokens: int) -> None:
    """Each multimodal placeholder lies within the prompt (vLLM's processor places them in
    it; one past the end would give blocks extra keys for tokens that are not there)."""
    for i, f in enumerate(mm_features or ()):
        pos = f.mm_position
        if pos.offset + pos.length > num_prompt_tokens:
            raise ValueError(
                f"mm_features[{i}]: the placeholder at offset {pos.offset}, length {pos.length} runs past the "
                f"prompt's {num_prompt_tokens} tokens"
            )


def _mm_features(mm_features: Iterable[Any] | None) -> list[MultiModalFeatureSpec] | None:
    if mm_features is None:
        return None
    out: list[MultiModalFeatureSpec] = []
    for f in mm_features:
        if isinstance(f, tuple):
            if len(f) != 3:
                raise ValueError("mm_features: a tuple item must be (identifier, offset, length)")
            f = MultiModalFeatureSpec(f[0], PlaceholderRange(int(f[1]), int(f[2])))
        pos = f.mm_position
        if pos.offset < 0 or pos.length <= 0:
            raise ValueError(f"mm_features: bad placeholder range {pos}")
        if f.identifier is None:
            raise ValueError("mm_features: every item needs an identifier")
        if out:
            prev = out[-1].mm_position
            if pos.offset < prev.offset + prev.length:
                raise ValueError("mm_features: items must be sorted by offset and must not overlap")
        out.append(f)
    return out


def _new_token_ids(token_ids: Any) -> list[Any]:
    """``token_ids`` (one token id or a sequence of them) as a checked list."""
    if isinstance(token_ids, (bool, str, bytes)) or token_ids is None:
        raise TypeError(f"token_ids: expected an int or a sequence of ints, got {type(token_ids).__name__}")
    tolist = getattr(token_ids, "tolist", None)
    if callable(tolist):
        # numpy / torch arrays and scalars, array.array: their elements as Python numbers, so
        # an array is its tokens (not one token) and a float or bool array fails the check
        value = tolist()
        new = value if isinstance(value, list) else [value]
    elif hasattr(type(token_ids), "__index__"):
        new = [token_ids]  # an integer-like scalar
    else:
        try:
            new = list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids: expected an int or a sequence of ints, got {type(token_ids).__name__}"
            ) from None
    _core.check_token_ids(new, "token_ids")
    return new


def _is_token_ids(mask: Sequence[bool] | None, n: int) -> list[bool] | None:
    """``prompt_is_token_ids`` checked: None, or one bool per prompt position."""
    if mask is None:
        return None
    if hasattr(mask, "tolist"):
        mask = mask.tolist()
    out = list(mask)
    if len(out) != n:
        raise ValueError(f"prompt_is_token_ids: {len(out)} entries for {n} prompt tokens (one per position)")
    for i, v in enumerate(out):
        if type(v) is not bool and not isinstance(v, np.bool_):
            raise TypeError(f"prompt_is_token_ids[{i}]: expected bool, got {type(v).__name__}")
    return [bool(v) for v in out]


#: The request attributes kvblock's Rust core reads (or calls) on a request object, by name:
#: the Python side of the one list in ``rust/src/py/fields.rs`` (``Field`` / ``NAMES``,
#: exported as ``kvblock._core.REQUEST_FIELDS``), in its order. ``tests/test_request_fields.py``
#: fails when the two drift, or when one is not an attribute of :class:`Request` (except
#: :data:`VLLM_ONLY_READS`). Renaming a field of :class:`Request` means renaming it in both.
RUST_READS: tuple[str, ...] = (
    # read on every scheduler call (slots of Request; on vLLM's Request, instance attributes)
    "request_id", "num_computed_tokens", "_all_token_ids", "block_hashes", "status",
    "num_in_flight_tokens", "skip_reading_prefix_cache", "kv_cache_report_mode",
    # block hashing and its extra keys
    "_block_hasher", "lora_request", "mm_features", "cache_salt", "prompt_embeds", "_hash_lookahead",
    "_next_hash_at", "_prompt_embeds_per_block_hashes", "num_prompt_tokens",
    # KV events, sessions, mixed prompts
    "shared_prefix_boundary", "session_id", "prompt_is_token_ids",
    # vLLM 0.34's prefix-cache hit limit (only vLLM's Request has it; read as optional)
    "prefix_cache_hit_limit",
    # read with getattr / called
    "num_tokens", "_hash_block_size", "retention", "retention_priority", "all_token_ids",
    "update_block_hashes", "is_finished",
)

#: Of :data:`RUST_READS`, the attributes only vLLM's ``Request`` has (Rust reads them as
#: optional on kvblock's).
VLLM_ONLY_READS: frozenset[str] = frozenset({"prefix_cache_hit_limit"})


class Request:
    """A request as the KV cache manager sees it (vLLM 0.33.0 names).

    Fields are slots (the manager reads several per scheduler call); other attributes can
    still be attached.

    Args:
        request_id: unique id (str).
        prompt_token_ids: the prompt (a sequence of int); ``None`` with ``prompt_embeds``
            means placeholder zeros, one per embedding row.
        sampling_params: a :class:`SamplingParams` (or any object with ``max_tokens``,
            ``skip_reading_prefix_cache`` and ``extra_args``).
        lora_request: a :class:`LoRARequest` or None.
        cache_salt: None or a salt string (validated unless ``validate_cache_salt=False``).
        mm_features: multimodal items, sorted and non-overlapping:
            :class:`MultiModalFeatureSpec` or ``(identifier, offset, length)`` tuples.
        prompt_embeds: a ``[num_tokens, hidden]`` torch tensor or numpy array, or None.
            Every block of a request with prompt embeddings gets the SHA-256 of its rows as
            an extra hash key.
        prompt_is_token_ids: vLLM 0.33.0's mixed prompt (chat completions with
            ``prompt_embeds`` content parts): one bool per prompt position, True where
            ``prompt_token_ids`` holds a real token id, False where the input is the row of
            ``prompt_embeds`` and the token id is a placeholder. Positions marked False hold
            token id 0 in ``all_token_ids`` (what is hashed); ``prompt_token_ids`` keeps the
            ids as given. None (the default): every position is a token id.
        block_hasher: from :func:`kvblock.hashing.get_request_block_hasher`; None means no
            block hashes (prefix caching off).
        session_id: reported in KV events (vLLM's ``session_id``).
        max_tokens: overrides ``sampling_params.max_tokens``.
        retention: ``[(start, end, priority, duration_s)]``: retention priorities (0-100,
            TensorRT-LLM's scale) for prompt token ranges, read by a manager built with
            ``priority_retention=True`` (checked here: ``ValueError`` for a priority
            outside 0-100, a negative duration or a range outside the prompt, ``TypeError``
            for a malformed entry).
        retention_priority: the priority of its other tokens (None: the manager's default).

    Raises:
        ValueError: an invalid salt or multimodal layout, a prompt array that is not 1-D,
            ``prompt_embeds`` with another length than ``prompt_token_ids`` (as vLLM), or a
            ``prompt_is_token_ids`` without ``prompt_token_ids`` or of another length.
        TypeError: a ``prompt_is_token_ids`` entry that is not a bool.
        TypeError: a prompt token id that is not an int (a ``bool``, ``float``, ``None``...;
            numpy integers are accepted), naming ``prompt_token_ids[i]``.
    """

    __slots__ = (
        "request_id", "sampling_params", "pooling_params", "eos_token_id", "arrival_time",
        "priority", "lora_request", "cache_salt", "mm_features", "prompt_embeds",
        "_prompt_embeds_per_block_hashes", "prompt_token_ids", "num_prompt_tokens",
        "_output_token_ids", "_all_token_ids", "max_tokens", "status", "num_computed_tokens",
        "num_in_flight_tokens", "num_preemptions", "skip_reading_prefix_cache",
        "kv_cache_report_mode", "block_hashes", "_block_hasher", "_hash_block_size",
        "_hash_lookahead", "_next_hash_at", "shared_prefix_boundary", "session_id", "prompt_is_token_ids",
        "retention", "retention_priority", "__dict__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        mm_features: Iterable[Any] | None = None,
        prompt_embeds: Any = None,
        block_hasher: Callable[["Request"], Sequence[bytes]] | None = None,
        priority: int = 0,
        *,
        session_id: str | None = None,
        max_tokens: int | None = None,
        validate_cache_salt: bool = True,
        prompt_is_token_ids: Sequence[bool] | None = None,
        retention: Sequence[tuple[int, int, int, float | None]] | None = None,
        retention_priority: int | None = None,
    ) -> None:
        if validate_cache_salt:
            _check_salt(cache_salt)
        _check_scalars(lora_request, priority, arrival_time, max_tokens)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.mm_features = _mm_features(mm_features)
        if prompt_embeds is not None and getattr(prompt_embeds, "ndim", 2) != 2:
            raise ValueError(
                f"prompt_embeds: expected a [num_tokens, hidden] 2-D tensor or array, got "
                f"{prompt_embeds.ndim}-D"
            )
        self.prompt_embeds = prompt_embeds
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        if prompt_token_ids is None:
            if prompt_embeds is None:
                raise ValueError("prompt_token_ids: required unless prompt_embeds is given")
            if prompt_is_token_ids is not None:
                raise ValueError("prompt_is_token_ids: needs prompt_token_ids (a mixed prompt has both)")
            prompt_token_ids = [0] * len(prompt_embeds)
        elif hasattr(prompt_token_ids, "tolist"):
            if getattr(prompt_token_ids, "ndim", 1) != 1:
                raise ValueError(
                    f"prompt_token_ids: expected a 1-D sequence of token ids, got a "
                    f"{prompt_token_ids.ndim}-D array"
                )
            prompt_token_ids = prompt_token_ids.tolist()
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        _core.check_token_ids(self.prompt_token_ids, "prompt_token_ids")
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if prompt_embeds is not None and len(prompt_embeds) != self.num_prompt_tokens:
            raise ValueError(
                f"prompt_embeds: {len(prompt_embeds)} rows for {self.num_prompt_tokens} prompt token ids "
                f"(they must have the same length)"
            )
        _check_mm_within_prompt(self.mm_features, self.num_prompt_tokens)
        self._output_token_ids: list[int] = []
        self.prompt_is_token_ids = _is_token_ids(prompt_is_token_ids, self.num_prompt_tokens)
        if self.prompt_is_token_ids is None:
            self._all_token_ids: list[int] = self.prompt_token_ids.copy()
        else:
            # vLLM: positions whose input is an embedding row hold token id 0
            self._all_token_ids = [
                t if is_tok else 0 for t, is_tok in zip(self.prompt_token_ids, self.prompt_is_token_ids)
            ]
        if max_tokens is None:
            max_tokens = getattr(sampling_params, "max_tokens", None)
            _check_max_tokens(max_tokens, "sampling_params.max_tokens")
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.shared_prefix_boundary = 0
        self.session_id: str | None = session_id
        #: Retention of its blocks once freed (a manager with ``priority_retention`` reads it
        #: at admission): ``[(start, end, priority, duration_s)]`` token ranges of the prompt,
        #: priorities 0-100 (higher kept longer), ``duration_s`` None for no decay.
        self.retention = retention
        #: Retention priority (0-100) of its tokens outside ``retention``'s ranges (None: the
        #: manager's default).
        self.retention_priority = retention_priority
        if retention is not None or retention_priority is not None:
            _core.check_retention(self, self.num_prompt_tokens)  # as a manager reads them
        self.skip_reading_prefix_cache = self._skip_reading_prefix_cache()
        extra_args = getattr(sampling_params, "extra_args", None) or {}
        self.kv_cache_report_mode: str = extra_args.get("kv_cache_report_mode", "incremental")
        self.block_hashes: list[bytes] = []
        self.attach_block_hasher(block_hasher)

    def _skip_reading_prefix_cache(self) -> bool:
        sp = self.sampling_params
        if sp is not None and getattr(sp, "skip_reading_prefix_cache", None) is not None:
            return bool(sp.skip_reading_prefix_cache)
        pp = self.pooling_params
        if pp is not None and getattr(pp, "skip_reading_prefix_cache", None) is not None:
            return bool(pp.skip_reading_prefix_cache)
        return False

    # -- token views -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens appended so far (``int``; ``num_tokens - num_prompt_tokens``)."""
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The output token ids (do not mutate; use :meth:`append_output_token_ids`)."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids (do not mutate; use :meth:`append_output_token_ids`)."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        """True once ``status`` is a ``FINISHED_*`` status (a property here; vLLM's ``Request``
        has a method). A finished request gets no blocks from kvblock's own
        :class:`~kvblock.KVCacheManager` (``ValueError``).
        """
        return RequestStatus.is_finished(self.status)

    # -- updates -----------------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled token(s) and hash the blocks they complete (one batch call).

        ``token_ids`` is one token id or a sequence of them; a token id is an ``int`` (or an
        integer-like such as a numpy integer), never a ``bool``, ``float`` or ``None``. A 1-D
        integer numpy array or torch tensor (a sampler's output) is its tokens, a 0-d one a
        single token; they are stored as Python ints. The tokens are checked before any is
        appended, whether or not they complete a block.

        Raises:
            TypeError: a token that is not a token id (naming ``token_ids[i]``), or
                ``token_ids`` neither an int nor a sequence. Nothing is appended; the same
                holds when the request's hasher raises.
        """
        n_out, n_all = len(self._output_token_ids), len(self._all_token_ids)
        if type(token_ids) is int:
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            new = _new_token_ids(token_ids)
            self._output_token_ids.extend(new)
            self._all_token_ids.extend(new)
        try:
            self.update_block_hashes()
        except BaseException:
            del self._output_token_ids[n_out:]
            del self._all_token_ids[n_all:]
            raise

    def attach_block_hasher(
        self, block_hasher: Callable[["Request"], Sequence[bytes]] | None, hash_now: bool = True
    ) -> None:
        """Use ``block_hasher`` from now on and (unless ``hash_now`` is False, e.g. to hash many
        requests at once with :func:`kvblock.hashing.hash_requests`) hash the full blocks not
        hashed yet."""
        self._block_hasher = block_hasher
        # A hasher that declares its block size lets updates skip calls that cannot complete a
        # block (vLLM's closures do not declare it; they are called on every update).
        self._hash_block_size: int = getattr(block_hasher, "block_size", 0) or 0
        self._hash_lookahead: int = getattr(block_hasher, "num_hash_lookahead_tokens", 0) or 0
        self._next_hash_at = 0
        if hash_now:
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` with the hashes of newly completed blocks.

        ``block_hashes`` is maintained here: do not modify it from outside.
        """
        if len(self._all_token_ids) < self._next_hash_at:
            return  # no block can be complete yet
        hasher = self._block_hasher
        if hasher is None:
            return
        self.block_hashes.extend(hasher(self))
        bs = self._hash_block_size
        if bs:
            self._next_hash_at = (len(self.block_hashes) + 1) * bs + self._hash_lookahead

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
