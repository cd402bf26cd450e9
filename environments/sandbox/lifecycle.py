"""Who owns a container, reaping the containers of dead drivers, and retrying a flaky daemon.

Every sandbox carries ``driver_labels(run_id)``: the host, pid, and pid start time of the driver process that owns its
run (plus the boot id, so a pid from before a reboot is never taken for a live one). A container whose driver is on
this host and no longer running is garbage: ``reap_dead_runs`` removes it. A pid alone is not enough, since Linux
reuses pids; the start time in ``/proc/<pid>/stat`` tells the original process from a later one with the same number.

Compute the labels once, in the driver, and pass the dict to the rollout workers: a worker that computed its own would
label containers with the worker's pid, and they would be reaped while the run is alive if that worker restarted.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from typing import Callable, Iterable, TypeVar

import docker
import docker.errors
import requests
import urllib3.exceptions

from sandforge.environments.sandbox.docker_sandbox import LABEL_RUN, SandboxError, docker_client

LABEL_HOST = "sandforge.driver.host"
LABEL_PID = "sandforge.driver.pid"
LABEL_STARTED = "sandforge.driver.started"  # the pid's start time, clock ticks after boot (field 22 of /proc/pid/stat)
LABEL_BOOT = "sandforge.driver.boot"
DRIVER_LABELS = (LABEL_HOST, LABEL_PID, LABEL_STARTED, LABEL_BOOT)

log = logging.getLogger(__name__)
T = TypeVar("T")


# --- ownership ----------------------------------------------------------------------------------------------------


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


def reap_dead_runs(client: docker.DockerClient | None = None, runs: Iterable[str] | None = None) -> dict[str, int]:
    """Remove every sandforge container whose driver was on this host and is gone; returns run id -> removed count.

    Containers of live drivers, and of drivers on other hosts, are left alone. A container with the run label but
    missing or malformed driver labels is removed (no live driver can own it). ``runs`` limits the sweep to those
    run ids (default: every run). Removal failures are logged and skipped; a later reap retries them.
    """
    client = client or docker_client()
    wanted = None if runs is None else set(runs)
    containers = retry_daemon(
        lambda: client.containers.list(all=True, sparse=True, filters={"label": LABEL_RUN}), "list containers"
    )
    removed: dict[str, int] = {}
    for c in containers:
        labels = c.attrs.get("Labels") or {}
        run = labels.get(LABEL_RUN, "")
        if (wanted is not None and run not in wanted) or driver_alive(labels) is not False:
            continue
        try:
            remove_container(client, c.id)
        except SandboxError as e:
            log.warning("reaper: %s", e)
            continue
        removed[run] = removed.get(run, 0) + 1
    return removed


# --- a flaky daemon -----------------------------------------------------------------------------------------------


def is_transient(error: BaseException) -> bool:
    """A daemon error worth retrying: no connection, a timeout, or a 5xx. Looks through SandboxError to its cause."""
    if isinstance(error, SandboxError) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, docker.errors.APIError):
        return error.is_server_error()
    return isinstance(
        error,
        (requests.ConnectionError, requests.Timeout, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError),
    )


def retry_daemon(
    call: Callable[[], T],
    what: str,
    attempts: int = 4,
    backoff_s: float = 0.5,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``call()``, retried on transient daemon errors with exponential backoff (0.5, 1, 2 s, jittered).

    After ``attempts`` tries, or at once on an error that is not transient, raises SandboxError saying ``what`` failed.
    """
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            detail = str(e) if isinstance(e, SandboxError) else f"{type(e).__name__}: {e}"
            if not is_transient(e):
                if isinstance(e, SandboxError):
                    raise
                raise SandboxError(f"could not {what}: {detail}") from e
            if attempt == attempts - 1:
                raise SandboxError(f"could not {what} after {attempts} tries: {detail}") from e
            if on_retry is not None:
                on_retry(e)
            time.sleep(backoff_s * 2**attempt * random.uniform(0.8, 1.2))
    raise AssertionError("unreachable")


def remove_container(client: docker.DockerClient, container_id: str, attempts: int = 4, backoff_s: float = 0.5) -> None:
    """Force-remove a container and its anonymous volumes (the workspace), retrying a flaky daemon; a container
    already gone (or going) counts as removed."""

    def remove() -> None:
        try:
            client.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: removal already in progress
                raise

    retry_daemon(remove, f"remove container {container_id[:12]}", attempts=attempts, backoff_s=backoff_s)
