"""Who owns a sandbox container: the labels every container carries, and whether the driver they name still runs.

Every sandbox carries the run id, its episode and creation time, and ``driver_labels(run_id)``: the host, pid, and pid
start time of the driver process that owns its run (plus the boot id, so a pid from before a reboot is never taken for
a live one). A container whose driver is on this host and no longer running is garbage (lifecycle.py reaps it). A pid
alone is not enough, since Linux reuses pids; the start time in ``/proc/<pid>/stat`` tells the original process from a
later one with the same number.

Compute the labels once, in the driver, and pass the dict to the rollout workers: a worker that computed its own would
label containers with the worker's pid, and they would be reaped while the run is alive if that worker restarted.
"""

from __future__ import annotations

import os
import socket

from sandforge.types import SandboxError

LABEL_RUN = "sandforge.run"
LABEL_EPISODE = "sandforge.episode"
LABEL_CREATED = "sandforge.created"  # unix time of creation
LABEL_HOST = "sandforge.driver.host"
LABEL_PID = "sandforge.driver.pid"
LABEL_STARTED = "sandforge.driver.started"  # the pid's start time, clock ticks after boot (field 22 of /proc/pid/stat)
LABEL_BOOT = "sandforge.driver.boot"
DRIVER_LABELS = (LABEL_HOST, LABEL_PID, LABEL_STARTED, LABEL_BOOT)


def driver_labels(run_id: str) -> dict[str, str]:
    """Labels that name this process as the owner of ``run_id``'s containers. Call it in the driver process."""
    pid = os.getpid()
    started = _start_time(pid)
    if started is None:  # only without /proc (not Linux): such containers are never taken for a live driver's
        raise SandboxError(f"cannot read /proc/{pid}/stat: sandforge drivers need Linux's /proc")
    return {
        LABEL_RUN: run_id,
        LABEL_HOST: socket.gethostname(),
        LABEL_PID: str(pid),
        LABEL_STARTED: str(started),
        LABEL_BOOT: _boot_id(),
    }


def driver_alive(labels: dict[str, str]) -> bool | None:
    """True/False for a driver on this host; None if the labels name another host (we cannot tell from here).

    Malformed or missing driver labels count as dead: nothing live would own such a container.
    """
    try:
        host, pid, started, boot = (labels[k] for k in DRIVER_LABELS)
        pid_n, started_n = int(pid), int(started)
    except (KeyError, ValueError):
        return False
    if host != socket.gethostname():
        return None
    return boot == _boot_id() and _start_time(pid_n) == started_n


def _start_time(pid: int) -> int | None:
    """The start time of a running (not zombie) ``pid`` in clock ticks after boot; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # comm, field 2, is in parentheses and may itself hold spaces and ')': split after the last one.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has exited; only its exit status is left
        return None
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"
