"""Before any check runs, the policy is gone: every process of the policy's user is stopped, then killed, until a
scan of /proc finds none left (zombies aside: they run nothing). Stopping first means a process that forks as fast as
it can is frozen with its children before any of them is killed, so the scan converges even on a fork loop.

Only bash builtins and /proc are used: no command forks, so the scan runs even when the policy holds every pid the
sandbox may have (a fork bomb at the pids limit). The policy's user cannot change its uid (no capabilities,
``no-new-privileges``), so every process it started is found by uid, a detached daemon or a process that made itself
non-dumpable included (its /proc/<pid>/status still says whose it is). A root agent (Harbor's ``harbor_mode: root``)
is not stopped: its processes cannot be told from the grader's; that mode is Harbor's contract, and RL trains in
``hardened``.

When the pids are all taken, no ``docker exec`` can start at all. So the sandbox's main process is a guard (its
command, ``guard_command``): a root bash that holds one ``sleep`` and, on SIGUSR1 (``docker kill -s USR1``: tini
passes it on), runs the same scan for the policy's user. ``stop_policy`` signals it when its own exec fails, then
tries again.
"""

from __future__ import annotations

import shlex
import time

ROUNDS = 200
RETRIES = 5  # execs tried after signalling the guard, RETRY_PAUSE apart
RETRY_PAUSE = 0.5

# Fork-free: `while read` and `kill` are builtins, the glob is bash's, redirections of compound commands run in place.
_FUNCTIONS = r"""__sf_uid() {  # the uid of user $1 (a name in /etc/passwd, or a number) in REPLY
  local name x id
  [[ $1 =~ ^[0-9]+$ ]] && { REPLY=$1; return 0; }
  while IFS=: read -r name x id x; do [[ $name == "$1" ]] && { REPLY=$id; return 0; }; done < /etc/passwd
  return 1
}
__sf_scan() {  # send signal $1 to every live process of uid $2; how many in N
  local s pid k v st u; N=0
  for s in /proc/[0-9]*/status; do
    pid=${s#/proc/}; pid=${pid%/status}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    st= u=
    while read -r k v _; do
      case $k in State:) st=$v ;; Uid:) u=$v; break ;; esac
    done 2>/dev/null < "$s"
    [[ $u == "$2" && $st != Z ]] || continue
    kill "-$1" "$pid" 2>/dev/null && N=$((N + 1))
  done
}
__sf_stop() {  # stop, then kill, every process of uid $1 until none is left; how many in TOTAL; 1 if some survive
  local round; TOTAL=0
  for ((round = 0; round < ROUNDS; round++)); do
    __sf_scan STOP "$1"
    (( N == 0 )) && return 0
    __sf_scan KILL "$1"
    TOTAL=$((TOTAL + N))
  done
  return 1
}
""".replace("ROUNDS", str(ROUNDS))

STOP_SCRIPT = _FUNCTIONS + r"""__sf_uid "$1" || { echo "no user $1 in /etc/passwd" >&2; exit 2; }
__sf_stop "$REPLY" || { echo "processes of uid $REPLY still running after ROUNDS rounds of SIGSTOP and SIGKILL" >&2
                        exit 1; }
echo "$TOTAL"
""".replace("ROUNDS", str(ROUNDS))

# The sandbox's main process (under tini). $1: the policy's user. Root, or a user it cannot find: it only sleeps. It
# comes in the container's environment (GUARD_VARIABLE), so that `ps` shows a short command line; every shell sandforge
# starts drops that variable (shell.py), so the policy's commands never see it.
GUARD_VARIABLE = "SANDFORGE_GUARD"
GUARD_SCRIPT = "builtin unset -v " + GUARD_VARIABLE + "\n" + _FUNCTIONS + r"""uid=; __sf_uid "$1" && [[ $REPLY != 0 ]] && uid=$REPLY
trap '[[ -n $uid ]] && __sf_stop "$uid"' USR1
trap 'exit 0' TERM
p=
while :; do
  [[ -n $p ]] && kill -0 "$p" 2>/dev/null || { sleep infinity & p=$!; }
  wait "$p"
done
"""


def guard_command(user: str) -> list[str]:
    """The main command of a sandbox whose policy runs as ``user`` (see the module docstring); the container's
    environment must hold ``GUARD_VARIABLE=GUARD_SCRIPT``."""
    return ["bash", "-c", f'eval "${GUARD_VARIABLE}"', "sandforge-guard", user.split(":")[0]]


def stop_policy(sandbox) -> int:
    """Kill every process of ``sandbox.spec.user`` and confirm none is left; how many there were. Raises the
    sandbox's error (the episode fails: grading would not be sound) when some survive or the sandbox is gone."""
    from sandforge.environments.sandbox.spec import SandboxError

    user = sandbox.spec.user
    if user in ("root", "0", "0:0") or user.startswith("0:"):
        return 0
    command = f"bash -c {shlex.quote(STOP_SCRIPT)} stop {shlex.quote(user.split(':')[0])}"
    result = sandbox.exec(command, timeout=30, user="root", session=False)
    for _ in range(RETRIES if result.exit_code != 0 else 0):  # no exec could start, or none could fork: the guard
        sandbox.signal_guard()
        time.sleep(RETRY_PAUSE)
        result = sandbox.exec(command, timeout=30, user="root", session=False)
        if result.exit_code == 0:
            break
    if result.exit_code != 0:
        raise SandboxError(f"could not stop the policy's processes before grading: {result.output.strip()[-200:]}")
    return int(result.output.strip().splitlines()[-1] or 0)
