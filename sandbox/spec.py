"""What a sandbox container is allowed: the spec, and the Docker options that enforce it.

Hardening (every SandboxSpec default): no network (or only an ``internal`` Docker network a task names), a read-only
root filesystem, a size-capped workspace at ``workdir`` owned by the sandbox user (who is also HOME), tmpfs ``/tmp``,
cpu/memory (swap = memory)/pids limits, nofile and fsize ulimits, ``init`` as PID 1, no capabilities for the user and
``no-new-privileges``, the runtime (runc, runsc, ...) chosen by the spec.

``/tmp`` and the scratch folders allow exec. Docker mounts a tmpfs ``noexec`` unless its options say ``exec``, but
Harbor mounts nothing on /tmp, and tasks build and run programs there: ``go test`` executes its binary from
``$TMPDIR/go-build*``, a C grader its ``a.out`` from ``mktemp -d``; under noexec they score 0 where plain Docker passes.
noexec never confined the policy (it may run what it writes in the workspace, or ``sh /tmp/x``), and exec there opens
no way into grading: the policy's processes are stopped before any check, and graders run in a clean context whose
PATH is the image's (policy_stop.py, clean_context.py). ``nosuid`` and ``nodev`` stay, as does every size cap; the
session spools stay ``noexec``.

The workspace is an anonymous volume backed by tmpfs, not a tmpfs mount: Docker's archive API (``put_archive``,
``get_archive``, ``docker cp``) refuses tmpfs mounts of a read-only container ("container rootfs is marked read-only")
and reads the image's folder hidden beneath them, but it does see volumes. Such a volume needs the user's numeric ids
(tmpfs ``uid=``), read once per image from its /etc/passwd; and it must be removed with its container (``v=True``).
"""

from __future__ import annotations

import io
import tarfile
import threading
from dataclasses import dataclass

import docker
import docker.errors
import requests
from docker.types import DriverConfig, Mount, Ulimit

from sandforge.sandbox.shell import ROOT_SESSION_DIR, SESSION_DIR
from sandforge.sandbox.stop_scripts import GUARD_SCRIPT, GUARD_VARIABLE, guard_command
from sandforge.types import SandboxError

SPOOL_SIZE = "64m"  # tmpfs for session state and command output: a command printing more gets "No space left"
EXEC = "exec"  # a task's own tmpfs (/tmp, scratch): programs built there run (Docker's default is noexec)
LABEL_PROBE = "sandforge.probe"  # a never-started container that reads an image's /etc/passwd

# Root inside the sandbox keeps just enough to manage files the policy made (0600 answers, read-only test folders),
# so verifiers and setup can act as root. Docker grants a container's capabilities to execs as root only if the
# container's own user is root, so PID 1 (`sleep`) runs as root and every exec defaults to the unprivileged spec.user,
# whose processes have no capabilities at all (non-root, and no-new-privileges blocks setuid and file capabilities).
ROOT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL"]  # KILL: graders stop the policy's processes first
# A task whose agent is root (Harbor's contract) also needs what package managers and daemons do as root: drop to
# their own users (apt's _apt), keep setgid bits, signal their children, bind low ports. Still no raw sockets, mknod,
# chroot, ptrace or admin capabilities, and no-new-privileges stays.
ROOT_AGENT_CAPS = ROOT_CAPS + ["FSETID", "SETGID", "SETUID", "NET_BIND_SERVICE"]


@dataclass
class SandboxSpec:
    """How to start a sandbox. Sizes use Docker's units ("512m").

    Everything on tmpfs (the workspace, /tmp, the scratch folders, the output spool) is memory and counts towards
    ``memory``: the caps bound each folder, the memory limit all of them together. The caps together fit inside the
    memory limit with the two spools and ``RESERVE`` to spare (``fitted_caps``, scaling each down alike where they do
    not): a cap larger than that (a Harbor task's 1 GiB WORKDIR in a 512 MiB sandbox), or folders that only together
    are (the workspace, /tmp and a hardened agent's scratch folders, filled at once), let the policy's writes OOM-kill
    the whole container, a failed episode; fitted, the write gets "No space left on device" and the episode is
    graded.
    """

    image: str
    memory: str = "512m"  # memory limit; memory+swap is the same, so no swap
    cpus: float = 1.0
    pids_limit: int = 256
    network: str | bool | None = None  # name of an `internal` Docker network to join; None/False: no network at all
    user: str = "sandbox"  # runs every command; a name from the image's /etc/passwd, or "uid[:gid]"
    workdir: str = "/workspace"
    runtime: str | None = None  # e.g. "runsc" for gVisor where installed
    max_output_bytes: int = 16384
    read_only: bool = True  # read-only root filesystem
    workspace_size: str | None = "192m"  # tmpfs at workdir; None: a disk volume, image content copied in, no cap
    tmp_size: str = "128m"  # tmpfs at /tmp
    home: str | None = None  # HOME of every command; None: the workdir
    workspace_from_image: bool = False  # the capped workspace starts with the image's workdir content (workspace.py)
    scratch: tuple[str, ...] = ()  # more tmpfs folders (tmp_size each) over the image's: 1777, or the user's home
    nofile: int = 4096  # open files per process
    max_file_size: str = "256m"  # fsize ulimit: a process writing a larger file gets SIGXFSZ
    root_caps: tuple[str, ...] = tuple(ROOT_CAPS)  # what root in the container may do (ROOT_AGENT_CAPS: a root agent)
    proxy: bool = False  # mount a host folder of its own at PROXY_MOUNT, read-only: an agent harness's proxy socket
    grading: SandboxSpec | None = None  # a separate grader's sandbox (a task's ``grading_image``): ``grading_sandbox``

    def __post_init__(self) -> None:
        self.workspace_size, self.tmp_size = fitted_caps(self.workspace_size, self.tmp_size, 1 + len(self.scratch),
                                                         self.memory)


PROXY_MOUNT = "/run/sandforge-proxy"  # where a sandbox with ``proxy`` sees its folder (rollout/harnesses.py too)
PROXY_ROOT = "/run/sandforge/proxy"  # on the Docker host: one folder per such sandbox, named by its episode id
RESERVE = "64m"  # of a sandbox's memory, kept for its processes whatever the tmpfs caps


def fitted_caps(workspace: str | int | None, tmp: str | int, tmp_folders: int,
                memory: str | int) -> tuple[str | int | None, str | int]:
    """The caps of the workspace (None: a disk volume, no tmpfs) and of each of ``tmp_folders`` tmpfs folders of
    ``tmp`` each (/tmp and the scratch folders), as given when all of them together fit in what of ``memory`` is left
    after both spools and ``RESERVE``, else each scaled down by the same factor (at least 1 MiB each): the policy
    filling every folder at once never takes the sandbox's whole memory."""
    room = max(1 << 20, parse_size(memory) - 2 * parse_size(SPOOL_SIZE) - parse_size(RESERVE))
    asked = (parse_size(workspace) if workspace is not None else 0) + tmp_folders * parse_size(tmp)
    if asked <= room:
        return workspace, tmp
    fit = lambda size: f"{max(1 << 10, parse_size(size) * room // asked >> 10)}k"  # noqa: E731
    return (None if workspace is None else fit(workspace)), fit(tmp)


def container_options(client: docker.DockerClient, spec: SandboxSpec, labels: dict[str, str],
                      proxy_dir: str | None = None) -> dict:
    """Keyword arguments of ``containers.create`` for a sandbox of ``spec`` (the volume gets ``labels`` too).
    ``proxy_dir``: the host folder mounted read-only at PROXY_MOUNT (``spec.proxy``): a socket in it is the sandbox's
    one way out, and the policy can neither replace nor add one.

    Raises SandboxError for a network that is not internal or a user the image lacks.
    """
    fsize = parse_size(spec.max_file_size)
    return dict(
        command=guard_command(spec.user),  # sleeps; stops the policy's processes on SIGUSR1 (stop_scripts.py)
        init=True,  # tini as PID 1 reaps the zombies a policy's commands leave behind
        network_mode=_network_mode(client, spec.network),
        user="root",  # see ROOT_CAPS; the policy's commands run as spec.user
        working_dir=spec.workdir,
        environment={"HOME": spec.home or spec.workdir, GUARD_VARIABLE: GUARD_SCRIPT},
        read_only=spec.read_only,
        mounts=[_workspace_mount(client, spec, labels)]
        + ([Mount(PROXY_MOUNT, proxy_dir, type="bind", read_only=True)] if proxy_dir else []),
        tmpfs={
            "/tmp": f"{EXEC},size={spec.tmp_size},mode=1777",
            SESSION_DIR: f"size={SPOOL_SIZE},mode=1777",
            ROOT_SESSION_DIR: f"size={SPOOL_SIZE},mode=0700",  # verifiers' spool: the policy cannot fill it
            **{path: _scratch_options(client, spec, path, labels) for path in spec.scratch},
        },
        ulimits=[
            Ulimit(name="nofile", soft=spec.nofile, hard=spec.nofile),
            Ulimit(name="fsize", soft=fsize, hard=fsize),
        ],
        mem_limit=spec.memory,
        memswap_limit=spec.memory,
        nano_cpus=int(spec.cpus * 1e9),
        pids_limit=spec.pids_limit,
        cap_drop=["ALL"],
        cap_add=list(spec.root_caps),
        security_opt=["no-new-privileges"],
        runtime=spec.runtime,
    )


def _scratch_options(client: docker.DockerClient, spec: SandboxSpec, path: str, labels: dict[str, str]) -> str:
    """A scratch tmpfs: shared like /tmp (1777), or, at /home/<user>, the policy user's own."""
    if path.rstrip("/") == f"/home/{spec.user.split(':')[0]}":
        uid, gid = _ids_of(client, spec.image, spec.user, labels)
        return f"{EXEC},size={spec.tmp_size},mode=0755,uid={uid},gid={gid}"
    return f"{EXEC},size={spec.tmp_size},mode=1777"


def _network_mode(client: docker.DockerClient, network: str | bool | None) -> str:
    if network is None or network is False or network == "":
        return "none"
    if network is True:
        raise SandboxError(
            "SandboxSpec.network=True would join Docker's default bridge, which reaches the internet: name a network "
            "made with `docker network create --internal NAME` instead"
        )
    try:
        info = client.api.inspect_network(network)
    except docker.errors.NotFound as e:
        raise SandboxError(
            f"network {network!r} does not exist: create it with `docker network create --internal {network}`"
        ) from e
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise SandboxError(f"cannot inspect network {network!r}: {e}") from e
    if not info.get("Internal"):
        raise SandboxError(
            f"network {network!r} is not internal, so it may reach the internet; sandboxes only join networks made "
            f"with `docker network create --internal NAME`"
        )
    return network


_user_ids: dict[tuple[str, str], tuple[int, int]] = {}
_user_ids_lock = threading.Lock()


def _ids_of(
    client: docker.DockerClient, image: str, user: str, labels: dict[str, str] | None = None
) -> tuple[int, int]:
    """(uid, gid) of ``user`` in ``image``: read once per image from its /etc/passwd by a container never started.

    The probe carries ``labels`` (a sandbox's: its run and driver), so a probe left by a driver killed mid-read is
    removed by the reaper with the rest of that run's containers."""
    uid, _, gid = user.partition(":")
    if uid.isdigit():
        return int(uid), int(gid) if gid.isdigit() else int(uid)
    key = (client.api.inspect_image(image)["Id"], user)
    with _user_ids_lock:
        if key not in _user_ids:
            probe = client.api.create_container(
                image, command=["true"], network_disabled=True, labels={**(labels or {}), LABEL_PROBE: "user"}
            )["Id"]
            try:
                chunks, _ = client.api.get_archive(probe, "/etc/passwd")
                with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
                    passwd = tar.extractfile(tar.getmembers()[0]).read().decode(errors="replace")
            finally:
                client.api.remove_container(probe, force=True, v=True)
            for line in passwd.splitlines():
                fields = line.split(":")
                if len(fields) > 3 and fields[0] == user:
                    _user_ids[key] = (int(fields[2]), int(fields[3]))
            if key not in _user_ids:
                raise SandboxError(f"user {user!r} does not exist in image {image} (its /etc/passwd)")
        return _user_ids[key]


def _workspace_mount(client: docker.DockerClient, spec: SandboxSpec, labels: dict[str, str]) -> Mount:
    if spec.workspace_size is None:  # a plain anonymous volume: Docker copies the image's workdir into it
        return Mount(spec.workdir, None, type="volume", labels=labels)
    uid, gid = _ids_of(client, spec.image, spec.user, labels)
    options = f"size={parse_size(spec.workspace_size)},uid={uid},gid={gid},mode=0755"
    tmpfs = DriverConfig("local", {"type": "tmpfs", "device": "tmpfs", "o": options})
    return Mount(spec.workdir, None, type="volume", labels=labels, driver_config=tmpfs)


def parse_size(size: str | int) -> int:
    return docker.utils.parse_bytes(size) if isinstance(size, str) else int(size)
