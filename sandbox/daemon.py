"""The two calls on the Docker daemon that the sandbox, the reaper and the image builder all make: a client that
answers, and removing a container whatever state it is in."""

from __future__ import annotations

import docker
import docker.errors
import requests

from sandforge.types import SandboxError

DockerClient = docker.DockerClient  # the client's type, for code outside this part that holds one without importing docker


def docker_client(timeout: int = 120, max_pool_size: int = 32) -> docker.DockerClient:
    """A client for the local daemon (DOCKER_HOST etc. respected); SandboxError if the daemon does not answer."""
    try:
        client = docker.from_env(timeout=timeout, max_pool_size=max_pool_size)
        client.ping()
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise SandboxError(
            f"the Docker daemon is not answering ({e}): start it with `scripts/ensure_docker.sh` "
            "(or set DOCKER_HOST to a running daemon)"
        ) from e
    return client


def force_remove(client: docker.DockerClient, ref: str) -> bool:
    """Remove container ``ref`` and its anonymous volumes (the workspace), running or not; False if that failed."""
    try:
        client.api.remove_container(ref, force=True, v=True)
        return True
    except Exception:  # already gone, or the daemon is down: nothing left for us to do
        return False
