"""A Harbor task's ``[environment] healthcheck``: the sandbox is ready before the agent starts.

Harbor runs the command after the environment starts, Docker HEALTHCHECK's way: healthy at the first run that exits 0
within ``timeout_sec``; a failure counts only after ``start_period_sec`` (runs ``start_interval_sec`` apart until
then, ``interval_sec`` after), and ``retries`` failures in a row make it unhealthy. Here it runs as root in a fresh
shell (the image's services, started by its ENTRYPOINT, are root's) before the episode's first observation, so
nothing the policy does can make it pass or fail: an unhealthy sandbox fails the episode (``SandboxError``), as a
sandbox that would not start does.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from sandforge.types import Sandbox, SandboxError


@dataclass(frozen=True)
class Healthcheck:
    command: str
    interval: float = 5.0
    timeout: float = 30.0
    start_period: float = 0.0
    start_interval: float = 5.0
    retries: int = 3

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Healthcheck:
        return cls(**d)


def wait_healthy(sandbox: Sandbox, check: Healthcheck, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """Run ``check`` in ``sandbox`` until it passes (the number of runs it took) or is unhealthy (SandboxError with
    its last output)."""
    started, failures, runs = clock(), 0, 0
    while True:
        result = sandbox.exec(check.command, timeout=check.timeout, user="root", session=False)
        runs += 1
        if result.exit_code == 0 and not result.timed_out:
            return runs
        starting = clock() - started < check.start_period
        if not starting:
            failures += 1
            if failures >= check.retries:
                why = "timed out" if result.timed_out else f"exited {result.exit_code}"
                raise SandboxError(f"the task's healthcheck failed {failures} time(s) in a row ({why}: "
                                   f"{result.output.strip()[-200:]}); the agent was not started")
        sleep(check.start_interval if starting else check.interval)
