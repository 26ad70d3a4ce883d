"""A rich progress bar with ETA for long replays (shown on a terminal only)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["replay_progress"]


@contextlib.contextmanager
def replay_progress(
    total: int, description: str, console: Console, enabled: bool = True
) -> Iterator[Callable[[int], None] | None]:
    """A progress bar over ``total`` requests.

    Yields ``update(done)`` (the number of requests done so far) to pass to
    :meth:`kvblock.replay.Replayer.run`, or None when disabled or when ``console`` is not a
    terminal (no bar in pipes, files or CI logs). The bar disappears when the block exits.
    """
    if not enabled or not console.is_terminal:
        yield None
        return
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda done: progress.update(task, completed=done)
