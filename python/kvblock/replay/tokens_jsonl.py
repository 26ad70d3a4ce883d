"""Plain token-id traces: one request per line.

A line is either a JSON array of prompt token ids, or an object::

    {"prompt_token_ids": [1, 2, 3], "output_length": 16, "timestamp": 250.0}

``token_ids`` is accepted for ``prompt_token_ids``; optional fields: ``output_length``
(default: the length of ``output_token_ids`` if given, else 1), ``output_token_ids`` (the
tokens to generate, so that a later prompt containing the answer can hit its blocks),
``timestamp`` (arrival in milliseconds, default 0) and ``request_id`` (default
``"req-{index}"``).
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

from .trace import TraceRequest, arrival_ms

__all__ = ["TokenRecord", "decode_tokens"]


class TokenRecord(msgspec.Struct, kw_only=True):
    """An object line of a token trace (field types are checked by msgspec)."""

    prompt_token_ids: Union[list[int], None] = None
    token_ids: Union[list[int], None] = None
    output_length: Union[int, None] = None
    output_token_ids: Union[list[int], None] = None
    timestamp: float = 0.0
    request_id: Union[str, None] = None


_DECODER = msgspec.json.Decoder(Union[list[int], TokenRecord])


def _token_array(values: list[int], what: str) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{what}: token ids must be in [0, 2**63)") from None
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what}: token ids must be >= 0, got {int(arr.min())}")
    return arr


def decode_tokens(raw: bytes, line: int, index: int) -> TraceRequest:
    """Decode and validate one token-trace line.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: malformed JSON or bad field types;
        ValueError: no prompt, both prompt fields, an empty prompt, negative ids or lengths,
            more outputs requested than ``output_token_ids`` holds, or a bad timestamp.
    """
    rec = _DECODER.decode(raw)
    if isinstance(rec, list):
        rec = TokenRecord(prompt_token_ids=rec)
    if rec.prompt_token_ids is not None and rec.token_ids is not None:
        raise ValueError("give either prompt_token_ids or token_ids, not both")
    prompt = rec.prompt_token_ids if rec.prompt_token_ids is not None else rec.token_ids
    if prompt is None:
        raise ValueError("missing prompt_token_ids (or token_ids)")
    if not prompt:
        raise ValueError("the prompt is empty")
    prompt_arr = _token_array(prompt, "prompt_token_ids")
    outputs = None
    if rec.output_token_ids is not None:
        outputs = _token_array(rec.output_token_ids, "output_token_ids")
    if rec.output_length is not None:
        n_out = rec.output_length
        if n_out < 0:
            raise ValueError(f"output_length must be >= 0, got {n_out}")
        if outputs is not None and n_out > len(outputs):
            raise ValueError(
                f"output_length {n_out} exceeds the {len(outputs)} output_token_ids given"
            )
    else:
        n_out = len(outputs) if outputs is not None else 1
    arrival = arrival_ms(rec.timestamp)
    return TraceRequest(
        index=index,
        request_id=rec.request_id if rec.request_id is not None else f"req-{index}",
        arrival_ms=arrival,
        prompt_len=len(prompt_arr),
        output_len=n_out,
        prompt_tokens=prompt_arr,
        output_tokens=outputs,
        line=line,
    )
