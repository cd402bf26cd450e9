"""One Docker container per episode, and the commands run in it: persistent shell sessions and one-off shells.

How a sandbox is confined is in ``spec.py``; how sessions work, and why, in ``shell.py``; how files go in and out, in
``file_transfer.py``. A command's answer from the dispatcher becomes the ``ExecResult`` the policy sees here.
"""

from __future__ import annotations

import os
import posixpath
import re
import threading
import time
import uuid
from dataclasses import replace

import docker
import docker.errors
import requests

from sandforge.sandbox import file_transfer, proxy_folders
from sandforge.sandbox.clean_context import one_off_environment
from sandforge.sandbox.daemon import docker_client, force_remove
from sandforge.sandbox.labels import (
    DRIVER_LABELS,
    LABEL_CREATED,
    LABEL_EPISODE,
    LABEL_RUN,
    driver_labels,
)
from sandforge.sandbox.workspace import workdir_archive
from sandforge.sandbox.shell import (
    CLIENT_GRACE,
    KILL_AFTER,
    Request,
    Response,
    ShellLost,
    Stream,
    dispatcher_exec_args,
    read_ready,
    read_response,
)
from sandforge.sandbox.spec import (  # noqa: F401 - SandboxSpec, ROOT_CAPS: public here too
    PROXY_ROOT,
    ROOT_CAPS,
    SPOOL_SIZE,
    SandboxSpec,
    container_options,
    parse_size,
)
from sandforge.types import ExecResult, PolicyStop, SandboxError


class DockerSandbox:
    """A running container that belongs to one episode. Create with ``DockerSandbox.create``; always ``close()``.

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
        self.proxy_dir: str | None = None  # host folder of the agent harness's proxy socket (spec.proxy)

    @classmethod
    def create(
        cls,
        spec: SandboxSpec,
        run_id: str,
        client: docker.DockerClient | None = None,
        labels: dict[str, str] | None = None,
    ) -> DockerSandbox:
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
            proxy_dir = proxy_folders.make(episode) if spec.proxy else None
        except OSError as e:
            raise SandboxError(f"could not make the sandbox's proxy folder under {PROXY_ROOT} (the rollout worker "
                               f"needs root there, on the Docker host): {e}") from e
        try:
            options = container_options(client, spec, ours, proxy_dir)
            # create + start, not run: run would try to pull a missing image from a registry
            container = client.containers.create(spec.image, name=name, labels=all_labels, **options)
            container.start()
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"sandbox image {spec.image} is not present: run `sandforge images build`") from e
        except (docker.errors.DockerException, requests.RequestException) as e:
            force_remove(client, name)  # created but failed to start (bad runtime, limits the host refuses)
            proxy_folders.remove(episode if proxy_dir else None)
            raise SandboxError(f"could not start a sandbox from {spec.image}: {e}") from e
        sandbox = cls(container, spec, run_id, client)
        sandbox.proxy_dir = proxy_dir
        if spec.workspace_from_image and spec.workspace_size is not None:
            try:  # the capped tmpfs starts with what the image has there (workspace.py)
                file_transfer.unpack(sandbox,
                                     workdir_archive(client, spec.image, spec.workdir, spec.workspace_size, ours),
                                     posixpath.dirname(spec.workdir.rstrip("/")) or "/")
            except (SandboxError, OSError) as e:
                sandbox.close()
                raise SandboxError(f"could not fill the workspace of a sandbox from {spec.image}: {e}") from e
        return sandbox

    def fresh(self) -> DockerSandbox:
        """A new sandbox from this one's image and spec, with none of its state, owned like it (its run and driver
        labels, so a crash leaves nothing the run's reaper would not remove): graders that must not trust what the
        policy left run there. The caller closes it."""
        return type(self).create(replace(self.spec, proxy=False), self.run_id, client=self._client,
                                 labels=self._owner())

    def _owner(self) -> dict[str, str]:
        """This sandbox's run and driver labels, which a sandbox started for its graders carries too."""
        try:
            labels = self._client.api.inspect_container(self.id)["Config"]["Labels"] or {}
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self.broken(e) from e
        return {k: v for k, v in labels.items() if k in DRIVER_LABELS or k == LABEL_RUN}

    def grading_sandbox(self) -> DockerSandbox:
        """A new sandbox for a separate grader (``spec.grading``: the task's grading image, started like ``fresh``
        with none of this one's state), owned like this one. The caller closes it. SandboxError where the task has
        no grading image."""
        if self.spec.grading is None:
            raise SandboxError("this sandbox's task has no grading image (Task.grading_image)")
        return type(self).create(self.spec.grading, self.run_id, client=self._client, labels=self._owner())

    def get_tree(self, path: str, exclude: tuple[str, ...] = (), max_bytes: int = 64 << 20,
                 timeout: float = file_transfer.FILE_TIMEOUT) -> bytes | None:
        """A tar archive of ``path`` and all under it, read as root (links kept as links), less ``exclude``; None if
        nothing is there. Past ``max_bytes``, more than ``max_bytes`` comes back cut short."""
        return file_transfer.get_tree(self, path, exclude, max_bytes, timeout)

    def put_tree(self, archive: bytes, timeout: float = file_transfer.FILE_TIMEOUT) -> None:
        """Extract a tar ``archive`` (names relative to /) as root, replacing what is at its paths, never writing
        through an existing link."""
        file_transfer.put_tree(self, archive, timeout)

    @property
    def workdir(self) -> str:
        """The spec's working directory: where relative paths and one-off commands start."""
        return self.spec.workdir

    @property
    def policy_user(self) -> str:
        """The user the policy's commands run as (the spec's: a name or "uid[:gid]"), as the host configured it."""
        return self.spec.user

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
        return _exec_result(response, note, time.monotonic() - start)

    def stop_policy(self) -> PolicyStop:
        """Kill every process the policy's user left running and confirm none remains (graders call it before any
        check: sandbox/policy_stop.py); how many there were and the ports they listened on."""
        from sandforge.sandbox.policy_stop import stop_policy

        killed = stop_policy(self)
        with self._shells_lock:  # its dispatcher went too: the next command as that user starts a fresh one
            shell = self._shells.pop(self.spec.user, None)
        if shell is not None:
            shell.stream.close()
        return killed

    def kill_all_as(self, user: str, timeout: float = 10.0) -> bool:
        """As ``user``, in a plain ``docker exec`` (no dispatcher, whose process ``user`` would own), SIGSTOP then SIGKILL
        every process ``user`` may signal until none is left (policy_stop.py's first pass: the kernel's selection).
        Detached and waited for at most ``timeout`` seconds: whether it ended. One that cannot start (the policy holds
        every pid) or does not end (it is ``user``'s, so the scan that follows kills it) leaves the rest to the scan."""
        from sandforge.sandbox.stop_scripts import KILL_ALL

        api = self._container.client.api
        try:
            job = api.exec_create(self._container.id, ["bash", "-c", KILL_ALL], user=user, workdir="/",
                                  stdout=False, stderr=False)
            api.exec_start(job["Id"], detach=True)
            deadline = time.monotonic() + timeout
            while api.exec_inspect(job["Id"]).get("Running"):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        except docker.errors.APIError:  # no process could start: the guard and the scan do it
            return False
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self.broken(e) from e
        return True

    def signal_guard(self) -> None:
        """Ask the sandbox's main process to stop the policy's processes itself (policy_stop.py: when no exec can
        start because the policy holds every pid)."""
        try:
            self._container.kill(signal="SIGUSR1")
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self.broken(e) from e

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
                raise self.broken(lost)
            if lost.sent or attempt == 1:
                return _lost_reply(lost), stderr
        raise AssertionError("unreachable")

    def _one_off(self, user: str, request: Request, deadline: float, workdir: str) -> tuple[Response, str]:
        argv, environment = dispatcher_exec_args(user)
        environment = {**environment, **one_off_environment(user)}  # root: nothing the policy wrote runs (see module)
        stream = self.start_exec(argv, user, workdir, environment, stdin=True)
        try:
            stream.send(request.encode(), deadline)
            stream.close_stdin()
            read_ready(stream, deadline)
            response = read_response(stream, request, deadline)
            return response, _text(stream.err)
        except (ShellLost, OSError) as e:
            if not self.alive():
                raise self.broken(e) from e
            lost = e if isinstance(e, ShellLost) else ShellLost(str(e), sent=True)
            return _lost_reply(lost), _text(stream.err)
        finally:
            stream.close()

    def _shell(self, user: str, deadline: float) -> _Shell:
        with self._shells_lock:
            shell = self._shells.get(user)
            if shell is None:
                if self._closed:
                    raise SandboxError(f"sandbox {self.name} is closed")
                argv, environment = dispatcher_exec_args(user)
                stream = self.start_exec(argv, user, self.spec.workdir, environment, stdin=True)
                try:
                    read_ready(stream, min(deadline, time.monotonic() + 30))
                except (ShellLost, OSError) as e:
                    stream.close()
                    raise self.broken(e) from e
                shell = self._shells[user] = _Shell(stream)
            return shell

    def _drop_shell(self, user: str, shell: _Shell) -> None:
        with self._shells_lock:
            if self._shells.get(user) is shell:
                del self._shells[user]
        shell.stream.close()  # the dispatcher reads EOF and exits once its current command is over

    def start_exec(
        self, argv: list[str], user: str, workdir: str, environment: dict[str, str] | None, stdin: bool
    ) -> Stream:
        """A raw ``docker exec`` of ``argv`` as ``user``, attached (file_transfer.py streams files through one).
        Raises SandboxError if the daemon or the container does not answer."""
        api = self._client.api
        try:
            exec_id = api.exec_create(
                self.id, argv, stdin=stdin, user=user, workdir=workdir, environment=environment
            )["Id"]
            return Stream(api.exec_start(exec_id, socket=True))
        except (docker.errors.DockerException, requests.RequestException) as e:
            raise self.broken(e) from e

    def broken(self, cause: Exception) -> SandboxError:
        """The error that fails the episode when this sandbox stopped answering because of ``cause``: whether it is
        still running, and if not, how it ended (closed here, removed, or its main process's exit as Docker saw it)."""
        state = "running" if self.alive() else f"not running ({self.how_it_ended()})"
        return SandboxError(f"sandbox {self.name} is {state}: {cause}")

    def how_it_ended(self) -> str:
        """A stopped sandbox's end, as far as can be told: closed by sandforge, removed, or Docker's state of it
        (exit code, OOM kill, error, when)."""
        if self._closed:
            return "closed by sandforge"
        try:
            self._container.reload()
        except Exception:  # noqa: BLE001 - a container gone entirely
            return "removed"
        state = self._container.attrs.get("State") or {}
        said = [f"exit code {state.get('ExitCode')}", "OOM-killed" * bool(state.get("OOMKilled")),
                f"error {state.get('Error')!r}" * bool(state.get("Error")), f"at {state.get('FinishedAt', '?')}"]
        return f"{state.get('Status', 'exited')}: " + ", ".join(x for x in said if x)

    # --- files (file_transfer.py) ----------------------------------------------------------------------------------

    def put_file(self, path: str, data: bytes, user: str | None = None, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` as ``user`` (default spec.user, who then owns it), creating parent folders.
        Relative paths are under the spec's workdir. Raises OSError if the user may not write there."""
        file_transfer.put_file(self, path, data, user=user, mode=mode)

    def get_file(self, path: str, user: str | None = None, max_bytes: int | None = None) -> bytes | None:
        """The bytes of the file at ``path`` read as ``user`` (default spec.user), or None if it does not exist.
        Raises OSError if it cannot be read (permissions, a directory, more than ``max_bytes``)."""
        return file_transfer.get_file(self, path, user=user, max_bytes=max_bytes)

    def write_file(self, path: str, content: str, user: str | None = None) -> None:
        """Write ``content`` (UTF-8) to ``path``, creating parent folders, with ``user``'s permissions.

        Relative paths are under the spec's workdir. Raises OSError if the user may not write there.
        """
        self.put_file(path, content.encode(), user=user)

    def read_file(self, path: str, user: str | None = None) -> str | None:
        """The file's text (UTF-8, undecodable bytes replaced), or None if it does not exist.

        Raises OSError if it cannot be read (permissions, a directory, larger than MAX_READ_BYTES).
        """
        data = self.get_file(path, user=user, max_bytes=file_transfer.MAX_READ_BYTES)
        return None if data is None else data.decode(errors="replace")

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
            if self.proxy_dir:
                proxy_folders.remove(os.path.basename(self.proxy_dir))

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DockerSandbox({self.name}, image={self.spec.image})"


class _Shell:
    """One user's dispatcher in one sandbox: its exec stream, and a lock so requests go one at a time."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.lock = threading.Lock()

    def take_stderr(self) -> str:
        """The dispatcher's complaints since the last command: a capped head and tail, and what was dropped, last
        (``Stream.err``; ``_exec_result`` keeps the note's end)."""
        return _text(self.stream.take_err())


def _exec_result(response: Response, note: str, seconds: float) -> ExecResult:
    """The policy's view of a command's answer: its output with the notes it should see (what was cut, the spool
    full, an out-of-memory kill, the session shell's own complaints)."""
    out = response.output
    if response.timed_out and out.endswith(b"Terminated\n"):
        out = out[: -len(b"Terminated\n")]  # bash reporting the foreground job our TERM ended: `timed_out` says it
    if response.dropped > 0:
        cut = response.head_len
        out = out[:cut] + f"\n[... truncated {response.dropped} bytes]\n".encode() + out[cut:]
    notes = []
    if len(response.output) + response.dropped >= 0.95 * parse_size(SPOOL_SIZE):
        notes.append(f"[output spool full: past {SPOOL_SIZE} lost]")
    if response.oom_killed:
        notes.append("[killed: the sandbox ran out of memory]")
    if note:  # the session shell's own complaints, e.g. that it cannot fork
        notes.append(note if len(note) <= 1000 else "..." + note[-1000:])
    text = out.decode(errors="replace")
    if notes:
        text += ("" if not text or text.endswith("\n") else "\n") + "\n".join(notes)
    return ExecResult(response.exit_code, text, response.timed_out, seconds, response.oom_killed)


def _lost_reply(lost: ShellLost) -> Response:
    """What a command whose answer never came reports: a timeout, or the shell killed under it."""
    if lost.timed_out:
        return Response(124, b"[timed out]", True, False, 0, 0)
    return Response(137, b"[the shell was killed during this command; its session continues]", False, False, 0, 0)


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode(errors="replace").strip()
