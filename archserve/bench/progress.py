"""One rich progress bar shape for every bench phase; silent when not on a terminal."""

from __future__ import annotations

import sys

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


def progress_bar(enabled: bool = True) -> Progress:
    # stderr keeps stdout clean for --json; disable=True makes every call a no-op.
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=True,
                    disable=not (enabled and sys.stderr.isatty()))
