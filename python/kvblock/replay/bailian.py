"""The Alibaba Qwen-Bailian trace format (``alibaba-edu/qwen-bailian-usagetraces-anon``).

One JSON object per line with ``chat_id``, ``parent_chat_id`` (-1 for a first turn),
``timestamp`` (**seconds**), ``input_length``, ``output_length``, ``type``, ``turn`` and
``hash_ids``: one id per **16**-token block (``--trace-block-size``), the same prefix-hash
idea as Mooncake's ids. The conversation fields are kept on the request (``session``) for
reports; prefix sharing comes from the ids alone.
"""

from __future__ import annotations

import msgspec

from .mooncake import hash_id_request
from .trace import TraceRequest, arrival_ms

__all__ = ["BAILIAN_BLOCK_SIZE", "BailianRecord", "decode_bailian"]

#: Tokens per hash id in Bailian traces.
BAILIAN_BLOCK_SIZE = 16


class BailianRecord(msgspec.Struct, kw_only=True):
    """One Bailian line (field types are checked by msgspec)."""

    chat_id: int
    parent_chat_id: int = -1
    timestamp: float
    input_length: int
    output_length: int
    type: str = ""
    turn: int = 1
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(BailianRecord)


def decode_bailian(raw: bytes, line: int, index: int, trace_block_size: int) -> TraceRequest:
    """Decode and validate one Bailian line; the timestamp is converted to milliseconds.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: malformed JSON or bad field types;
        ValueError: invalid lengths, ids, turn or timestamp (at most 31,622,400 s: 366 days; see
            :func:`kvblock.replay.mooncake.hash_id_request`).
    """
    rec = _DECODER.decode(raw)
    if rec.turn < 0:
        raise ValueError(f"turn must be >= 0, got {rec.turn}")
    return hash_id_request(
        index, line, arrival_ms(rec.timestamp, "s"), rec.input_length, rec.output_length, rec.hash_ids,
        trace_block_size, session=rec.chat_id,
    )
