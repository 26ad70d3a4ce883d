"""Loading a trace file: format detection, per-line decoding, ordering.

:func:`load_trace` reads Mooncake, Bailian or token-id JSONL files (optionally ``.gz``) into
a :class:`~kvblock.replay.trace.Trace`, sorted by arrival time (ties keep file order, as the
Mooncake README asks).
"""

from __future__ import annotations

import os
from typing import Callable, NoReturn

import msgspec

from .bailian import BAILIAN_BLOCK_SIZE, decode_bailian
from .errors import ReplayError, TraceFormatError
from .jsonl import STDIN, JsonlReader, is_stream, read_stream
from .mooncake import MOONCAKE_BLOCK_SIZE, decode_mooncake
from .tokens_jsonl import decode_tokens
from .trace import Trace, TraceRequest

__all__ = ["FORMATS", "detect_format", "load_trace"]

#: The file formats :func:`load_trace` reads.
FORMATS = ("mooncake", "bailian", "tokens")


def _classify(obj: object) -> str | None:
    if isinstance(obj, list):
        return "tokens"
    if isinstance(obj, dict):
        if "hash_ids" in obj:
            return "bailian" if "chat_id" in obj else "mooncake"
        if "prompt_token_ids" in obj or "token_ids" in obj:
            return "tokens"
    return None


def detect_format(path: str, *, skip_bad_lines: bool = False, data: bytes | None = None) -> str:
    """Tell the format of a trace file from its first decodable line.

    ``hash_ids`` + ``chat_id`` → ``"bailian"``; ``hash_ids`` → ``"mooncake"``; a JSON
    array or ``prompt_token_ids`` / ``token_ids`` → ``"tokens"``. ``data``: the file's
    bytes when already read (a stream).

    Raises:
        ReplayError: the file cannot be read, is empty, or its first record matches no
            format; TraceFormatError: the first non-blank line is not JSON (unless
            ``skip_bad_lines``, which moves on to the next line).
    """
    reader = JsonlReader(path, skip_bad_lines=skip_bad_lines, data=data)
    for line, obj in reader.records(lambda raw, _line: msgspec.json.decode(raw)):
        kind = _classify(obj)
        if kind is None:
            raise ReplayError(
                f"{path}:{line}: cannot tell the trace format: expected an object with "
                "hash_ids (Mooncake / Bailian) or prompt_token_ids, or a JSON array of token "
                "ids (pass --format to choose)"
            )
        return kind
    _no_requests(path, reader)


def _no_requests(path: str, reader: JsonlReader) -> NoReturn:
    """The error of a trace with no request: with bad lines skipped, how many and the first."""
    if reader.bad_lines:
        first = reader.bad_lines[0]
        raise ReplayError(
            f"{path}: no valid request ({len(reader.bad_lines)} bad lines skipped; "
            f"first on line {first.line}: {first.reason})"
        )
    raise ReplayError(f"trace file has no requests: {path}")


def load_trace(
    path: str,
    *,
    format: str = "auto",
    trace_block_size: int | None = None,
    skip_bad_lines: bool = False,
    limit: int | None = None,
) -> Trace:
    """Load a trace file.

    Args:
        path: a JSONL file (``.gz`` allowed); ``-`` (standard input) or a pipe is read once,
            into memory.
        format: ``"auto"`` (detect), ``"mooncake"``, ``"bailian"`` or ``"tokens"``.
        trace_block_size: tokens per hash id (default 512 for Mooncake, 16 for Bailian;
            ignored for token traces).
        skip_bad_lines: skip malformed or invalid lines (listed in ``Trace.bad_lines``)
            instead of failing on the first one.
        limit: keep only the first ``limit`` valid requests in file order (a slice).

    Returns:
        The :class:`Trace`, requests sorted by ``arrival_ms`` (stable).

    Raises:
        ReplayError: unknown format, a non-positive ``trace_block_size`` or ``limit``, a
            missing/unreadable file, no valid request, or duplicate request ids;
        TraceFormatError: the first bad line (with its line number), unless
            ``skip_bad_lines``.
    """
    if format not in ("auto",) + FORMATS:
        raise ReplayError(f"unknown trace format {format!r}; choose from auto, {', '.join(FORMATS)}")
    if trace_block_size is not None and trace_block_size <= 0:
        raise ReplayError(f"--trace-block-size must be > 0, got {trace_block_size}")
    if limit is not None and limit <= 0:
        raise ReplayError(f"--limit must be > 0, got {limit}")
    data = read_stream(path) if is_stream(path) else None
    if format == "auto":
        format = detect_format(path, skip_bad_lines=skip_bad_lines, data=data)
    if format == "mooncake":
        tbs = trace_block_size or MOONCAKE_BLOCK_SIZE
    elif format == "bailian":
        tbs = trace_block_size or BAILIAN_BLOCK_SIZE
    else:
        tbs = None

    counter = [0]

    def convert(raw: bytes, line: int) -> TraceRequest:
        i = counter[0]
        if format == "mooncake":
            req = decode_mooncake(raw, line, i, tbs)
        elif format == "bailian":
            req = decode_bailian(raw, line, i, tbs)
        else:
            req = decode_tokens(raw, line, i)
        counter[0] += 1
        return req

    reader = JsonlReader(path, skip_bad_lines=skip_bad_lines, data=data)
    requests: list[TraceRequest] = []
    for _line, req in reader.records(convert):
        requests.append(req)
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        _no_requests(path, reader)
    seen: dict[str, int] = {}
    for r in requests:
        if r.request_id in seen:
            raise TraceFormatError(path, r.line, f"duplicate request_id {r.request_id!r} (first on line {seen[r.request_id]})")
        seen[r.request_id] = r.line
    requests.sort(key=_arrival)
    name = "stdin" if path == STDIN else os.path.basename(path)
    for ext in (".gz", ".jsonl", ".json"):
        if name.endswith(ext) and len(name) > len(ext):
            name = name[: -len(ext)]
    return Trace(
        name=name,
        source=path,
        requests=requests,
        trace_block_size=tbs,
        format=format,
        bad_lines=reader.bad_lines,
        description=f"{format} trace, {len(requests):,} requests",
    )


_arrival: Callable[[TraceRequest], float] = lambda r: r.arrival_ms  # noqa: E731
