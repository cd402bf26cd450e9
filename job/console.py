"""What the driver prints: one console (stderr), progress bars, run ids, and the one-line error a user acts on."""

from __future__ import annotations

import time
import uuid

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


class JobError(RuntimeError):
    """The job cannot go on for a reason the user can act on (no verified demonstrations, ...): one line, no traceback."""


def make_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)
