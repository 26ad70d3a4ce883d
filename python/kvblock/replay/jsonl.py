"""Reading JSON Lines trace files with line numbers (plain or gzip-compressed).

Each non-blank line is decoded with msgspec; a line that fails (bad JSON, wrong field types,
or a record its converter rejects) raises :class:`~kvblock.replay.errors.TraceFormatError`
naming the file and the 1-based line number, or, with ``skip_bad_lines``, is counted and
skipped. Standard input (``-``) and pipes are read once, into memory.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import msgspec

from .errors import ReplayError, TraceFormatError

__all__ = ["BadLine", "JsonlReader", "STDIN", "is_stream", "open_trace_file", "read_stream"]

#: The path that names standard input.
STDIN = "-"

T = TypeVar("T")


@dataclass(frozen=True)
class BadLine:
    """A skipped line: its 1-based number and the reason it was rejected."""

    line: int
    reason: str


def open_trace_file(path: str):
    """Open ``path`` for binary reading (``.gz`` files are decompressed).

    Raises:
        ReplayError: the file does not exist, is a directory, or cannot be read.
    """
    if not os.path.exists(path):
        raise ReplayError(f"trace file not found: {path}")
    if os.path.isdir(path):
        raise ReplayError(f"trace path is a directory, not a file: {path}")
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")
        return open(path, "rb")
    except OSError as e:
        raise ReplayError(f"cannot read trace file {path}: {e.strerror or e}") from None


def is_stream(path: str) -> bool:
    """``path`` is standard input (``-``) or a pipe, socket or device (``/dev/stdin`` fed by
    a pipe, ``<(...)``): it can be read only once, so a trace is read from it into memory."""
    if path == STDIN:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def read_stream(path: str) -> bytes:
    """Read all of standard input (``-``) or a pipe (gzip data is decompressed).

    Raises:
        ReplayError: it cannot be read, or its gzip data is corrupt.
    """
    try:
        if path == STDIN:
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
        return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    except (OSError, EOFError) as e:
        what = "standard input" if path == STDIN else path
        raise ReplayError(f"cannot read trace from {what}: {getattr(e, 'strerror', None) or e}") from None


def _reason(exc: Exception) -> str:
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid record: {exc}"
    if isinstance(exc, msgspec.DecodeError):
        return f"malformed JSON: {exc}"
    return str(exc)


@dataclass
class JsonlReader:
    """Iterate over the decoded lines of a JSONL file.

    Args:
        path: the file (``.gz`` allowed).
        data: the file's bytes, already read (from a stream, see :func:`read_stream`);
            None: read ``path``.
        skip_bad_lines: skip lines that fail instead of raising; they are listed in
            :attr:`bad_lines`.

    Attributes:
        bad_lines: the skipped lines, in file order.
    """

    path: str
    skip_bad_lines: bool = False
    data: bytes | None = None
    bad_lines: list[BadLine] = field(default_factory=list)

    def records(self, convert: Callable[[bytes, int], T]) -> Iterator[tuple[int, T]]:
        """Yield ``(line_number, convert(line_bytes, line_number))`` for every non-blank line.

        ``convert`` decodes and validates one line; it raises ``msgspec.DecodeError`` /
        ``msgspec.ValidationError`` or ``ValueError`` (whose message is the reason) for a
        bad line.

        Raises:
            ReplayError: the file cannot be opened or read (including corrupt gzip data).
            TraceFormatError: a bad line, unless ``skip_bad_lines``.
        """
        with (open_trace_file(self.path) if self.data is None else io.BytesIO(self.data)) as f:
            line_no = 0
            while True:
                try:
                    raw = f.readline()
                except (OSError, EOFError) as e:
                    raise ReplayError(f"cannot read trace file {self.path}: {e}") from None
                if not raw:
                    return
                line_no += 1
                if not raw.strip():
                    continue
                try:
                    yield line_no, convert(raw, line_no)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                    if not self.skip_bad_lines:
                        raise TraceFormatError(self.path, line_no, _reason(e)) from None
                    self.bad_lines.append(BadLine(line_no, _reason(e)))
