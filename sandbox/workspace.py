"""A size-capped workspace that starts with what the image holds at its workdir.

The built-in envs' workspace is an empty tmpfs the task fills. A Harbor task ships its files in the image (its
Dockerfile's ``WORKDIR /app`` and ``COPY``), and Docker does not copy an image's content into a tmpfs volume. Without a
cap the workspace is a disk volume, and whatever the policy writes there lands on the host's disk without limit. So a
spec with ``workspace_from_image`` gets the capped tmpfs, and the image's workdir is copied into it as the sandbox
starts: read once per image from a container that is never started (``get_archive``, owners and modes kept), then
unpacked by root in the sandbox.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import docker
import docker.errors
import requests

from sandforge.sandbox.spec import LABEL_PROBE, parse_size
from sandforge.types import SandboxError

CACHED = 8  # archives kept, most recent first
MAX_CACHED_BYTES = 64 << 20  # larger archives are read again for every sandbox

_archives: OrderedDict[tuple[str, str], bytes] = OrderedDict()
_lock = threading.Lock()


def workdir_archive(client: docker.DockerClient, image: str, workdir: str, cap: str | int,
                    labels: dict[str, str] | None = None) -> bytes:
    """A tar archive of ``image``'s ``workdir`` (one member per entry, the folder itself first, named by its basename);
    b"" when the image has no such folder. SandboxError when it holds more than the workspace's ``cap``."""
    limit = parse_size(cap)
    try:
        key = (client.api.inspect_image(image)["Id"], workdir)
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise SandboxError(f"cannot inspect {image}: {e}") from e
    with _lock:
        cached = _archives.get(key)
        if cached is not None:
            _archives.move_to_end(key)
    if cached is not None:
        if len(cached) > limit:
            raise _too_large(image, workdir, cap)
        return cached
    probe = client.api.create_container(image, command=["true"], network_disabled=True,
                                        labels={**(labels or {}), LABEL_PROBE: "workdir"})["Id"]
    try:
        chunks, _ = client.api.get_archive(probe, workdir)
        data, size = bytearray(), 0
        for chunk in chunks:  # read to the end even past the cap: the daemon holds the probe until the stream is done
            size += len(chunk)
            if size <= limit:
                data += chunk
        if size > limit:
            raise _too_large(image, workdir, cap)
    except docker.errors.NotFound:
        data = bytearray()
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise SandboxError(f"cannot read {workdir} of {image}: {e}") from e
    finally:
        try:
            client.api.remove_container(probe, force=True, v=True)
        except (docker.errors.DockerException, requests.RequestException):
            pass  # the reaper removes probes
    archive = bytes(data)
    if len(archive) <= MAX_CACHED_BYTES:
        with _lock:
            _archives[key] = archive
            while len(_archives) > CACHED:
                _archives.popitem(last=False)
    return archive


def _too_large(image: str, workdir: str, cap: str | int) -> SandboxError:
    return SandboxError(f"{image}: its {workdir} holds more than the workspace's cap ({cap}); give the task a larger "
                        "[environment] storage_mb, or the job a larger sandbox.workspace_size")
