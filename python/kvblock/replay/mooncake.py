"""The Mooncake trace format (FAST'25 ``conversation_trace.jsonl`` / ``synthetic_trace.jsonl``).

One JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]}

``timestamp`` is the arrival time in **milliseconds**; ``hash_ids`` has one id per
``trace_block_size`` (512) prompt tokens, ``len(hash_ids) == ceil(input_length / 512)``, the
last block possibly partial. Ids are prefix hashes: equal ids mean equal prefixes up to the end
of that block. Unknown extra fields are ignored.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .trace import TraceRequest
from .trace import arrival_ms as to_arrival_ms  # hash_id_request's argument is arrival_ms

__all__ = ["MOONCAKE_BLOCK_SIZE", "MooncakeRecord", "decode_mooncake", "hash_id_request"]

#: Tokens per hash id in Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512


class MooncakeRecord(msgspec.Struct):
    """One Mooncake line (field types are checked by msgspec)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(MooncakeRecord)


def hash_id_request(
    index: int,
    line: int,
    arrival_ms: float,
    input_length: int,
    output_length: int,
    hash_ids: list[int],
    trace_block_size: int,
    session: object = None,
) -> TraceRequest:
    """Validate the fields of a hash-id record and build its :class:`TraceRequest`.

    Raises:
        ValueError: a negative or zero ``input_length``, a negative ``output_length``, a
            negative or non-finite timestamp or one beyond 366 days
            (:data:`~kvblock.replay.trace.MAX_ARRIVAL_MS`), ``len(hash_ids) != ceil(input_length /
            trace_block_size)``, or an id outside ``[0, 2**63 // trace_block_size)``.
    """
    if input_length <= 0:
        raise ValueError(f"input_length must be > 0, got {input_length}")
    if output_length < 0:
        raise ValueError(f"output_length must be >= 0, got {output_length}")
    arrival = to_arrival_ms(arrival_ms)
    expected = -(-input_length // trace_block_size)
    if len(hash_ids) != expected:
        raise ValueError(
            f"hash_ids has {len(hash_ids)} ids but input_length {input_length} needs "
            f"ceil({input_length}/{trace_block_size}) = {expected} "
            f"(one id per {trace_block_size}-token block; see --trace-block-size)"
        )
    limit = (1 << 63) // trace_block_size
    if hash_ids:  # Python's min/max on the short list: a third of numpy's reductions' time
        lo, hi = min(hash_ids), max(hash_ids)
        if lo < 0 or hi >= limit:
            raise ValueError(f"hash_ids must be in [0, {limit}), got {lo if lo < 0 else hi}")
    ids = np.array(hash_ids, dtype=np.int64)
    return TraceRequest(
        index=index,
        request_id=f"req-{index}",
        arrival_ms=arrival,
        prompt_len=input_length,
        output_len=output_length,
        hash_ids=ids,
        line=line,
        session=session,
    )


def decode_mooncake(raw: bytes, line: int, index: int, trace_block_size: int) -> TraceRequest:
    """Decode and validate one Mooncake line.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: malformed JSON, a missing field or a
            field of the wrong type; ValueError: see :func:`hash_id_request`.
    """
    rec = _DECODER.decode(raw)
    return hash_id_request(
        index, line, rec.timestamp, rec.input_length, rec.output_length, rec.hash_ids,
        trace_block_size,
    )
