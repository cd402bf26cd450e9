"""What a sandbox's exec streams come back as: a command's ``ExecResult`` from the dispatcher's ``Response`` (with
the notes the policy should see), and the exit codes and reasons of the file transfers' small scripts."""

from __future__ import annotations

import re

from sandforge.environments.sandbox.shell import KILL_AFTER, Response, ShellLost
from sandforge.environments.sandbox.spec import SPOOL_SIZE, parse_size
from sandforge.types import ExecResult

# $1 path. Exit code on stderr's last line, so no exec_inspect round trip is needed; 3 means "no such file".
GET_SCRIPT = r"""[ -e "$1" ] || { printf '\0SFRC 3\n' >&2; exit 3; }; cat -- "$1"; printf '\0SFRC %d\n' "$?" >&2"""
# A one-member tar archive on stdin; -p keeps its mode exactly, -m stamps the current time, and the file is owned by
# whoever runs this. -U: an existing file (or symlink) at the path is unlinked and replaced, never written through.
PUT_SCRIPT = r"""tar -x -f - -C / -p -m -U --no-same-owner; printf '\0SFRC %d\n' "$?" """
RC = re.compile(rb"\0SFRC (\d+)\n")


def exec_result(response: Response, note: str, seconds: float) -> ExecResult:
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


def lost_reply(lost: ShellLost) -> Response:
    """What a command whose answer never came reports: a timeout, or the shell killed under it."""
    if lost.timed_out:
        return Response(124, b"[timed out]", True, False, 0, 0)
    return Response(137, b"[the shell was killed during this command; its session continues]", False, False, 0, 0)


def text(data: bytes | bytearray) -> str:
    return bytes(data).decode(errors="replace").strip()


def exit_code(data: bytes | bytearray) -> int | None:
    found = RC.findall(bytes(data))
    return int(found[-1]) if found else None


def bounded(seconds: float) -> list[str]:
    return ["timeout", f"--kill-after={KILL_AFTER:g}", f"{seconds:g}"]


def check_path(path: str) -> None:
    if not path or "\0" in path:
        raise ValueError(f"invalid path {path!r}")


def failure_reason(code: int | None, lines: list[str], finished: bool) -> str:
    if not finished or code in (124, 137):
        return "timed out"
    lines = [line for line in lines if line and not line.startswith("tar: Exiting")]
    return "; ".join(lines) or f"exit code {code}"
