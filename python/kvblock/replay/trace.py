"""The in-memory form of a workload: :class:`TraceRequest` and :class:`Trace`.

Every source (Mooncake and Bailian hash-id traces, token-id JSONL files, the built-in
generators) produces a :class:`Trace`. A request's prompt is given either as explicit token
ids or as trace ``hash_ids`` (one id per ``trace_block_size`` tokens, expanded to
deterministic tokens by :mod:`kvblock.replay.expand`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .jsonl import BadLine

__all__ = ["MAX_ARRIVAL_MS", "SchedulerDefaults", "Trace", "TraceRequest", "arrival_ms"]

#: The latest arrival a trace line may give: 366 days after the trace start, in milliseconds.
#: Trace timestamps count from the trace's start; a later one is corrupt, in another unit or an
#: epoch time (and its idle time would print as a number of hundreds of digits in the report).
MAX_ARRIVAL_MS = 366 * 86_400_000

#: milliseconds per unit of a trace's ``timestamp`` field
_MS_PER_UNIT = {"ms": 1.0, "s": 1000.0}


def arrival_ms(timestamp: float, unit: str = "ms") -> float:
    """A trace line's ``timestamp`` (in ``unit``: ``"ms"`` or ``"s"``) as milliseconds.

    Raises:
        ValueError: a negative or non-finite timestamp, or one beyond :data:`MAX_ARRIVAL_MS`
            (366 days; the message gives the bound in ``unit``).
    """
    if not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"timestamp must be a finite number >= 0, got {timestamp}")
    per_unit = _MS_PER_UNIT[unit]
    limit = MAX_ARRIVAL_MS / per_unit
    if timestamp > limit:
        raise ValueError(f"timestamp must be at most {limit:,.0f} {unit} (366 days after the trace start), "
                         f"got {timestamp!r}")
    return float(timestamp) * per_unit


@dataclass(slots=True)
class TraceRequest:
    """One request of a workload.

    Attributes:
        index: position in the trace (0-based, file order); also seeds synthetic outputs.
        request_id: the id given to the KV cache manager (``"req-{index}"`` for files).
        arrival_ms: arrival time in milliseconds since the trace start.
        prompt_len: prompt tokens (> 0).
        output_len: tokens to generate (>= 0).
        hash_ids: int64 trace block ids (hash-id traces), or None.
        prompt_tokens: int64 prompt token ids (token traces, built-ins), or None.
        output_tokens: int64 output token ids, or None for synthetic unique outputs.
        line: 1-based source line (0 for generated requests).
        session: conversation id where the source has one (Bailian ``chat_id``), else None.
    """

    index: int
    request_id: str
    arrival_ms: float
    prompt_len: int
    output_len: int
    hash_ids: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    line: int = 0
    session: Any = None


@dataclass(frozen=True)
class SchedulerDefaults:
    """Scheduler settings a workload is meant to run with (CLI flags override them).

    ``None`` means "the tool's general default" (see :class:`kvblock.replay.SimConfig`).
    ``token_budget = 0`` means unlimited.
    """

    num_blocks: int | None = None
    block_size: int | None = None
    max_running: int | None = None
    token_budget: int | None = None
    chunked_prefill: bool | None = None
    hash_algo: str | None = None
    asap: bool | None = None


@dataclass
class Trace:
    """A loaded or generated workload.

    Attributes:
        name: short display name (file name or built-in workload name).
        source: the path, or ``"builtin:<name>"``.
        requests: the requests, sorted by arrival (ties keep file order).
        trace_block_size: tokens per hash id for hash-id traces, else None.
        format: ``"mooncake"``, ``"bailian"``, ``"tokens"`` or ``"builtin"``.
        bad_lines: lines skipped with ``skip_bad_lines``.
        defaults: scheduler settings the workload comes with.
        description: one line describing the workload.
    """

    name: str
    source: str
    requests: list[TraceRequest]
    trace_block_size: int | None = None
    format: str = "tokens"
    bad_lines: list[BadLine] = field(default_factory=list)
    defaults: SchedulerDefaults = field(default_factory=SchedulerDefaults)
    description: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        """Total prompt tokens of all requests."""
        return sum(r.prompt_len for r in self.requests)

    def head(self, n: int | None) -> "Trace":
        """The same trace restricted to its first ``n`` requests (all when ``n`` is None)."""
        if n is None or n >= len(self.requests):
            return self
        return Trace(
            name=self.name, source=self.source, requests=self.requests[:n],
            trace_block_size=self.trace_block_size, format=self.format,
            bad_lines=self.bad_lines, defaults=self.defaults, description=self.description,
        )
