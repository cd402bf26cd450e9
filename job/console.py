"""What the driver prints: one console (stderr), progress bars, run ids, and the one-line error a user acts on.

Off a terminal (output redirected to a file, a CI log) rich draws no live bars, so a long phase would print nothing
for minutes: there ``heartbeat()`` prints a status line (the phase the run is in and every open bar's count) whenever
nothing was printed for ``HEARTBEAT_S`` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import uuid
import weakref
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HEARTBEAT_S = 30.0  # the longest silence off a terminal


class _StampedStderr:
    """sys.stderr (whatever it is at the time: tests swap it) that remembers when it was last written to."""

    def __init__(self) -> None:
        self.last_write = time.monotonic()

    def write(self, text: str) -> int:
        if text.strip():
            self.last_write = time.monotonic()
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()

    def fileno(self) -> int:
        return sys.stderr.fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stderr, "encoding", "utf-8")


_stderr = _StampedStderr()
console = Console(file=_stderr)
_bars: weakref.WeakSet[Progress] = weakref.WeakSet()
_phase: list[tuple[str, float]] = []  # what the run is doing, innermost last, with when it began


class JobError(RuntimeError):
    """The job cannot go on for a reason the user can act on (no verified demonstrations, ...): one line, no traceback.
    Its message often quotes an episode's failure, which the policy's output can carry: every control character in it
    is made visible (``policy_text.visible``), whoever built the message."""

    def __init__(self, message: str = "") -> None:
        from sandforge.policy_text import visible

        super().__init__(visible(str(message)))


def make_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def progress() -> Progress:
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)
    _bars.add(bar)
    return bar


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Name what the run is doing for the heartbeat line (``starting the trainer ranks``)."""
    _phase.append((what, time.monotonic()))
    try:
        yield
    finally:
        _phase.remove(next(p for p in reversed(_phase) if p[0] == what))


def status_line() -> str:
    """What the run is doing now: the innermost phase and its duration, and each open bar's count."""
    now = time.monotonic()
    parts = [f"{what} ({_seconds(now - since)})" for what, since in _phase[-1:]]
    for bar in list(_bars):
        for task in bar.tasks:
            if not task.finished and task.visible:
                total = f"/{task.total:g}" if task.total is not None else ""
                parts.append(f"{task.description}: {task.completed:g}{total} ({_seconds(task.elapsed or 0)})")
    return f"[{time.strftime('%H:%M:%S')}] " + ("; ".join(parts) or "working")


def _seconds(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@contextlib.contextmanager
def heartbeat(every: float = HEARTBEAT_S) -> Iterator[None]:
    """Off a terminal, print ``status_line()`` whenever nothing was printed for ``every`` seconds, until the block ends;
    on a terminal the bars show the same live, so nothing is added."""
    if console.is_terminal:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(1.0, every / 4)):
            if time.monotonic() - _stderr.last_write >= every:
                console.print(status_line(), soft_wrap=True, highlight=False, markup=False)

    thread = threading.Thread(target=beat, name="sandforge-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
