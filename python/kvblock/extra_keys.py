"""Per-block extra hash keys: LoRA, multimodal items, cache_salt and prompt embeds.

Mirrors vLLM 0.33.0's ``generate_block_hash_extra_keys`` (spec §1.6). The keys are tagged
tuples, concatenated in this fixed order:

1. ``("lora", lora_name, lora_path)`` on every block of a LoRA request;
2. ``("mm", identifier, offset - block_start)`` for each multimodal item whose placeholder range
   overlaps the block (the offset is negative when the item began in an earlier block);
3. ``("cache_salt", salt)`` on the block that starts at token 0, if the salt is truthy;
4. ``("prompt_embeds", sha256(raw bytes of prompt_embeds[start:end]))`` when the request carries
   prompt embeddings.

The result is ``None`` when a block has no keys, never an empty tuple. The tag strings are code
literals, so (as in vLLM) a second ``"mm"`` in one block is the same object and pickles as a
memo back-reference.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Sequence

__all__ = [
    "generate_block_hash_extra_keys",
    "get_mm_features_in_window",
    "to_event_extra_keys",
    "prompt_embeds_block_digest",
]


def _lora_keys(request: Any) -> list:
    lora = request.lora_request
    if not lora:
        return []
    return [("lora", lora.lora_name, lora.lora_path)]


def _mm_keys(request: Any, start: int, end: int, start_mm_idx: int) -> tuple[list, int]:
    features = request.mm_features
    if not features:
        return [], start_mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start:
        # Every item ends before this block (late prefill, decode): nothing to scan.
        return [], start_mm_idx
    if start_mm_idx < 0:
        if -start_mm_idx > len(features):
            raise ValueError(f"start_mm_idx {start_mm_idx} is out of range for {len(features)} items")
        start_mm_idx += len(features)
    keys: list = []
    idx = start_mm_idx
    while idx < len(features):
        feature = features[idx]
        offset = feature.mm_position.offset
        length = feature.mm_position.length
        if end <= offset:
            break  # the block ends before this item starts
        if start >= offset + length:
            idx += 1  # the item ended before this block
            continue
        keys.append(("mm", feature.identifier, offset - start))
        if end >= offset + length:
            idx += 1  # the item ends inside this block; the next one may start here too
        else:
            break  # the item continues into the next block
    return keys, idx


def get_mm_features_in_window(mm_features: Sequence[Any] | None, start: int, end: int) -> int:
    """Index of the first multimodal item whose placeholder range ends after ``start``.

    This is where the extra-key scan resumes when a request's hasher starts at a token
    position > 0 (vLLM 0.33.0's start-index trick; ``end`` is the window's end, unused by the
    bisect). Items must be sorted by offset and non-overlapping. Returns ``len(mm_features)``
    when every item ends at or before ``start``, and 0 when there are no items.
    """
    if not mm_features:
        return 0
    ends = [f.mm_position.offset + f.mm_position.length for f in mm_features]
    return bisect.bisect_right(ends, start)


def prompt_embeds_block_digest(prompt_embeds: Any, start: int, end: int) -> bytes:
    """SHA-256 digest (32 bytes) of the raw memory of ``prompt_embeds[start:end]``.

    ``prompt_embeds`` is a torch tensor or numpy array of shape ``[num_tokens, hidden]``; the
    bytes are those of the flattened, contiguous slice in its own dtype (so the digest depends
    on the dtype, as in vLLM).
    """
    block = prompt_embeds[start:end]
    if hasattr(block, "detach") and hasattr(block, "view"):  # torch.Tensor
        import torch

        raw = block.detach().flatten().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    else:
        import numpy as np

        raw = np.ascontiguousarray(block).tobytes()
    return hashlib.sha256(raw).digest()


def _prompt_embeds_keys(request: Any, start: int, end: int) -> list:
    embeds = request.prompt_embeds
    if embeds is None:
        return []
    cache = request._prompt_embeds_per_block_hashes
    digest = cache.get((start, end))
    if digest is None:
        digest = prompt_embeds_block_digest(embeds, start, end)
        cache[(start, end)] = digest
    return [("prompt_embeds", digest)]


def generate_block_hash_extra_keys(
    request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple | None, int]:
    """Extra keys of the block ``[start_token_idx, end_token_idx)`` of ``request``.

    Args:
        request: a :class:`kvblock.Request` (or any object with ``lora_request``,
            ``mm_features``, ``cache_salt``, ``prompt_embeds`` and
            ``_prompt_embeds_per_block_hashes``).
        start_token_idx, end_token_idx: the block's token range (``end`` exclusive).
        start_mm_idx: index of the multimodal item where the scan starts (negative counts from
            the end, as in vLLM).

    Returns:
        ``(extra_keys, next_mm_idx)``: a non-empty tuple of tagged keys or ``None``, and the
        item index to resume from at the next block.
    """
    mm_keys, next_mm_idx = _mm_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys = _lora_keys(request) + mm_keys
    salt = request.cache_salt
    if start_token_idx == 0 and salt:
        keys.append(("cache_salt", salt))
    keys += _prompt_embeds_keys(request, start_token_idx, end_token_idx)
    if not keys:
        return None, next_mm_idx
    return tuple(keys), next_mm_idx


def to_event_extra_keys(extra_keys: tuple | None) -> tuple | None:
    """The untagged form KV events publish (spec §8): LoRA name only, ``(identifier, offset)``
    pairs, the bare salt and the bare prompt-embeds digest."""
    if extra_keys is None:
        return None
    out: list = []
    for key in extra_keys:
        tag = key[0] if isinstance(key, tuple) and key else None
        if tag == "lora":
            out.append(key[1])
        elif tag == "mm":
            out.append((key[1], key[2]))
        elif tag in ("cache_salt", "prompt_embeds"):
            out.append(key[1])
        else:
            out.append(key)
    return tuple(out)
