"""One Docker container per episode: non-root, no network, cpu/memory/pids limits, every exec bounded in time.

Timeouts are enforced inside the container (coreutils ``timeout`` kills the command's whole process group), and the
client gives up a few seconds later still, so neither a runaway command nor a stuck stream can hold a rollout worker.
Output is capped inside the container too: a command that prints gigabytes costs the sandbox its cpu, not the driver.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from dataclasses import dataclass

import docker
import docker.errors
import requests

LABEL_RUN = "sandforge.run"
LABEL_EPISODE = "sandforge.episode"
KILL_AFTER = 2.0  # seconds between TERM and KILL when a command outlives its timeout
CLIENT_GRACE = 10.0  # extra seconds the client waits beyond the in-container timeout before giving up
FILE_TIMEOUT = 30.0  # read_file / write_file
MAX_READ_BYTES = 64 << 20
_WRITE_CHUNK = 64 << 10  # raw bytes per exec: base64 of it stays under Linux's 128 KiB limit for one argument
# Root inside the sandbox keeps just enough to manage files the policy made (0600 answers, read-only test folders),
# so verifiers and setup can act as root. Docker grants a container's capabilities to execs as root only if the
# container's own user is root, so PID 1 (`sleep`) runs as root and every exec defaults to the unprivileged spec.user,
# whose processes have no capabilities at all (non-root, and no-new-privileges blocks setuid and file capabilities).
ROOT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER"]

# The policy's command runs under `timeout`, which kills its whole process group when time is up. Background jobs it
# starts may outlive the call (`server > log 2>&1 &`), but those that still hold the call's output pipe would keep it
# open, so they are killed when the command returns: the scan finds write ends of this pipe in /proc/*/fd.
# Output passes through `head` + `dd | tail`: only the first and last bytes leave the container, and dd counts the rest.
# $1 command, $2 timeout, $3 kill-after, $4 head bytes, $5 tail bytes.
_EXEC_WRAPPER = r"""
( timeout --kill-after="$3" "$2" bash -c "$1" </dev/null 2>&1 & wait "$!"; rc=$?
  self=$BASHPID; me=$(readlink "/proc/$self/fd/1"); pat=${me//\[/\\[}; pat=${pat//\]/\\]}
  for round in 1 2 3; do
    killed=0
    for f in $(find /proc/[0-9]*/fd -lname "$pat" 2>/dev/null); do
      pid=${f#/proc/}; pid=${pid%%/*}
      [ "$pid" = "$self" ] && continue
      while read -r key value; do
        [ "$key" = flags: ] && (( 8#$value & 3 )) && kill -KILL "$pid" 2>/dev/null && killed=1
      done < "/proc/$pid/fdinfo/${f##*/}" 2>/dev/null
    done
    [ "$killed" = 1 ] || break
  done
  exit "$rc" ) | { head -c "$4"; LC_ALL=C dd bs=64K 2>&2 | tail -c "$5"; }
exit "${PIPESTATUS[0]}"
"""
# $1 path. Exit 3 means "no such file" (read_file returns None).
_READ_SCRIPT = r"""[ -e "$1" ] || exit 3; exec cat -- "$1" """
# $1 base64 chunk, $2 path, $3 "1" for the first chunk (create parents, truncate) else append.
_WRITE_SCRIPT = r"""
if [ "$3" = 1 ]; then mkdir -p -- "$(dirname -- "$2")" && printf %s "$1" | base64 -d > "$2"
else printf %s "$1" | base64 -d >> "$2"; fi
"""
_DD_BYTES = re.compile(rb"^(\d+) bytes", re.MULTILINE)


class SandboxError(RuntimeError):
    """The sandbox is broken, dead or unreachable: the episode using it has failed."""


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


@dataclass
class SandboxSpec:
    """How to start a sandbox. ``memory`` uses Docker's units ("512m"); it caps memory+swap together."""

    image: str
    memory: str = "512m"
    cpus: float = 1.0
    pids_limit: int = 256
    network: bool = False
    user: str = "sandbox"
    workdir: str = "/workspace"
    runtime: str | None = None  # e.g. "runsc" for gVisor where installed
    max_output_bytes: int = 16384


@dataclass
class ExecResult:
    exit_code: int
    output: str  # stdout and stderr merged, truncated to SandboxSpec.max_output_bytes
    timed_out: bool
    seconds: float


class Sandbox:
    """A running container that belongs to one episode. Create with ``Sandbox.create``; always ``close()``."""

    def __init__(self, container, spec: SandboxSpec, run_id: str, client: docker.DockerClient):
        self._container = container
        self._client = client
        self.id: str = container.id
        self.name: str = container.name
        self.run_id = run_id
        self.spec = spec
        self._closed = False

    @classmethod
    def create(cls, spec: SandboxSpec, run_id: str, client: docker.DockerClient | None = None) -> Sandbox:
        client = client or docker_client()
        episode = uuid.uuid4().hex
        name = f"sandforge-{re.sub(r'[^a-zA-Z0-9_.-]', '-', run_id)[:40]}-{episode[:12]}"
        try:
            # create + start, not run: run would try to pull a missing image from a registry
            container = client.containers.create(
                spec.image,
                command=["sleep", "infinity"],
                name=name,
                init=True,  # tini as PID 1 reaps the zombies a policy's commands leave behind
                network_mode="bridge" if spec.network else "none",
                user="root",  # see ROOT_CAPS; the policy's commands run as spec.user
                working_dir=spec.workdir,
                mem_limit=spec.memory,
                memswap_limit=spec.memory,
                nano_cpus=int(spec.cpus * 1e9),
                pids_limit=spec.pids_limit,
                cap_drop=["ALL"],
                cap_add=ROOT_CAPS,
                security_opt=["no-new-privileges"],
                labels={LABEL_RUN: run_id, LABEL_EPISODE: episode},
                runtime=spec.runtime,
            )
            container.start()
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"sandbox image {spec.image} is not present: run `sandforge images build`") from e
        except (docker.errors.DockerException, requests.RequestException) as e:
            _force_remove(client, name)  # created but failed to start (bad runtime, limits the host refuses)
            raise SandboxError(f"could not start a sandbox from {spec.image}: {e}") from e
        return cls(container, spec, run_id, client)

    # --- commands -------------------------------------------------------------------------------------------------

    def exec(
        self, command: str, timeout: float = 10.0, user: str | None = None, workdir: str | None = None
    ) -> ExecResult:
        """Run ``bash -c command`` as ``user`` (default spec.user) in ``workdir`` (default spec.workdir).

        After ``timeout`` seconds the command's process group is killed inside the container (TERM, then KILL
        KILL_AFTER seconds later) and the result has ``timed_out=True``. Each call is a fresh shell: no state but the
        filesystem carries over; background jobs survive only if they do not hold the call's output.
        Raises SandboxError if the container is dead or unreachable.
        """
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        limit = max(2, self.spec.max_output_bytes)
        head = limit // 2
        argv = ["bash", "-c", _EXEC_WRAPPER, "sandforge-exec", command]
        argv += [f"{timeout:g}", f"{KILL_AFTER:g}", str(head), str(limit - head)]
        start = time.monotonic()
        code, out, err, finished = self._run(
            argv, user=user, workdir=workdir, wait=timeout + KILL_AFTER + CLIENT_GRACE, max_bytes=limit + 1
        )
        seconds = time.monotonic() - start
        counted = _DD_BYTES.search(err)
        dropped = int(counted.group(1)) - (limit - head) if counted else 0
        if dropped > 0:
            out = out[:head] + f"\n[... truncated {dropped} bytes]\n".encode() + out[head:]
        if not finished:  # something inside kept the output open past the deadline (e.g. a setsid'd process)
            return ExecResult(124, out.decode(errors="replace") + "\n[timed out]", True, seconds)
        timed_out = code in (124, 137) and seconds >= timeout
        return ExecResult(code, out.decode(errors="replace"), timed_out, seconds)

    def write_file(self, path: str, content: str, user: str | None = None) -> None:
        """Write ``content`` (UTF-8) to ``path``, creating parent folders, with ``user``'s permissions.

        Relative paths are under the spec's workdir. Raises OSError if the user may not write there.
        """
        _check_path(path)
        data = content.encode()
        chunks = [data[i : i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            encoded = base64.b64encode(chunk).decode()
            script = ["bash", "-c", _WRITE_SCRIPT, "sandforge-write", encoded, path, str(int(i == 0))]
            argv = _bounded(FILE_TIMEOUT) + script
            code, _, err, finished = self._run(argv, user=user, wait=FILE_TIMEOUT + CLIENT_GRACE, max_bytes=4096)
            if code != 0 or not finished:
                raise OSError(f"cannot write {path}: {_reason(code, err, finished)}")

    def read_file(self, path: str, user: str | None = None) -> str | None:
        """The file's text (UTF-8, undecodable bytes replaced), or None if it does not exist.

        Raises OSError if it cannot be read (permissions, a directory, larger than MAX_READ_BYTES).
        """
        _check_path(path)
        argv = _bounded(FILE_TIMEOUT) + ["bash", "-c", _READ_SCRIPT, "sandforge-read", path]
        wait = FILE_TIMEOUT + CLIENT_GRACE
        code, out, err, finished = self._run(argv, user=user, wait=wait, max_bytes=MAX_READ_BYTES)
        if code == 3 and finished:
            return None
        if code != 0 or not finished:
            raise OSError(f"cannot read {path}: {_reason(code, err, finished)}")
        if len(out) > MAX_READ_BYTES:
            raise OSError(f"cannot read {path}: larger than {MAX_READ_BYTES} bytes")
        return out.decode(errors="replace")

    def _run(
        self,
        argv: list[str],
        *,
        user: str | None,
        wait: float,
        max_bytes: int,
        workdir: str | None = None,
    ) -> tuple[int, bytes, bytes, bool]:
        """Run argv as a fresh exec; returns (exit code, stdout, stderr, finished before ``wait`` seconds)."""
        api = self._client.api
        try:
            user, workdir = user or self.spec.user, workdir or self.spec.workdir
            exec_id = api.exec_create(self.id, argv, stdout=True, stderr=True, user=user, workdir=workdir)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self._broken(e) from e
        try:
            out, err, finished = _read_frames(sock, time.monotonic() + wait, max_bytes)
        except OSError as e:
            raise self._broken(e) from e
        finally:
            _close_stream(sock)
        if not finished:
            return -1, bytes(out), bytes(err), False
        code = self._exit_code(exec_id)
        return (-1 if code is None else code), bytes(out), bytes(err), True

    def _exit_code(self, exec_id: str) -> int | None:
        # The stream can close a moment before Docker records the exit code: poll briefly. Still None after that
        # means the process runs on, which happens only when max_bytes cut the read short.
        for _ in range(100):
            try:
                info = self._client.api.exec_inspect(exec_id)
            except (docker.errors.DockerException, requests.RequestException) as e:
                raise self._broken(e) from e
            if not info["Running"] and info["ExitCode"] is not None:
                return info["ExitCode"]
            time.sleep(0.02)
        return None

    def _broken(self, cause: Exception) -> SandboxError:
        state = "running" if self.alive() else "not running (exited, killed or removed)"
        return SandboxError(f"sandbox {self.name} is {state}: {cause}")

    # --- lifecycle ------------------------------------------------------------------------------------------------

    def alive(self) -> bool:
        try:
            self._container.reload()
        except Exception:
            return False
        return self._container.status == "running"

    def close(self) -> None:
        """Remove the container (force). Idempotent; never raises."""
        if not self._closed:
            self._closed = True
            _force_remove(self._client, self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.name}, image={self.spec.image})"


def list_run_containers(run_id: str, client: docker.DockerClient | None = None) -> list[str]:
    """Ids of every container (running or not) labelled with this run."""
    client = client or docker_client()
    return [c.id for c in client.containers.list(all=True, sparse=True, filters={"label": f"{LABEL_RUN}={run_id}"})]


def remove_run_containers(run_id: str, client: docker.DockerClient | None = None) -> int:
    """Force-remove every container of this run (e.g. a crashed driver's); returns how many were removed."""
    client = client or docker_client()
    return sum(_force_remove(client, cid) for cid in list_run_containers(run_id, client))


# --- helpers ------------------------------------------------------------------------------------------------------


def _force_remove(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.api.remove_container(ref, force=True)
        return True
    except Exception:  # already gone, or the daemon is down: nothing left for us to do
        return False


def _bounded(seconds: float) -> list[str]:
    return ["timeout", f"--kill-after={KILL_AFTER:g}", f"{seconds:g}"]


def _check_path(path: str) -> None:
    if not path or "\0" in path:
        raise ValueError(f"invalid path {path!r}")


def _reason(code: int, err: bytes, finished: bool) -> str:
    if not finished or code in (124, 137):
        return "timed out"
    return err.decode(errors="replace").strip() or f"exit code {code}"


def _read_frames(sock, deadline: float, max_bytes: int) -> tuple[bytearray, bytearray, bool]:
    """Demultiplex Docker's attach stream (8-byte header: stream id, 3 zero bytes, big-endian size) until EOF.

    Reads through the HTTP response's buffered reader, because the headers' read may already hold the first frames.
    Returns (stdout, stderr, reached EOF before the deadline); stops early once stdout exceeds max_bytes.
    """
    response = getattr(sock, "_response", None)
    reader = response.raw._fp.fp if response is not None else sock
    raw_sock = getattr(sock, "_sock", sock)
    streams = {1: bytearray(), 2: bytearray()}
    buf = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return streams[1], streams[2], False
        raw_sock.settimeout(remaining)
        try:
            data = reader.read1(65536) if hasattr(reader, "read1") else reader.recv(65536)
        except TimeoutError:
            return streams[1], streams[2], False
        if not data:
            return streams[1], streams[2], True
        buf += data
        while len(buf) >= 8:
            size = int.from_bytes(buf[4:8], "big")
            if len(buf) < 8 + size:
                break
            streams.setdefault(buf[0], bytearray()).extend(buf[8 : 8 + size])
            del buf[: 8 + size]
        if len(streams[1]) > max_bytes:
            return streams[1], streams[2], True


def _close_stream(sock) -> None:
    for closeable in (sock, getattr(sock, "_response", None)):
        try:
            if closeable is not None:
                closeable.close()
        except Exception:
            pass
