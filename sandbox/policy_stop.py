"""Before any check runs, the policy is gone: no task (thread) of the policy's user runs. Three passes, the first two
each enough alone:

1. the kernel's own selection: a plain ``docker exec`` as the policy's user (``DockerSandbox.kill_all_as``; root in a
   sandbox has no CAP_SETUID, so it cannot become that user itself) sends SIGSTOP, then SIGKILL, to pid -1, which
   reaches every process that user may signal and nothing else, whatever state its threads are in (a process whose
   main thread exited shows Z in /proc/PID/status while its other threads run: it is reached like the rest);
2. a root exec's /proc scan (below), which needs no fork: every process of the user with a thread (/proc/PID/task)
   that is not Z or X is stopped, then killed, until a scan finds none;
3. in the same exec, a last read-only scan over the threads: any left and the stop fails (grading would not be
   sound).

True zombies, which run nothing, are left to tini. Stopping first means a process that forks as fast as
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

A service the policy started and left listening is stopped like the rest; the ports it listened on come back with the
count, so a task graded on a running service that scores 0 says why (verifiers/checks.py ``score_task``).
"""

from __future__ import annotations

import shlex
import time

from sandforge.sandbox.stop_scripts import STOP_SCRIPT, SURVEY_SCRIPT
from sandforge.types import PolicyStop, SandboxError

RETRIES = 5  # execs tried after signalling the guard, RETRY_PAUSE apart
RETRY_PAUSE = 0.5


def stop_policy(sandbox) -> PolicyStop:
    """Kill every process of ``sandbox.spec.user`` and confirm no thread of it is left: how many there were, and the
    TCP ports they listened on. Raises the sandbox's error (the episode fails: grading would not be sound) when some
    survive or the sandbox is gone."""
    user = sandbox.spec.user
    if user in ("root", "0", "0:0") or user.startswith("0:"):
        return PolicyStop(0)
    name = shlex.quote(user.split(":")[0])
    survey = sandbox.exec(f"bash -c {shlex.quote(SURVEY_SCRIPT)} survey {name}", timeout=30, user="root",
                          session=False)  # read-only, before any signal; fails only where no exec can start
    sandbox.kill_all_as(user)  # pass 1, the kernel's selection (best effort: the passes below hold alone)
    command = f"bash -c {shlex.quote(STOP_SCRIPT)} stop {name}"
    result = sandbox.exec(command, timeout=30, user="root", session=False)
    for _ in range(RETRIES if result.exit_code != 0 else 0):  # no exec could start, or none could fork: the guard
        sandbox.signal_guard()
        time.sleep(RETRY_PAUSE)
        result = sandbox.exec(command, timeout=30, user="root", session=False)
        if result.exit_code == 0:
            break
    if result.exit_code != 0:
        raise SandboxError(f"could not stop the policy's processes before grading: {result.output.strip()[-200:]}")
    lines = survey.output.strip().splitlines() if survey.exit_code == 0 else []
    ports = next((line.split()[1:] for line in lines if line.startswith("listening")), [])
    found = int(lines[-1]) if lines and lines[-1].isdigit() else 0
    killed = int(result.output.strip().splitlines()[-1] or 0)
    return PolicyStop(max(found, killed), tuple(int(p) for p in ports if p.isdigit()))
