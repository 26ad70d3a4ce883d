"""Reading JSON Lines trace files with line numbers (plain or gzip-compressed).

Each non-blank line is decoded with msgspec; a line that fails (bad JSON, wrong field types,
or a record its converter rejects) raises :class:`~kvblock.replay.errors.TraceFormatError`
naming the file and the 1-based line number, or, with ``skip_bad_lines``, is counted and
skipped.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import msgspec

from .errors import ReplayError, TraceFormatError

__all__ = ["BadLine", "JsonlReader", "open_trace_file"]

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
        skip_bad_lines: skip lines that fail instead of raising; they are listed in
            :attr:`bad_lines`.

    Attributes:
        bad_lines: the skipped lines, in file order.
    """

    path: str
    skip_bad_lines: bool = False
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
        with open_trace_file(self.path) as f:
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
