"""Persistent shell sessions in a sandbox: cwd, variables, functions and aliases carry over between commands.

Design. The state lives in a file, not in a process: every command runs in a fresh ``bash`` that first sources the
session's saved state (variables from ``declare -p``, functions, aliases, the working directory) and, when it exits,
saves it again (an EXIT trap; a TERM trap too, so a command stopped by its timeout keeps the ``cd`` it made). A fresh
bash per command is what makes the timeout simple and total: ``timeout`` runs it in a new process group and kills that
whole group, and nothing else of the session can be caught in it, because there is no long-lived shell to protect.

Output never travels through a pipe that a background job could hold open: the command writes to a spool file
(``O_APPEND``, on a small tmpfs), and once the command's shell has exited, the head and tail of that file are sent back.
``server &`` therefore returns at once and keeps running; what it prints while a later command runs shows up in that
command's output, as in a terminal (what it prints between commands is dropped, so the spool never fills up).
``jobs``/``wait``/``fg`` do not see jobs of earlier commands (each command is its own shell); ``ps`` and ``kill`` do. Shell options (``set -e``...) are deliberately not carried over.

Transport. A command could be one ``docker exec`` each (the reference path: ``reuse_shell=False``, and what
``exec(session=False)`` always does), but a docker exec costs a runc process start, 30-100 ms on a busy host. So each
sandbox user gets one long-lived *dispatcher*: a small bash loop started once by ``docker exec -i``, which reads
requests on stdin, runs each command as described above, and answers on stdout. It never runs policy code itself, so
whatever a command does, the dispatcher is only ever waiting for ``timeout`` to exit. Both paths run the same
dispatcher script and share the state file, so a dispatcher that dies (the policy may ``kill -9 -1``) is simply
restarted by the next command with the session intact.

Wire format (all on the exec's stdout; the dispatcher's stdout carries nothing else):
  request:  ``<id> <timeout> <timeout_us> <kill_after> <head> <tail> <n> <keep>\\n`` then n bytes: workdir, ``\\n``,
            command (keep=1: a session command, restore and save state)
  response: ``SFR <id> <rc> <timed_out> <oom> <dropped> <head_len>\\n`` <output> ``\\0SFEND <id>\\n``
The output can hold any byte but never the end marker, which carries the request's random id.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass

SESSION_DIR = "/run/sandforge"  # tmpfs, mode 1777: one private (0700) folder per user id, holding state and spool
ROOT_SESSION_DIR = "/run/sandforge-root"  # tmpfs, mode 0700: root's (verifiers'), which the policy cannot fill up
KILL_AFTER = 2.0  # seconds between TERM and KILL when a command outlives its timeout
CLIENT_GRACE = 10.0  # extra seconds the client waits beyond the in-container timeout before giving up
# What the host keeps of an exec stream's bytes that the policy can write without bound (it can reach the dispatcher's
# own stdout and stderr through /proc/<pid>/fd): stderr's head and tail, and stdout past what an answer can hold.
ERR_HEAD, ERR_TAIL, ERR_SLACK = 4096, 16384, 65536
STRAY_OUT = 65536

# Sourced by the command's fresh bash (top level, so restored declarations stay global). $1 this file, $2 the command
# file, $3 workdir ("" keeps the session's), $4 keep. Ends true: the caller runs `. pre && eval "$__sf_c"`.
PRE_SCRIPT = r"""__sf_d=${1%/*} __sf_f=$2 __sf_wd=$3 __sf_keep=$4
builtin set --
if [[ $__sf_keep == 1 ]]; then
  builtin compgen -e > "$__sf_d/env0"; builtin mapfile -t __sf_env0 < "$__sf_d/env0"
  [[ -r $__sf_d/state ]] && builtin . "$__sf_d/state" 2>/dev/null
  __sf_save='builtin set +eu
builtin compgen -v > "$__sf_d/names"; builtin mapfile -t __sf_n < "$__sf_d/names"; __sf_k=() __sf_u=() __sf_x=()
for __sf_v in "${__sf_n[@]}"; do
  case $__sf_v in
    BASH|BASHOPTS|BASHPID|BASH_*|COMP_WORDBREAKS|DIRSTACK|EPOCHREALTIME|EPOCHSECONDS|EUID|FUNCNAME|GROUPS|HISTCMD) ;;
    LINENO|OLDPWD|OPTIND|PIPESTATUS|PPID|PWD|RANDOM|SECONDS|SHELLOPTS|SHLVL|SRANDOM|UID|_|__sf_*) ;;
    *) __sf_k+=("$__sf_v") ;;
  esac
done
for __sf_v in "${__sf_env0[@]}"; do
  if [[ ! -v $__sf_v ]]; then __sf_u+=("$__sf_v"); elif [[ ${!__sf_v@a} != *x* ]]; then __sf_x+=("$__sf_v"); fi
done
{ (( ${#__sf_u[@]} )) && builtin printf "builtin unset -v %s\n" "${__sf_u[@]}"
  builtin declare -p "${__sf_k[@]}"
  (( ${#__sf_x[@]} )) && builtin printf "builtin export -n %s\n" "${__sf_x[@]}"
  builtin declare -f; builtin alias -p
  builtin printf "builtin cd -- %q\n" "$PWD"
  [[ -v OLDPWD ]] && builtin printf "OLDPWD=%q\n" "$OLDPWD"
} > "$__sf_d/state" 2>/dev/null'
  builtin trap 'builtin eval "$__sf_save"' EXIT
  builtin trap 'builtin trap - EXIT; builtin eval "$__sf_save"; builtin exit 143' TERM
fi
if [[ -n $__sf_wd ]]; then builtin cd -- "$__sf_wd" || builtin exit 1; fi
IFS= builtin read -r -d '' __sf_c < "$__sf_f"
builtin shopt -s expand_aliases
:
"""

# Started as `bash -c 'eval "$SANDFORGE_SHELL"' sandforge-shell` (so `ps` stays short) with SANDFORGE_PRE in its
# environment; serves requests from stdin until EOF. All reading and counting is bytewise (LC_ALL=C, local to the
# function, so commands still get the container's locale).
DISPATCHER_SCRIPT = r"""
__sf_pre=$SANDFORGE_PRE; builtin unset -v SANDFORGE_SHELL SANDFORGE_PRE SANDFORGE_GUARD
__sf_oom() {  # the memory cgroup's count of OOM kills (v1, then v2), 0 if neither can be read
  local f k v; __sf_o=0
  for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
    if [[ -r $f ]]; then while read -r k v; do [[ $k == oom_kill ]] && __sf_o=$v; done < "$f"; return; fi
  done
}
__sf_dir() {  # this user's private folder; another user's squatting on the name gets a fresh one instead
  local base=$1; [[ -d $base && -w $base ]] || { base=${TMPDIR:-/tmp}/.sandforge; mkdir -p -m 1777 -- "$base"; }
  d=$base/$EUID
  if ! { [[ ! -L $d && -d $d && -O $d ]] || mkdir -m 700 -- "$d" 2>/dev/null; }; then
    d=$(mktemp -d -- "$base/$EUID.XXXXXXXX") || return 1
  fi
}
__sf_write() { { printf '%s' "$__sf_pre" > "$d/pre" && printf '%s' "$1" > "$cmdf"; } 2>/dev/null; }
__sf_serve() {
  local LC_ALL=C d id t tus k h tl n keep payload wd out cmdf rc t0 to oom o0 buf size tpid i
  __sf_dir "$1" || return 1
  printf 'SFREADY %s\n' "$$"
  while IFS=' ' read -r id t tus k h tl n keep; do
    IFS= read -r -N "$n" payload || (( ${#payload} == n )) || return 0
    [[ -d $d ]] || __sf_dir "$1" || return 1
    wd=${payload%%$'\n'*}
    if [[ $keep == 1 ]]; then out=$d/out cmdf=$d/cmd; else out=$d/out.$id cmdf=$d/cmd.$id; fi
    : > "$out"  # drops what background jobs printed between commands: the spool holds one command's output
    # pre is rewritten every time (the user owns this folder). A command that cannot be written (the user filled the
    # spool) must not pass for one that ran.
    if ! __sf_write "${payload#*$'\n'}"; then
      printf 'SFR %s 126 0 0 0 0\nsandforge: cannot write the command to %s (no space left?)\n' "$id" "$d"
      printf '\0SFEND %s\n' "$id"
      continue
    fi
    __sf_oom; o0=$__sf_o; t0=${EPOCHREALTIME/./}
    timeout -k "$k" "$t" bash -c '. "$1" && eval "$__sf_c"' bash "$d/pre" "$cmdf" "$wd" "$keep" \
      >> "$out" 2>&1 </dev/null &
    tpid=$!; wait "$tpid"; rc=$?
    to=0; (( (rc == 124 || rc == 137) && ${EPOCHREALTIME/./} - t0 >= tus )) && to=1
    # timeout escalates to KILL only while its child lives; members of the group that blocked TERM (bash does while
    # it retries a fork) outlive it. KILL the group (timeout's pid) until nothing answers; kill is a builtin.
    if (( to )); then for i in 1 2 3 4 5 6 7 8 9 10; do kill -KILL -- "-$tpid" 2>/dev/null || break; done; fi
    __sf_oom; oom=0; (( __sf_o > o0 )) && oom=1
    buf=; IFS= read -r -N "$((h + tl + 1))" buf < "$out"
    if (( ${#buf} <= h + tl )); then
      printf 'SFR %s %d %d %d 0 0\n%s\0SFEND %s\n' "$id" "$rc" "$to" "$oom" "$buf" "$id"
    else
      size=$(stat -c %s -- "$out")
      printf 'SFR %s %d %d %d %d %d\n%s' "$id" "$rc" "$to" "$oom" "$((size - h - tl))" "$h" "${buf:0:h}"
      tail -c "$tl" -- "$out"
      printf '\0SFEND %s\n' "$id"
    fi
    if [[ $keep == 1 ]]; then : > "$out"; else rm -f -- "$out" "$cmdf"; fi
  done
}
__sf_serve "$1"
"""


def dispatcher_exec_args(user: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a ``docker exec -i`` that starts a dispatcher for ``user``."""
    session_dir = ROOT_SESSION_DIR if user in ("root", "0", "0:0") else SESSION_DIR
    argv = ["bash", "-c", 'eval "$SANDFORGE_SHELL"', "sandforge-shell", session_dir]
    return argv, {"SANDFORGE_SHELL": DISPATCHER_SCRIPT, "SANDFORGE_PRE": PRE_SCRIPT}


@dataclass
class Request:
    command: bytes
    timeout: float
    head: int  # bytes of output kept from the start ...
    tail: int  # ... and from the end
    workdir: str = ""  # "" = the session's cwd (or the exec's workdir when there is no session yet)
    keep: bool = True  # restore and save the session's state
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or uuid.uuid4().hex

    def encode(self) -> bytes:
        payload = self.workdir.encode() + b"\n" + self.command
        fields = [self.id, f"{self.timeout:.6f}", str(int(self.timeout * 1e6)), f"{KILL_AFTER:g}"]
        fields += [str(self.head), str(self.tail), str(len(payload)), str(int(self.keep))]
        return " ".join(fields).encode() + b"\n" + payload


@dataclass
class Response:
    exit_code: int
    output: bytes  # head + tail; the dropped middle is reported, not included
    timed_out: bool
    oom_killed: bool
    dropped: int  # bytes cut out of the middle
    head_len: int  # where the cut is, when dropped > 0


class ShellLost(Exception):
    """The exec stream ended or failed before the answer came. ``sent`` says whether the request went out."""

    def __init__(self, message: str, sent: bool, timed_out: bool = False):
        super().__init__(message)
        self.sent = sent
        self.timed_out = timed_out


class Stream:
    """A docker exec's hijacked attach socket: stdin to send on, demultiplexed stdout and stderr to read.

    Docker frames each chunk of output with 8 bytes (stream id, 3 zero bytes, big-endian size). Reads go through the
    HTTP response's buffered reader, because parsing the headers may already have pulled in the first frames.
    """

    def __init__(self, sock):
        response = getattr(sock, "_response", None)
        self._handle = sock
        self._reader = response.raw._fp.fp if response is not None else sock
        self._sock = getattr(sock, "_sock", sock)
        self._frames = bytearray()
        self.out = bytearray()
        self._err = bytearray()  # a head and a tail of the exec's stderr; ``err`` adds what was dropped
        self.err_dropped = 0  # stderr bytes read and not kept
        self.out_dropped = 0  # stdout bytes read that could not be part of an answer (read_response), not kept
        self.eof = False

    @property
    def err(self) -> bytes:
        """The exec's stderr as kept: all of it, or its first ERR_HEAD and last ERR_TAIL bytes, then a line saying how
        many bytes were dropped (of stderr, and of stray stdout), last, so that a reader keeping a tail still sees it."""
        kept = bytes(self._err)
        if self.err_dropped:
            kept = kept[:ERR_HEAD] + b"\n[...]\n" + kept[ERR_HEAD:]
        notes = [f"[... {n} bytes of {what} dropped]" for n, what in
                 ((self.err_dropped, "shell stderr"), (self.out_dropped, "stray shell stdout")) if n]
        return kept + ("\n" + "\n".join(notes)).encode() if notes else kept

    def take_err(self) -> bytes:
        """``err``, and forget it (a session's stream reports what came since the last command)."""
        err = self.err
        self._err.clear()
        self.err_dropped = self.out_dropped = 0
        return err

    def _keep_err(self, data: bytes | bytearray) -> None:
        # The socket is drained whatever comes (a blocked writer would stall the container); only a head and a tail
        # stay on the host. Compacting once the slack is used keeps it cheap per chunk.
        err = self._err
        err += data
        if len(err) > ERR_HEAD + ERR_TAIL + ERR_SLACK:
            cut = len(err) - ERR_TAIL
            self.err_dropped += cut - ERR_HEAD
            del err[ERR_HEAD:cut]

    def send(self, data: bytes, deadline: float) -> None:
        self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
        self._sock.sendall(data)

    def close_stdin(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    def read_some(self, deadline: float) -> bool:
        """Read one chunk into ``out``/``err``; False if the deadline passed first. Sets ``eof`` at the end."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._sock.settimeout(remaining)
        try:
            data = self._reader.read1(65536) if hasattr(self._reader, "read1") else self._reader.recv(65536)
        except TimeoutError:
            return False
        if not data:
            self.eof = True
            return True
        frames = self._frames
        frames += data
        while len(frames) >= 8:
            size = int.from_bytes(frames[4:8], "big")
            if len(frames) < 8 + size:
                break
            if frames[0] == 2:
                self._keep_err(frames[8 : 8 + size])
            else:
                self.out += frames[8 : 8 + size]
            del frames[: 8 + size]
        return True

    def read_to_eof(self, deadline: float, max_bytes: int | None = None) -> bool:
        """Read until the process closes its output (True), the deadline passes or stdout exceeds max_bytes (False)."""
        while not self.eof:
            if not self.read_some(deadline) or (max_bytes is not None and len(self.out) > max_bytes):
                return False
        return True

    def close(self) -> None:
        for closeable in (self._handle, getattr(self._handle, "_response", None)):
            try:
                if closeable is not None:
                    closeable.close()
            except Exception:
                pass


def read_ready(stream: Stream, deadline: float) -> int:
    """Wait for the dispatcher's ``SFREADY <pid>`` line; returns its pid (in the container's pid namespace)."""
    while b"\n" not in stream.out:
        if len(stream.out) > STRAY_OUT:
            raise ShellLost(f"the sandbox shell said {bytes(stream.out[:200])!r}... instead of SFREADY", sent=False)
        if stream.eof or not stream.read_some(deadline):
            why = stream.err.decode(errors="replace").strip() or ("it exited" if stream.eof else "no answer")
            raise ShellLost(f"the sandbox shell did not start: {why}", sent=False, timed_out=not stream.eof)
    line, _, rest = bytes(stream.out).partition(b"\n")
    if not line.startswith(b"SFREADY "):
        raise ShellLost(f"the sandbox shell said {line[:200]!r} instead of SFREADY", sent=False)
    stream.out[:] = rest
    return int(line.split()[1])


def read_response(stream: Stream, request: Request, deadline: float) -> Response:
    """Read the answer to ``request`` from the dispatcher's stdout (consuming it); ShellLost if none comes."""
    start = b"SFR " + request.id.encode() + b" "
    end = b"\0SFEND " + request.id.encode() + b"\n"
    scanned = 0
    body_max = request.head + request.tail + STRAY_OUT  # more after a header is stray bytes inside the answer
    while True:
        out = stream.out
        header_at = out.find(start)
        if header_at < 0 and len(out) > STRAY_OUT:  # stray bytes with no answer in them: keep a possible header's start
            stream.out_dropped += len(out) - len(start)
            del out[: len(out) - len(start)]
        if header_at >= 0:
            header_end = out.find(b"\n", header_at)
            if header_end < 0 and len(out) - header_at > STRAY_OUT:
                raise ShellLost("the sandbox shell's answer has no end to its header", sent=True)
            if header_end >= 0:
                end_at = out.find(end, max(header_end + 1, scanned - len(end)))
                if end_at >= 0:
                    fields = bytes(out[header_at:header_end]).split()
                    body = bytes(out[header_end + 1 : end_at])
                    del out[: end_at + len(end)]
                    rc, timed_out, oom, dropped, head_len = (int(f) for f in fields[2:7])
                    return Response(rc, body, bool(timed_out), bool(oom), max(dropped, 0), head_len)
                if len(out) - header_end - 1 > body_max:  # keep the body's room, and enough to find the end marker
                    keep_to = header_end + 1 + request.head + request.tail
                    cut = len(out) - len(end)
                    stream.out_dropped += cut - keep_to
                    del out[keep_to:cut]
                scanned = len(out)
        if stream.eof:
            raise ShellLost("the sandbox shell exited before answering", sent=True)
        if not stream.read_some(deadline):
            raise ShellLost("no answer from the sandbox shell in time", sent=True, timed_out=True)
