"""Before any check runs, the policy is gone: every process of the policy's user is stopped, then killed, until a
scan of /proc finds none left (zombies aside: they run nothing). Stopping first means a process that forks as fast as
it can is frozen with its children before any of them is killed, so the scan converges even on a fork loop.

Only bash and /proc are used (the images need no procps). The policy's user cannot change its uid (no capabilities,
``no-new-privileges``), so every process it started is found by uid, a detached daemon or a process that made itself
non-dumpable included (its /proc/<pid>/status still says whose it is). A root agent (Harbor's ``harbor_mode: root``)
is not stopped: its processes cannot be told from the grader's; that mode is Harbor's contract, and RL trains in
``hardened``.
"""

from __future__ import annotations

import shlex

ROUNDS = 50

STOP_SCRIPT = r"""uid=$(id -u -- "$1") || exit 2
scan() {  # $1: the signal; prints how many processes of $uid it sent it to
  local n=0 s pid k v st u
  for s in /proc/[0-9]*/status; do
    pid=${s#/proc/}; pid=${pid%/status}
    [[ $pid == "$$" || $pid == "$BASHPID" ]] && continue
    st= u=
    while read -r k v _; do
      case $k in State:) st=$v ;; Uid:) u=$v; break ;; esac
    done 2>/dev/null < "$s"
    [[ $u == "$uid" && $st != Z ]] || continue
    kill "-$1" "$pid" 2>/dev/null && n=$((n + 1))
  done
  echo $n
}
total=0
for ((round = 0; round < ROUNDS; round++)); do
  n=$(scan STOP)
  (( n == 0 )) && { echo "$total"; exit 0; }
  scan KILL >/dev/null
  total=$((total + n))
  sleep 0.02
done
echo "processes of uid $uid still running after $ROUNDS rounds of SIGSTOP and SIGKILL" >&2
exit 1
""".replace("ROUNDS", str(ROUNDS))


def stop_policy(sandbox) -> int:
    """Kill every process of ``sandbox.spec.user`` and confirm none is left; how many there were. Raises the
    sandbox's error (the episode fails: grading would not be sound) when some survive."""
    from sandforge.environments.sandbox.spec import SandboxError

    user = sandbox.spec.user
    if user in ("root", "0", "0:0") or user.startswith("0:"):
        return 0
    result = sandbox.exec(f"bash -c {shlex.quote(STOP_SCRIPT)} stop {shlex.quote(user.split(':')[0])}", timeout=30,
                          user="root", session=False)
    if result.exit_code != 0:
        raise SandboxError(f"could not stop the policy's processes before grading: {result.output.strip()[-200:]}")
    return int(result.output.strip().splitlines()[-1] or 0)
