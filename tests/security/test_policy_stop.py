"""The policy stop leaves no task of the policy alive (#32, item 1). A process whose main thread has exited shows
state Z in /proc/PID/status while its other threads run (ctypes and pthread_exit, no privilege needed); the stop
skipped it as a zombie, and it rewrote what the checks read. The invariant is over threads: after the stop, no entry of
/proc/*/task belongs to the policy's user unless it is a zombie."""

from __future__ import annotations

import time

import pytest

from sandforge.sandbox.docker_sandbox import DockerSandbox

pytestmark = pytest.mark.docker

# the main thread exits (the process's /proc/PID/status then says Z) while a second thread keeps forging the answer
HALF_DEAD = r"""nohup python3 - > /dev/null 2>&1 <<'PY' &
import ctypes, threading, time
def forge():
    while True:
        with open("/workspace/answer.txt", "w") as f:
            f.write("PASS\n")
        time.sleep(0.02)
threading.Thread(target=forge).start()
time.sleep(0.2)
ctypes.CDLL(None).pthread_exit(None)
PY
sleep 1; echo planted"""

# every live task (thread) of uid 1000: /proc/PID/task/TID/status whose State is not Z or X
LIVE_TASKS = r"""n=0; for s in /proc/[0-9]*/task/[0-9]*/status; do
  st=; u=; while read -r k v _; do case $k in State:) st=$v;; Uid:) u=$v; break;; esac; done < "$s" 2>/dev/null
  [[ $u == 1000 && $st != Z && $st != X ]] && n=$((n + 1))
done; echo $n"""


def test_a_process_whose_main_thread_exited_is_stopped_with_its_threads(repo_spec, run_id, docker_client):
    with DockerSandbox.create(repo_spec, run_id, client=docker_client) as sb:
        assert sb.exec(HALF_DEAD, timeout=30).output.strip().endswith("planted")
        leader = sb.exec("for s in /proc/[0-9]*/status; do grep -q '^Uid:\\s*1000' $s && grep -q '^State:\\s*Z' $s "
                         "&& echo zombie-leader; done", timeout=10, user="root", session=False).output
        assert "zombie-leader" in leader  # the attack's shape: its /proc/PID/status says Z
        assert int(sb.exec(LIVE_TASKS, timeout=10, user="root", session=False).output.split()[-1]) >= 1
        sb.stop_policy()
        assert sb.exec(LIVE_TASKS, timeout=10, user="root", session=False).output.split()[-1] == "0"
        sb.exec("echo honest > /workspace/answer.txt", timeout=10, user="root", session=False)
        time.sleep(0.5)
        assert sb.read_file("/workspace/answer.txt", user="root") == "honest\n"  # nothing forges it any more


@pytest.mark.parametrize("stage", ["kernel", "scan"])
def test_each_pass_of_the_stop_alone_ends_the_half_dead_process(stage, repo_spec, run_id, docker_client):
    """The stop's passes are each sufficient (sandbox/policy_stop.py): the policy's uid signalling pid -1
    (the kernel picks what that user may signal) and the fork-free /proc scan over threads. Other users' processes,
    root's and nobody's, are never touched."""
    import shlex

    from sandforge.sandbox.stop_scripts import _FUNCTIONS

    with DockerSandbox.create(repo_spec, run_id, client=docker_client) as sb:
        assert sb.exec(HALF_DEAD, timeout=30).output.strip().endswith("planted")
        others = [sb.exec("setsid -f sleep 300; echo ok", timeout=10, user=user, session=False)
                  for user in ("root", "nobody")]
        assert [o.output.strip() for o in others] == ["ok", "ok"], others
        if stage == "kernel":
            assert sb.kill_all_as("sandbox")
        else:
            command = f"bash -c {shlex.quote(_FUNCTIONS + '__sf_stop 1000')}"
            assert sb.exec(command, timeout=30, user="root", session=False).exit_code == 0
        assert sb.exec(LIVE_TASKS, timeout=10, user="root", session=False).output.split()[-1] == "0"
        survivors = sb.exec("for s in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $s; echo; done | grep -c '^sleep 300'",
                            timeout=10, user="root", session=False)
        assert survivors.output.strip() == "2", survivors.output
