"""One Docker container per episode, with persistent shell sessions and binary-safe files.

How a sandbox is confined is in ``spec.py``; how sessions work, and why, in ``shell.py``. Files: ``put_file`` and
``get_file`` stream a tar archive / the raw bytes through an exec run as the given user. That works on every mount
(Docker's archive API does not reach tmpfs mounts of a read-only container) and keeps the user's permissions: the
policy's ``write_file`` cannot write where its shell could not, nor its ``read_file`` read what its shell could not.
"""

from __future__ import annotations

import io
import posixpath
import re
import tarfile
import threading
import time
import uuid

import docker
import docker.errors
import requests

from sandforge.environments.sandbox import replies
from sandforge.environments.sandbox.clean_context import one_off_environment
from sandforge.environments.sandbox.daemon import docker_client, force_remove
from sandforge.environments.sandbox.labels import (
    DRIVER_LABELS,
    LABEL_CREATED,
    LABEL_EPISODE,
    LABEL_RUN,
    driver_labels,
)
from sandforge.environments.sandbox.seed import workdir_archive
from sandforge.environments.sandbox.shell import (
    KILL_AFTER,
    Request,
    Response,
    ShellLost,
    Stream,
    dispatcher_exec_args,
    read_ready,
    read_response,
)
from sandforge.environments.sandbox.spec import (  # noqa: F401 - SandboxError, SandboxSpec, ROOT_CAPS: public here too
    ROOT_CAPS,
    SandboxError,
    SandboxSpec,
    container_options,
)
from sandforge.types import ExecResult

CLIENT_GRACE = 10.0  # extra seconds the client waits beyond the in-container timeout before giving up
FILE_TIMEOUT = 60.0  # put_file / get_file / read_file / write_file
MAX_READ_BYTES = 64 << 20  # read_file



class Sandbox:
    """A running container that belongs to one episode. Create with ``Sandbox.create``; always ``close()``.

    It is the Docker implementation of ``sandforge.types.Sandbox``, the protocol verifiers act through.

    ``reuse_shell=False`` makes every command a fresh ``docker exec`` (the plain reference path; same results).
    """

    def __init__(self, container, spec: SandboxSpec, run_id: str, client: docker.DockerClient):
        self._container = container
        self._client = client
        self.id: str = container.id
        self.name: str = container.name
        self.run_id = run_id
        self.spec = spec
        self.reuse_shell = True
        self._shells: dict[str, _Shell] = {}  # user -> its live dispatcher
        self._shells_lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(
        cls,
        spec: SandboxSpec,
        run_id: str,
        client: docker.DockerClient | None = None,
        labels: dict[str, str] | None = None,
    ) -> Sandbox:
        """Start a container for one episode, labelled with the run, a new episode id, the time and ``labels``.

        Without ``labels`` the container names this process as its driver, so the reaper leaves it alone while this
        process lives (a driver passes its own ``driver_labels`` to workers in other processes).
        """
        if labels is None:
            labels = driver_labels(run_id)
        client = client or docker_client()
        episode = uuid.uuid4().hex
        name = f"sandforge-{re.sub(r'[^a-zA-Z0-9_.-]', '-', run_id)[:40]}-{episode[:12]}"
        ours = {LABEL_RUN: run_id, LABEL_EPISODE: episode, LABEL_CREATED: str(int(time.time()))}
        all_labels = {**(labels or {}), **ours}
        try:
            options = container_options(client, spec, ours)
            # create + start, not run: run would try to pull a missing image from a registry
            container = client.containers.create(spec.image, name=name, labels=all_labels, **options)
            container.start()
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"sandbox image {spec.image} is not present: run `sandforge images build`") from e
        except (docker.errors.DockerException, requests.RequestException) as e:
            force_remove(client, name)  # created but failed to start (bad runtime, limits the host refuses)
            raise SandboxError(f"could not start a sandbox from {spec.image}: {e}") from e
        sandbox = cls(container, spec, run_id, client)
        if spec.workspace_from_image and spec.workspace_size is not None:
            try:  # the capped tmpfs starts with what the image has there (seed.py)
                sandbox._unpack(workdir_archive(client, spec.image, spec.workdir, spec.workspace_size, ours),
                                posixpath.dirname(spec.workdir.rstrip("/")) or "/")
            except (SandboxError, OSError) as e:
                sandbox.close()
                raise SandboxError(f"could not fill the workspace of a sandbox from {spec.image}: {e}") from e
        return sandbox

    def fresh(self) -> Sandbox:
        """A new sandbox from this one's image and spec, with none of its state, owned like it (its run and driver
        labels, so a crash leaves nothing the run's reaper would not remove): graders that must not trust what the
        policy left run there. The caller closes it."""
        try:
            labels = self._client.api.inspect_container(self.id)["Config"]["Labels"] or {}
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self._broken(e) from e
        owner = {k: v for k, v in labels.items() if k in DRIVER_LABELS or k == LABEL_RUN}
        return type(self).create(self.spec, self.run_id, client=self._client, labels=owner)

    @property
    def workdir(self) -> str:
        """The spec's working directory: where relative paths and one-off commands start."""
        return self.spec.workdir

    # --- commands -------------------------------------------------------------------------------------------------

    def exec(
        self,
        command: str,
        timeout: float = 10.0,
        user: str | None = None,
        workdir: str | None = None,
        session: bool = True,
    ) -> ExecResult:
        """Run ``command`` with bash as ``user`` (default spec.user); returns its merged, capped output and exit code.

        With ``session`` (the default) the command runs in ``user``'s persistent session: it starts in the directory
        and with the variables, functions and aliases the previous command left, and background jobs keep running.
        ``session=False`` is a one-off fresh shell in ``workdir`` (default spec.workdir) that neither sees nor changes
        the session (verifiers use it). ``workdir`` given with a session acts as a ``cd`` before the command.

        After ``timeout`` seconds the command's whole process group is killed inside the container (TERM, then KILL
        KILL_AFTER seconds later) and the result has ``timed_out=True``; the session keeps its state. Raises
        SandboxError if the container is dead or unreachable, ValueError for a NUL byte in the command.
        """
        if "\0" in command:
            raise ValueError("command contains a NUL byte")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if workdir is not None and ("\n" in workdir or "\0" in workdir or not workdir):
            raise ValueError(f"invalid workdir {workdir!r}")
        limit = max(2, self.spec.max_output_bytes)
        request = Request(command.encode(), timeout, limit // 2, limit - limit // 2, workdir or "", keep=session)
        user = user or self.spec.user
        start = time.monotonic()
        deadline = start + timeout + KILL_AFTER + CLIENT_GRACE
        if session and self.reuse_shell:
            response, note = self._session_call(user, request, deadline)
        else:
            response, note = self._one_off(user, request, deadline, workdir or self.spec.workdir)
        return replies.exec_result(response, note, time.monotonic() - start)

    def stop_policy(self) -> int:
        """Kill every process the policy's user left running and confirm none remains (graders call it before any
        check: environments/sandbox/policy_stop.py); how many there were."""
        from sandforge.environments.sandbox.policy_stop import stop_policy

        killed = stop_policy(self)
        with self._shells_lock:  # its dispatcher went too: the next command as that user starts a fresh one
            shell = self._shells.pop(self.spec.user, None)
        if shell is not None:
            shell.stream.close()
        return killed

    def signal_guard(self) -> None:
        """Ask the sandbox's main process to stop the policy's processes itself (policy_stop.py: when no exec can
        start because the policy holds every pid)."""
        try:
            self._container.kill(signal="SIGUSR1")
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self._broken(e) from e

    def start_session(self, user: str | None = None) -> None:
        """Start ``user``'s session shell now (one docker exec), so that the first ``exec`` costs no more than the
        rest; a pool can call it on sandboxes it keeps warm. ``exec`` starts it on first use otherwise."""
        self._shell(user or self.spec.user, time.monotonic() + 30)

    def _session_call(self, user: str, request: Request, deadline: float) -> tuple[Response, str]:
        for attempt in range(2):
            shell = self._shell(user, deadline)
            with shell.lock:
                try:
                    try:
                        shell.stream.send(request.encode(), deadline)
                    except OSError as e:
                        raise ShellLost(f"cannot send to the sandbox shell: {e}", sent=False) from e
                    return read_response(shell.stream, request, deadline), shell.take_stderr()
                except (ShellLost, OSError) as e:
                    lost = e if isinstance(e, ShellLost) else ShellLost(str(e), sent=True)
                    stderr = shell.take_stderr()
                    self._drop_shell(user, shell)
            if not self.alive():
                raise self._broken(lost)
            if lost.sent or attempt == 1:
                return replies.lost_reply(lost), stderr
        raise AssertionError("unreachable")

    def _one_off(self, user: str, request: Request, deadline: float, workdir: str) -> tuple[Response, str]:
        argv, environment = dispatcher_exec_args(user)
        environment = {**environment, **one_off_environment(user)}  # root: nothing the policy wrote runs (see module)
        stream = self._start_exec(argv, user, workdir, environment, stdin=True)
        try:
            stream.send(request.encode(), deadline)
            stream.close_stdin()
            read_ready(stream, deadline)
            response = read_response(stream, request, deadline)
            return response, replies.text(stream.err)
        except (ShellLost, OSError) as e:
            if not self.alive():
                raise self._broken(e) from e
            lost = e if isinstance(e, ShellLost) else ShellLost(str(e), sent=True)
            return replies.lost_reply(lost), replies.text(stream.err)
        finally:
            stream.close()

    def _shell(self, user: str, deadline: float) -> _Shell:
        with self._shells_lock:
            shell = self._shells.get(user)
            if shell is None:
                if self._closed:
                    raise SandboxError(f"sandbox {self.name} is closed")
                argv, environment = dispatcher_exec_args(user)
                stream = self._start_exec(argv, user, self.spec.workdir, environment, stdin=True)
                try:
                    read_ready(stream, min(deadline, time.monotonic() + 30))
                except (ShellLost, OSError) as e:
                    stream.close()
                    raise self._broken(e) from e
                shell = self._shells[user] = _Shell(stream)
            return shell

    def _drop_shell(self, user: str, shell: _Shell) -> None:
        with self._shells_lock:
            if self._shells.get(user) is shell:
                del self._shells[user]
        shell.stream.close()  # the dispatcher reads EOF and exits once its current command is over

    def _start_exec(
        self, argv: list[str], user: str, workdir: str, environment: dict[str, str] | None, stdin: bool
    ) -> Stream:
        api = self._client.api
        try:
            exec_id = api.exec_create(
                self.id, argv, stdin=stdin, user=user, workdir=workdir, environment=environment
            )["Id"]
            return Stream(api.exec_start(exec_id, socket=True))
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self._broken(e) from e

    # --- files ----------------------------------------------------------------------------------------------------

    def _unpack(self, archive: bytes, parent: str) -> None:
        """Unpack a tar ``archive`` into ``parent`` as root, keeping its owners and modes (seed.py)."""
        if not archive:
            return
        deadline = time.monotonic() + FILE_TIMEOUT + CLIENT_GRACE
        argv = replies.bounded(FILE_TIMEOUT) + ["bash", "-c", 'tar -x -f - -C "$1" -p; printf \'\\0SFRC %d\\n\' "$?"',
                                         "sandforge-unpack", parent]
        stream = self._start_exec(argv, "root", "/", None, stdin=True)
        try:
            try:
                stream.send(archive, deadline)
                stream.close_stdin()
            except OSError:
                pass  # tar stopped reading: its message says why
            finished = stream.read_to_eof(deadline, max_bytes=1 << 16)
        finally:
            stream.close()
        if replies.exit_code(stream.out) != 0 or not finished:
            raise OSError(f"tar into {parent}: {replies.text(stream.err)[-300:] or 'timed out'}")

    def put_file(self, path: str, data: bytes, user: str | None = None, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` as ``user`` (default spec.user, who then owns it), creating parent folders.

        Any size, any bytes: a tar archive streams into ``tar -x`` run by that user, so the user's permissions apply.
        Relative paths are under the spec's workdir. Raises OSError if the user may not write there.
        """
        target = self._abspath(path)
        member = tarfile.TarInfo(target.lstrip("/"))
        member.size, member.mode, member.mtime = len(data), mode, int(time.time())
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w", format=tarfile.GNU_FORMAT) as tar:
            tar.addfile(member, io.BytesIO(data))
        deadline = time.monotonic() + FILE_TIMEOUT + CLIENT_GRACE
        argv = replies.bounded(FILE_TIMEOUT) + ["bash", "-c", replies.PUT_SCRIPT]
        stream = self._start_exec(argv, user or self.spec.user, "/", None, stdin=True)
        try:
            try:
                stream.send(archive.getvalue(), deadline)
                stream.close_stdin()
            except OSError:
                pass  # tar stopped reading (it failed early): its message says why
            finished = stream.read_to_eof(deadline, max_bytes=1 << 16)
        except OSError as e:
            raise self._broken(e) from e
        finally:
            stream.close()
        code = replies.exit_code(stream.out)
        if code != 0 or not finished:
            if not self.alive():
                raise self._broken(OSError(f"cannot write {path}"))
            reason = replies.text(stream.err).replace(f"tar: {member.name}: ", "").splitlines()
            raise OSError(f"cannot write {path}: {replies.failure_reason(code, reason, finished)}")

    def get_file(self, path: str, user: str | None = None, max_bytes: int | None = None) -> bytes | None:
        """The bytes of the file at ``path`` read as ``user`` (default spec.user), or None if it does not exist.

        Relative paths are under the spec's workdir. Raises OSError if it cannot be read (permissions, a directory,
        more than ``max_bytes``).
        """
        replies.check_path(path)
        argv = replies.bounded(FILE_TIMEOUT) + ["bash", "-c", replies.GET_SCRIPT, "sandforge-get", path]
        stream = self._start_exec(argv, user or self.spec.user, self.spec.workdir, None, stdin=False)
        try:
            finished = stream.read_to_eof(time.monotonic() + FILE_TIMEOUT + CLIENT_GRACE, max_bytes)
        except OSError as e:
            raise self._broken(e) from e
        finally:
            stream.close()
        if max_bytes is not None and len(stream.out) > max_bytes:
            raise OSError(f"cannot read {path}: larger than {max_bytes} bytes")
        code = replies.exit_code(stream.err)
        if code == 3 and finished:
            return None
        if code != 0 or not finished:
            if not self.alive():
                raise self._broken(OSError(f"cannot read {path}"))
            reason = replies.RC.sub(b"", stream.err).decode(errors="replace").strip().splitlines()
            raise OSError(f"cannot read {path}: {replies.failure_reason(code, reason, finished)}")
        return bytes(stream.out)

    def write_file(self, path: str, content: str, user: str | None = None) -> None:
        """Write ``content`` (UTF-8) to ``path``, creating parent folders, with ``user``'s permissions.

        Relative paths are under the spec's workdir. Raises OSError if the user may not write there.
        """
        self.put_file(path, content.encode(), user=user)

    def read_file(self, path: str, user: str | None = None) -> str | None:
        """The file's text (UTF-8, undecodable bytes replaced), or None if it does not exist.

        Raises OSError if it cannot be read (permissions, a directory, larger than MAX_READ_BYTES).
        """
        data = self.get_file(path, user=user, max_bytes=MAX_READ_BYTES)
        return None if data is None else data.decode(errors="replace")

    def _abspath(self, path: str) -> str:
        replies.check_path(path)
        target = posixpath.normpath(posixpath.join(self.spec.workdir, path))
        if target.startswith("//"):
            target = target[1:]
        if target == "/" or path.endswith("/"):
            raise ValueError(f"not a file path: {path!r}")
        return target

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
        """Remove the container and its workspace volume (force). Idempotent; never raises."""
        if not self._closed:
            self._closed = True
            with self._shells_lock:
                shells, self._shells = list(self._shells.values()), {}
            for shell in shells:
                shell.stream.close()
            force_remove(self._client, self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.name}, image={self.spec.image})"


class _Shell:
    """One user's dispatcher in one sandbox: its exec stream, and a lock so requests go one at a time."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.lock = threading.Lock()

    def take_stderr(self) -> str:
        """The dispatcher's complaints since the last command: a capped head and tail, and what was dropped, last
        (``Stream.err``; ``_result`` keeps the note's end)."""
        return replies.text(self.stream.take_err())
