"""KV cache events in vLLM 0.33.0's msgpack wire format (spec §8).

The structs mirror ``vllm.distributed.kv_events``: every event is a msgpack *map* tagged with
``"type"`` (the class name); fields without a default are always present, defaulted ones are
omitted when equal to the default. A :class:`KVEventBatch` is an array
``[ts, events, data_parallel_rank]``. Hashes are the 64-bit ints of
:func:`kvblock.hashing.block_hash_to_event_int` by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the raw digest bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Union

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

ExternalBlockHash = Union[bytes, int]


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base class of KV cache events (a msgpack map with a ``"type"`` key)."""


class BlockStored(KVCacheEvent):
    """Full blocks were cached: their hashes, the parent hash, their token ids."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """A cached block lost its key (eviction)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """``reset_prefix_cache`` cleared every key."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    """One scheduler step's KV events: ``[ts, [event, ...], data_parallel_rank]``."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: list[KVCacheEvent], ts: float | None = None, data_parallel_rank: int | None = None) -> bytes:
    """msgpack bytes of a :class:`KVEventBatch` (``ts`` defaults to ``time.time()``)."""
    return _encoder.encode(KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                                        data_parallel_rank=data_parallel_rank))


def decode_batch(data: bytes) -> KVEventBatch:
    """Parse the bytes of a :class:`KVEventBatch`."""
    return _decoder.decode(data)


def block_stored_for_request(
    request: Any,
    block_hashes: list[bytes],
    parent_block_hash: bytes | None,
    first_block: int,
    block_size: int,
    group_idx: int,
    medium: str | None = "GPU",
    use_int: bool | None = None,
    end_block: int | None = None,
    null_blocks: Sequence[int] = (),
    token_ids: Sequence[int] | None = None,
) -> BlockStored:
    """The ``BlockStored`` vLLM publishes when blocks ``first_block .. end_block`` of
    ``request`` are cached (``end_block`` defaults to ``first_block + len(block_hashes)``).

    As in vLLM's ``cache_full_blocks``, ``token_ids`` covers the whole range, while
    ``block_hashes`` and the per-block untagged ``extra_keys`` skip the range's null blocks
    (sliding-window blocks outside the window, table indices ``null_blocks``). Also the LoRA
    identity. ``token_ids``, when given, are the range's token ids as they were when the
    blocks were cached (kvblock's pool copies them then, as vLLM builds the event then);
    otherwise they are read from ``request.all_token_ids`` now. Without a request (blocks
    cached through the pool's id API) the token ids are unknown: ``token_ids`` is empty and
    every block's extra keys are None."""
    import os

    from .hashing import maybe_convert_block_hash
    from .multimodal import generate_block_hash_extra_keys, get_mm_features_in_window, to_event_extra_keys

    if use_int is None:  # read once per event, not once per block
        use_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    n = len(block_hashes)
    if request is None:
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h, use_int) for h in block_hashes],
            parent_block_hash=None if parent_block_hash is None else maybe_convert_block_hash(parent_block_hash, use_int),
            token_ids=[],
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=[None] * n,
            group_idx=group_idx,
        )
    if end_block is None:
        end_block = first_block + n
    skip = set(null_blocks)
    indices = [i for i in range(first_block, end_block) if i not in skip]
    extra: list = []
    if indices and not (request.lora_request or request.mm_features or request.cache_salt
                        or request.prompt_embeds is not None):
        # nothing to key on: every block's extra keys are None (what the loop below gives)
        extra = [None] * len(indices)
    elif indices:
        s0 = indices[0] * block_size
        mm_idx = get_mm_features_in_window(request.mm_features, s0, s0 + block_size) if s0 > 0 else 0
        for i in indices:
            s = i * block_size
            keys, mm_idx = generate_block_hash_extra_keys(request, s, s + block_size, mm_idx)
            extra.append(to_event_extra_keys(keys))
    lora = request.lora_request
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h, use_int) for h in block_hashes],
        parent_block_hash=None if parent_block_hash is None else maybe_convert_block_hash(parent_block_hash, use_int),
        token_ids=list(
            token_ids if token_ids is not None else request.all_token_ids[first_block * block_size : end_block * block_size]
        ),
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.lora_name if lora else None,
        extra_keys=extra,
        group_idx=group_idx,
    )


def block_removed(block_hash: bytes, group_idx: int, medium: str | None = "GPU", use_int: bool | None = None) -> BlockRemoved:
    """The ``BlockRemoved`` vLLM publishes when a cached block loses its key."""
    from .hashing import maybe_convert_block_hash

    return BlockRemoved(block_hashes=[maybe_convert_block_hash(block_hash, use_int)], medium=medium, group_idx=group_idx)
