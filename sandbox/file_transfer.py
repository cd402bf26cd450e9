"""Files in and out of a sandbox, binary-safe, with the permissions of the user who asks.

``put_file`` streams a one-member tar archive into ``tar -x`` and ``get_file`` streams the raw bytes out of ``cat``,
each an exec run as the given user (``DockerSandbox.start_exec``). That works on every mount (Docker's archive API does
not reach tmpfs mounts of a read-only container) and keeps the user's permissions: the policy's ``write_file`` cannot
write where its shell could not, nor its ``read_file`` read what its shell could not. Each transfer's small script
reports its exit code in-band (``\\0SFRC <code>``), so no exec_inspect round trip is needed.
"""

from __future__ import annotations

import io
import posixpath
import re
import tarfile
import time

from sandforge.sandbox.shell import CLIENT_GRACE, KILL_AFTER

FILE_TIMEOUT = 60.0  # put_file / get_file / read_file / write_file
MAX_READ_BYTES = 64 << 20  # read_file

# $1 path. Exit code on stderr's last line; 3 means "no such file".
GET_SCRIPT = r"""[ -e "$1" ] || { printf '\0SFRC 3\n' >&2; exit 3; }; cat -- "$1"; printf '\0SFRC %d\n' "$?" >&2"""
# A one-member tar archive on stdin; -p keeps its mode exactly, -m stamps the current time, and the file is owned by
# whoever runs this. -U: an existing file (or symlink) at the path is unlinked and replaced, never written through.
PUT_SCRIPT = r"""tar -x -f - -C / -p -m -U --no-same-owner; printf '\0SFRC %d\n' "$?" """
RC = re.compile(rb"\0SFRC (\d+)\n")


def put_file(sandbox, path: str, data: bytes, user: str | None = None, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` as ``user`` (default spec.user, who then owns it), creating parent folders.

    Any size, any bytes: a tar archive streams into ``tar -x`` run by that user, so the user's permissions apply.
    Relative paths are under the spec's workdir. Raises OSError if the user may not write there.
    """
    target = _abspath(path, sandbox.spec.workdir)
    member = tarfile.TarInfo(target.lstrip("/"))
    member.size, member.mode, member.mtime = len(data), mode, int(time.time())
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(member, io.BytesIO(data))
    deadline = time.monotonic() + FILE_TIMEOUT + CLIENT_GRACE
    argv = _bounded(FILE_TIMEOUT) + ["bash", "-c", PUT_SCRIPT]
    stream = sandbox.start_exec(argv, user or sandbox.spec.user, "/", None, stdin=True)
    try:
        try:
            stream.send(archive.getvalue(), deadline)
            stream.close_stdin()
        except OSError:
            pass  # tar stopped reading (it failed early): its message says why
        finished = stream.read_to_eof(deadline, max_bytes=1 << 16)
    except OSError as e:
        raise sandbox.broken(e) from e
    finally:
        stream.close()
    code = _exit_code(stream.out)
    if code != 0 or not finished:
        if not sandbox.alive():
            raise sandbox.broken(OSError(f"cannot write {path}"))
        reason = stream.err.decode(errors="replace").strip().replace(f"tar: {member.name}: ", "").splitlines()
        raise OSError(f"cannot write {path}: {_failure_reason(code, reason, finished)}")


def get_file(sandbox, path: str, user: str | None = None, max_bytes: int | None = None) -> bytes | None:
    """The bytes of the file at ``path`` read as ``user`` (default spec.user), or None if it does not exist.

    Relative paths are under the spec's workdir. Raises OSError if it cannot be read (permissions, a directory,
    more than ``max_bytes``).
    """
    _check_path(path)
    argv = _bounded(FILE_TIMEOUT) + ["bash", "-c", GET_SCRIPT, "sandforge-get", path]
    stream = sandbox.start_exec(argv, user or sandbox.spec.user, sandbox.spec.workdir, None, stdin=False)
    try:
        finished = stream.read_to_eof(time.monotonic() + FILE_TIMEOUT + CLIENT_GRACE, max_bytes)
    except OSError as e:
        raise sandbox.broken(e) from e
    finally:
        stream.close()
    if max_bytes is not None and len(stream.out) > max_bytes:
        raise OSError(f"cannot read {path}: larger than {max_bytes} bytes")
    code = _exit_code(stream.err)
    if code == 3 and finished:
        return None
    if code != 0 or not finished:
        if not sandbox.alive():
            raise sandbox.broken(OSError(f"cannot read {path}"))
        reason = RC.sub(b"", stream.err).decode(errors="replace").strip().splitlines()
        raise OSError(f"cannot read {path}: {_failure_reason(code, reason, finished)}")
    return bytes(stream.out)


# $1 the path (absolute, without its leading /), then --exclude=PATTERN words. Exit 3: no such path. --numeric-owner:
# owners as numbers; links are archived as links, never followed.
TREE_SCRIPT = r"""p="$1"; shift; [ -e "/$p" ] || [ -L "/$p" ] || { printf '\0SFRC 3\n' >&2; exit 3; }
tar -c -f - -C / --numeric-owner "$@" -- "$p"; printf '\0SFRC %d\n' "$?" >&2"""


def get_tree(sandbox, path: str, exclude: tuple[str, ...] = (), max_bytes: int = 64 << 20,
             timeout: float = FILE_TIMEOUT) -> bytes | None:
    """A tar archive of ``path`` (absolute: a file or a folder and everything in it, links as links) read as root,
    less the members matching ``exclude`` (tar's ``--exclude`` patterns); None if nothing is there. Member names are
    relative to ``/``. Past ``max_bytes`` the bytes read so far come back (more than ``max_bytes``: the caller
    decides); OSError when tar fails."""
    _check_path(path)
    if not path.startswith("/"):
        raise ValueError(f"not an absolute path: {path!r}")
    argv = _bounded(timeout) + ["bash", "-c", TREE_SCRIPT, "sandforge-tree", path.lstrip("/") or ".",
                                *(f"--exclude={pattern}" for pattern in exclude)]
    stream = sandbox.start_exec(argv, "root", "/", None, stdin=False)
    try:
        finished = stream.read_to_eof(time.monotonic() + timeout + CLIENT_GRACE, max_bytes)
    except OSError as e:
        raise sandbox.broken(e) from e
    finally:
        stream.close()
    if len(stream.out) > max_bytes:  # cut short: the caller sees more than it allowed and decides
        return bytes(stream.out)
    code = _exit_code(stream.err)
    if code == 3 and finished:
        return None
    if code not in (0, 1) or not finished:  # 1: a file changed as tar read it, the archive is whole
        reason = RC.sub(b"", stream.err).decode(errors="replace").strip().splitlines()
        raise OSError(f"cannot take {path}: {_failure_reason(code, reason, finished)}")
    return bytes(stream.out)


def put_tree(sandbox, archive: bytes, timeout: float = FILE_TIMEOUT) -> None:
    """Extract a tar ``archive`` (member names relative to ``/``; ``trees.confine``'s) as root, keeping its numeric
    owners and modes. An existing file or link at a member's path is replaced, never written through, and a link
    where the archive has a folder becomes that folder (GNU tar's defaults: no ``--overwrite``, no
    ``--keep-directory-symlink``)."""
    _untar(sandbox, archive, "/", ["--numeric-owner"], timeout, broken=True)


def unpack(sandbox, archive: bytes, parent: str) -> None:
    """Unpack a tar ``archive`` into ``parent`` as root, keeping its owners and modes (workspace.py)."""
    _untar(sandbox, archive, parent, [], FILE_TIMEOUT, broken=False)


def _untar(sandbox, archive: bytes, parent: str, options: list[str], timeout: float, broken: bool) -> None:
    """``archive`` into ``parent`` by ``tar -x -p`` as root; OSError with tar's message. ``broken``: a stream that
    fails is the sandbox's fault (``sandbox.broken``), as for a grader's transfer."""
    if not archive:
        return
    deadline = time.monotonic() + timeout + CLIENT_GRACE
    script = 'tar -x -f - -C "$1" -p "${@:2}"; printf \'\\0SFRC %d\\n\' "$?"'
    argv = _bounded(timeout) + ["bash", "-c", script, "sandforge-unpack", parent, *options]
    stream = sandbox.start_exec(argv, "root", "/", None, stdin=True)
    try:
        try:
            stream.send(archive, deadline)
            stream.close_stdin()
        except OSError:
            pass  # tar stopped reading: its message says why
        finished = stream.read_to_eof(deadline, max_bytes=1 << 16)
    except OSError as e:
        if broken:
            raise sandbox.broken(e) from e
        raise
    finally:
        stream.close()
    if _exit_code(stream.out) != 0 or not finished:
        raise OSError(f"tar into {parent}: {stream.err.decode(errors='replace').strip()[-300:] or 'timed out'}")


def _abspath(path: str, workdir: str) -> str:
    _check_path(path)
    target = posixpath.normpath(posixpath.join(workdir, path))
    if target.startswith("//"):
        target = target[1:]
    if target == "/" or path.endswith("/"):
        raise ValueError(f"not a file path: {path!r}")
    return target


def _check_path(path: str) -> None:
    if not path or "\0" in path:
        raise ValueError(f"invalid path {path!r}")


def _bounded(seconds: float) -> list[str]:
    return ["timeout", f"--kill-after={KILL_AFTER:g}", f"{seconds:g}"]


def _exit_code(data: bytes | bytearray) -> int | None:
    found = RC.findall(bytes(data))
    return int(found[-1]) if found else None


def _failure_reason(code: int | None, lines: list[str], finished: bool) -> str:
    if not finished or code in (124, 137):
        return "timed out"
    lines = [line for line in lines if line and not line.startswith("tar: Exiting")]
    return "; ".join(lines) or f"exit code {code}"
