"""The fork-free bash that stops the policy's processes (policy_stop.py), first saying which TCP ports they listen on
(/proc/net/tcp's uid column: a service the policy left running), and the sandbox's guard, its main process, which runs
the same scan on SIGUSR1 when no exec can start. Plain text, no imports: spec.py starts every sandbox with
the guard, and policy_stop.py raises spec.py's errors."""

from __future__ import annotations

ROUNDS = 200

# Fork-free: `while read` and `kill` are builtins, the glob is bash's, redirections of compound commands run in place.
_FUNCTIONS = r"""__sf_uid() {  # the uid of user $1 (a name in /etc/passwd, or a number) in REPLY
  local name x id
  [[ $1 =~ ^[0-9]+$ ]] && { REPLY=$1; return 0; }
  while IFS=: read -r name x id x; do [[ $name == "$1" ]] && { REPLY=$id; return 0; }; done < /etc/passwd
  return 1
}
__sf_live() {  # does process $1 run anything: a thread of it (its leader included) that is not Z or X
  local t k v st
  for t in /proc/$1/task/[0-9]*/status; do
    st=
    while read -r k v _; do [[ $k == State: ]] && { st=$v; break; }; done 2>/dev/null < "$t"
    [[ -n $st && $st != Z && $st != X ]] && return 0
  done
  return 1
}
__sf_scan() {  # send signal $1 (0: none, count only) to every live process of uid $2, by its threads; how many in N
  local s pid k v u; N=0
  for s in /proc/[0-9]*/status; do
    pid=${s#/proc/}; pid=${pid%/status}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    u=
    while read -r k v _; do [[ $k == Uid: ]] && { u=$v; break; }; done 2>/dev/null < "$s"
    [[ $u == "$2" ]] && __sf_live "$pid" || continue
    if [[ $1 == 0 ]]; then N=$((N + 1)); else kill "-$1" "$pid" 2>/dev/null && N=$((N + 1)); fi
  done
}
__sf_listening() {  # the TCP ports uid $1 listens on (IPv4 and IPv6), space-separated, in PORTS
  local f sl addr rem st queue timer retr uid port; PORTS=
  for f in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $f ]] || continue
    while read -r sl addr rem st queue timer retr uid _; do
      [[ $st == 0A && $uid == "$1" ]] || continue
      printf -v port '%d' "0x${addr##*:}"
      [[ " $PORTS " == *" $port "* ]] || PORTS+="${PORTS:+ }$port"
    done 2>/dev/null < "$f"
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

# Run as the policy's user (its own docker exec: root in a sandbox has no CAP_SETUID): the kernel's own selection.
# kill(-1) reaches every process that user may signal, in any state and with all its threads, and nothing else (not
# the caller, not init): no list of states or names.
KILL_ALL = r"""for ((r = 0; r < ROUNDS; r++)); do kill -STOP -1 2>/dev/null || exit 0; kill -KILL -1 2>/dev/null; done
exit 1""".replace("ROUNDS", str(ROUNDS))

STOP_SCRIPT = _FUNCTIONS + r"""__sf_uid "$1" || { echo "no user $1 in /etc/passwd" >&2; exit 2; }
uid=$REPLY
__sf_stop "$uid" || { echo "processes of uid $uid still running after ROUNDS rounds of SIGSTOP and SIGKILL" >&2
                      exit 1; }
__sf_scan 0 "$uid"
(( N == 0 )) || { echo "$N processes of uid $uid still run a thread after the stop" >&2; exit 1; }
echo "$TOTAL"
""".replace("ROUNDS", str(ROUNDS))

# Read-only, before any signal: the ports the policy's user listens on, and how many processes it runs.
SURVEY_SCRIPT = _FUNCTIONS + r"""__sf_uid "$1" || { echo "no user $1 in /etc/passwd" >&2; exit 2; }
__sf_listening "$REPLY"; echo "listening $PORTS"
__sf_scan 0 "$REPLY"; echo "$N"
"""

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
