"""The local base image every sandbox image is built on: a present or pullable image named by the job, else Debian
bookworm bootstrapped here with ``debootstrap --variant=minbase`` and ``docker import``-ed as ``sandforge/base:bookworm``
(no registry is needed). sandbox/images.py builds the environments' images on it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections import deque
from pathlib import Path
from typing import Callable

import docker
import docker.errors

BASE_TAG = "sandforge/base:bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

Progress = Callable[[str], None]


class ImageError(RuntimeError):
    """An image could not be found, pulled, bootstrapped or built; the message says what to run."""


def _noop(_: str) -> None:
    pass


def image_id(client: docker.DockerClient, ref: str) -> str | None:
    """The id of local image ``ref``; None if the daemon has no such image (any other fault of the daemon raises)."""
    try:
        return client.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None


def ensure_base_image(
    client: docker.DockerClient,
    base_image: str | None = None,
    mirror: str = DEFAULT_MIRROR,
    progress: Progress | None = None,
) -> str:
    """Return a local base image tag: ``base_image`` if present or pullable, else a bootstrapped Debian bookworm."""
    progress = progress or _noop
    if base_image:
        if image_id(client, base_image):
            return base_image
        try:
            progress(f"pulling {base_image}")
            client.images.pull(base_image)
            return base_image
        except Exception as e:  # no registry here is the normal case: fall back to bootstrapping
            progress(f"cannot pull {base_image} ({type(e).__name__}); bootstrapping {BASE_TAG} instead")
    if image_id(client, BASE_TAG):
        return BASE_TAG
    return _bootstrap_base(client, mirror, progress)


def _bootstrap_base(client: docker.DockerClient, mirror: str, progress: Progress) -> str:
    if shutil.which("debootstrap") is None:
        raise ImageError(
            f"no base image and debootstrap is not installed: `apt-get install debootstrap`, "
            f"or pass a base image that is present locally (it becomes the base instead of {BASE_TAG})"
        )
    if os.geteuid() != 0:
        raise ImageError("bootstrapping the base image runs debootstrap, which needs root: run this step as root")
    with tempfile.TemporaryDirectory(prefix="sandforge-base-") as tmp:
        rootfs, tar_path = Path(tmp) / "rootfs", Path(tmp) / "rootfs.tar"
        _run_streaming(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror], progress)
        # Downloaded .debs and apt lists are dead weight in every image; env Dockerfiles run apt-get update anyway.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        progress("packing the root filesystem")
        _run_streaming(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tar_path), "."], progress)
        progress(f"importing {BASE_TAG}")
        repo, tag = BASE_TAG.split(":")
        client.api.import_image(
            src=str(tar_path),
            repository=repo,
            tag=tag,
            changes=[
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV LANG=C.UTF-8",
                'CMD ["bash"]',
            ],
        )
    if not image_id(client, BASE_TAG):
        raise ImageError(f"docker import finished but {BASE_TAG} is not present; check `docker images`")
    return BASE_TAG


def _run_streaming(cmd: list[str], progress: Progress) -> None:
    tail: deque[str] = deque(maxlen=20)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail.append(line)
            progress(line)
    if proc.wait() != 0:
        raise ImageError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}):\n" + "\n".join(tail))
