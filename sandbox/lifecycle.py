"""Reaping: removing the containers of a run, or of drivers that died, and retrying a flaky daemon meanwhile.

Who owns a container, and how to tell whether that driver still runs, is in labels.py.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Iterable, TypeVar

import docker
import docker.errors
import requests
import urllib3.exceptions

from sandforge.sandbox import proxy_folders
from sandforge.sandbox.daemon import docker_client, force_remove
from sandforge.sandbox.labels import LABEL_EPISODE, LABEL_RUN, driver_alive
from sandforge.types import SandboxError

log = logging.getLogger(__name__)
T = TypeVar("T")


# --- reaping -------------------------------------------------------------------------------------------------------


def _run_containers(run_id: str, client: docker.DockerClient) -> list[tuple[str, str]]:
    """(id, episode label) of every container of this run."""
    found = client.containers.list(all=True, sparse=True, filters={"label": f"{LABEL_RUN}={run_id}"})
    return [(c.id, (c.attrs.get("Labels") or {}).get(LABEL_EPISODE, "")) for c in found]


def remove_run_containers(run_id: str, client: docker.DockerClient | None = None) -> int:
    """Force-remove every container of this run (e.g. a crashed driver's), their volumes and their proxy folders;
    returns how many containers were removed."""
    client = client or docker_client()
    removed = 0
    for cid, episode in _run_containers(run_id, client):
        removed += force_remove(client, cid)
        proxy_folders.remove(episode)
    try:  # volumes whose container was removed without v=True
        for volume in client.api.volumes(filters={"label": f"{LABEL_RUN}={run_id}"}).get("Volumes") or []:
            try:
                client.api.remove_volume(volume["Name"], force=True)
            except docker.errors.APIError:
                pass  # still in use by a container being removed
    except (docker.errors.DockerException, requests.RequestException):
        pass
    return removed


def reap_dead_runs(client: docker.DockerClient | None = None, runs: Iterable[str] | None = None) -> dict[str, int]:
    """Remove every sandforge container whose driver was on this host and is gone, with its proxy folder; returns
    run id -> removed count.

    Containers of live drivers, and of drivers on other hosts, are left alone. A container with the run label but
    missing or malformed driver labels is removed (no live driver can own it). ``runs`` limits the sweep to those
    run ids (default: every run); a sweep of every run also drops the proxy folders no container claims
    (``proxy_folders.stale``). Removal failures are logged and skipped; a later reap retries them.
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
        proxy_folders.remove(labels.get(LABEL_EPISODE))
        removed[run] = removed.get(run, 0) + 1
    if wanted is None:
        claimed = [(c.attrs.get("Labels") or {}).get(LABEL_EPISODE, "") for c in containers]
        for episode in proxy_folders.stale(claimed):
            proxy_folders.remove(episode)
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
