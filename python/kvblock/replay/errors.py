"""The replay tool's user-facing errors.

Every problem caused by the input or the settings (a missing file, a malformed trace line, a
cache too small for a request, an unknown implementation) is a :class:`ReplayError`: the
``kvblock`` command prints its message and exits with its ``exit_code``, never with a
traceback. Programming errors keep their own exception types.
"""

from __future__ import annotations

__all__ = ["ReplayError", "SettingError", "TraceFormatError", "UnservableRequestsError"]


class ReplayError(Exception):
    """A user error of ``kvblock replay`` / ``kvblock sweep``; ``str(e)`` is the message.

    Attributes:
        exit_code: the process exit status the CLI uses (2: bad input or settings).
    """

    exit_code = 2


class SettingError(ReplayError, ValueError):
    """A :class:`~kvblock.replay.SimConfig` field that is not valid, raised when the config
    is built: ``str(e)`` names the field (``num_blocks: must be >= 2 ...``); the ``kvblock``
    command prints :attr:`option_message`, which names its option (``--num-blocks must be
    >= 2 ...``). A ``ValueError`` too, as a Python caller expects of a bad argument.

    Attributes:
        field: the field's name (``"num_blocks"``).
        template: the message with ``{name}`` where the field or option is named.
    """

    def __init__(self, field: str, template: str) -> None:
        self.field, self.template = field, template
        super().__init__(template.format(name=field))

    @property
    def option_message(self) -> str:
        """The message naming the command-line option (``--num-blocks``)."""
        return self.template.format(name="--" + self.field.replace("_", "-"))

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.field, self.template))


class TraceFormatError(ReplayError):
    """A trace line that cannot be read: malformed JSON or an invalid record.

    Attributes:
        path: the trace file.
        line: 1-based line number of the offending line.
        reason: what is wrong with it.
    """

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(
            f"{path}:{line}: {reason} (pass --skip-bad-lines to skip such lines)"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, str]]:
        # pickled by its constructor's arguments (``args`` holds the message only)
        return (type(self), (self.path, self.line, self.reason))


class UnservableRequestsError(ReplayError):
    """Requests that need more KV-cache blocks than the whole cache holds.

    Raised by the CLI *after* the replay has run and its report was printed, so the numbers of
    the servable requests are still shown; the replay itself never hangs on such a request.

    Attributes:
        count: how many requests were unservable.
    """

    exit_code = 3

    def __init__(self, message: str, count: int) -> None:
        self.count = count
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return (type(self), (str(self), self.count))
