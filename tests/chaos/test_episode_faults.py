"""Faults aimed at single episodes of one live RLJob (real trainer rank, engine, two rollout worker actors, a fresh
container per episode): each hits some episodes while others run beside them, and the job goes on.

Issue #9 cases 2 (a sandbox killed), 3 (a command that hangs), 4 (a sandbox abused), 6 (a verifier that raises or
hangs), 12 (what the policy can reach) and, last because it restarts a worker, 7 (a rollout worker killed).
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from harness import observations, scripted
from sandforge.types import Trajectory

pytestmark = [pytest.mark.chaos, pytest.mark.docker, pytest.mark.slow]

FINE = scripted("fine", "echo fine > done.txt", "cat done.txt",
                checks=[{"verifier": "file_contains", "path": "/workspace/done.txt", "text": "fine"}])


def by_id(trajs: list[Trajectory]) -> dict[str, Trajectory]:
    return {t.task.id: t for t in trajs}


def strike_container(live, marker: str, act, timeout: float = 60.0) -> threading.Thread:
    """In the background: wait for the run's container with a process whose command line holds ``marker``, then
    ``act(container)``; the thread's ``hit`` attribute says whether it struck."""

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for c in live.containers():
                try:
                    procs = c.top(ps_args="-eo pid,args")["Processes"] or []
                except Exception:  # noqa: BLE001 - starting or already gone
                    continue
                if any(marker in " ".join(p) for p in procs):
                    act(c)
                    thread.hit = True
                    return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.hit = False
    thread.start()
    return thread


def test_a_killed_sandbox_fails_its_episode_only_and_the_step_trains_on_the_rest(live_job):
    """Case 2: ``docker kill`` of one episode's container mid-episode, inside a real RL step (engine policy)."""
    job = live_job.job
    slow = scripted("slow", setup={"commands": ["sleep 3.01", "sleep 3.02", "sleep 3.03"]})
    quick = scripted("quick")

    class Tasks:  # the job's task source, drawing these two tasks (the sampler is the driver's, not an actor's)
        rng = job.sampler.rng

        def sample(self, n, split="train"):
            return [slow, quick][:n]

    trained_on: list[Trajectory] = []
    real_rows = job.rl_rows

    def rows_of(ok):  # what reaches the gradient, recorded on its way to the real trainer
        trained_on.extend(ok)
        return real_rows(ok)

    sampler, job.sampler, job.rl_rows = job.sampler, Tasks(), rows_of
    killer = strike_container(live_job, "sleep 3.0", lambda c: c.kill())
    try:
        metrics = job.rl_step(0)
    finally:
        job.sampler, job.rl_rows = sampler, real_rows
    killer.join(1)
    assert killer.hit, "no episode container ever ran its setup's sleep"
    assert metrics["episodes/count"] == 4
    assert metrics["episodes/failed"] >= 1 and metrics["episodes/failed_sandbox"] == metrics["episodes/failed"]
    assert "loss" in metrics and metrics["policy/version"] == 1  # the step trained and the policy moved on
    assert trained_on and all(not t.failed for t in trained_on)
    assert len(trained_on) == 4 - metrics["episodes/failed"]  # every other episode reached the gradient
    assert live_job.containers() == []  # the killed one was removed too


def test_a_hanging_command_is_killed_with_its_process_group_and_the_episode_goes_on(live_job):
    """Case 3: ``sleep`` forever (and a child of it in the background) against sandbox.exec_timeout=4."""
    hang = scripted("hang", "sleep 1000 & sleep 1001; echo never", "pgrep -fc 'sleep 100[01]' || true",
                    "echo alive", checks=[{"verifier": "command", "command": "true"}])
    started = time.monotonic()
    (t,) = live_job.collect([hang])
    assert time.monotonic() - started < 60
    assert not t.failed, t.failure
    hung, survivors, alive = observations(t)[:3]
    assert "timed out after 4s; killed" in hung and "never" not in hung
    assert survivors.startswith("0\n"), survivors  # the whole group is gone, the background sleep included
    assert alive.startswith("alive\n")
    assert t.reward.success and t.finish_reason == "submit"


def test_abuse_stays_inside_its_sandbox(live_job, tmp_path):
    """Case 4: a fork bomb, a memory hog, a disk filler and 10 MB of output per command, beside a well-behaved
    episode; each abusive episode still ends and is graded, the good one succeeds, the host keeps forking."""
    abuse = [
        scripted("fork_bomb", "bomb() { bomb | bomb; }; bomb", "sleep 1; echo after the bomb"),
        scripted("memory_hog", "head -c 600m /dev/zero | tail -c 500m > /dev/null", "echo after the hog"),
        scripted("disk_filler",
                 "head -c 100m /dev/zero > /workspace/fill; head -c 100m /dev/zero > /tmp/fill; df /tmp /workspace",
                 "rm -f /workspace/fill; echo ok > after.txt && cat after.txt"),
        scripted("output_flood", "head -c 10000000 /dev/urandom | base64 -w 100", "yes | head -c 10000000",
                 "echo after the flood"),
    ]
    (fine, *hits) = live_job.collect([FINE, *abuse])
    assert not fine.failed and fine.reward.success, fine.failure or fine.reward.reason
    done = by_id(hits)
    for t in hits:
        assert not t.failed, (t.task.id, t.failure)  # contained: the episode itself survives its own abuse
        assert t.finish_reason == "submit", (t.task.id, t.finish_reason)
    assert observations(done["chaos/fork_bomb"])[-2].startswith("after the bomb")
    hog = observations(done["chaos/memory_hog"])
    assert "ran out of memory" in hog[0] and hog[1].startswith("after the hog")
    fill = observations(done["chaos/disk_filler"])
    assert "No space left on device" in fill[0] or "File size limit exceeded" in fill[0]
    assert fill[1].startswith("ok\n")
    flood = observations(done["chaos/output_flood"])
    assert all(len(o) < 2_000 for o in flood) and flood[2].startswith("after the flood")
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    # the filler wrote into the sandbox's own size-capped tmpfs (sandbox.tmp_size / workspace_size, df's 1K-blocks),
    # never onto the host's disk
    rows = [line.split() for line in fill[0].splitlines() if line.startswith(("tmpfs", "/"))]
    mounts = {row[-1]: int(row[1]) for row in rows}
    assert mounts["/tmp"] <= 32 * 1024 and mounts["/workspace"] <= 32 * 1024, fill[0]
    assert live_job.containers() == []


@pytest.mark.timeout(600)  # the hung check is abandoned twice: on the episode's sandbox, then on a pristine one
def test_a_broken_verifier_fails_its_episode_with_the_reason_and_others_are_graded(live_job):
    """Case 6: one verifier raises, one hangs past its timeout, on the policy's sandbox and on a pristine one alike
    (verifiers/checks.py failure_rule: broken by themselves); the episodes beside them are graded as usual."""
    raises = scripted("verifier_raises", checks=[{"verifier": "chaos_raise"}])
    hangs = scripted("verifier_hangs", checks=[{"verifier": "chaos_hang", "timeout": 2}])
    got = by_id(live_job.collect([raises, FINE, hangs, FINE]))
    r, h = got["chaos/verifier_raises"], got["chaos/verifier_hangs"]
    assert r.failed and r.failure.startswith("verifier:") and "RuntimeError: the verifier's own bug" in r.failure
    assert h.failed and h.failure.startswith("verifier:") and "did not finish within its 2 s timeout" in h.failure
    assert r.reward.value == 0.0 and h.reward.value == 0.0
    assert got["chaos/fine"].reward.success and not got["chaos/fine"].failed


SECURITY_PROBES = [
    "id -u; id -un",  # not root
    "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status",  # no capabilities
    "ls /sys/class/net; tail -n +2 /proc/net/route | wc -l",  # no interface but lo, no route
    "timeout 2 bash -c 'exec 3<>/dev/tcp/1.1.1.1/53' 2>&1 | tail -c 80; echo tcp=${PIPESTATUS[0]}",  # none out
    "ls -la /var/run/docker.sock /run/docker.sock 2>&1; find / -name 'docker.sock' 2>/dev/null | head -3; echo .",
    "ls -d /work /host /var/lib/docker 2>&1; ls /run/sandforge-root 2>&1; "
    "find / -xdev \\( -name 'sandforge*' -o -name verifiers -o -name 'test_*.py' -o -name conftest.py \\) -print "
    "2>/dev/null | head; echo .",
    "ps -eo pid,user,args --no-headers; hostname",  # only this sandbox's processes
    "ls -la /workspace /tmp; cat /proc/1/cmdline | tr '\\0' ' '; echo",
    "sudo -n true 2>&1; su -c true root </dev/null 2>&1; echo denied",
]


def test_the_policy_reaches_nothing_outside_its_sandbox(live_job):
    """Case 12: two episodes at once probe, as the policy would (its tools, its user): not root, no capabilities, no
    network, no Docker socket, no host paths, no verifier code, no sign of the other episode; the hidden check's
    secret (used only by the verifier) appears nowhere the policy looks."""
    secret = "chaos-hidden-expected-7f3a"
    # two commands (two turns), each running its probes in turn with a line "@@" between their outputs
    commands = ["; echo @@; ".join(SECURITY_PROBES[:5]), "; echo @@; ".join(SECURITY_PROBES[5:])]
    tasks = [scripted(f"probe{i}", *commands, f"echo {secret}-{i}-mine > mine.txt",
                      checks=[{"verifier": "command", "command": f"test -e /workspace/mine.txt && echo {secret}"}])
             for i in range(2)]
    for t in live_job.collect(tasks):
        i = t.task.id[-1]
        other = str(1 - int(i))
        obs = observations(t)
        assert not t.failed, t.failure
        uid, caps, net, tcp, sock, host, procs, files, sudo = obs[0].split("@@\n") + obs[1].split("@@\n")
        assert uid.split()[:2] == ["1000", "sandbox"], uid
        held = dict(line.split(":\t") for line in caps.splitlines()[:5])
        assert {k: held[k] for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")} == dict.fromkeys(
            ("CapInh", "CapPrm", "CapEff", "CapAmb"), "0000000000000000"), caps  # holds none, can gain none:
        assert int(held["CapBnd"], 16) & ~0x2B == 0, caps  # no-new-privileges; the bound is root's CHOWN/DAC/FOWNER/KILL
        assert net.split()[:2] == ["lo", "0"], net
        assert "tcp=0" not in tcp and "tcp=" in tcp, tcp
        assert "No such file or directory" in sock and "docker.sock\n/" not in sock, sock
        assert host.count("No such file or directory") == 3 and "\n.\n" in host, host  # no host folders
        found = {line for line in host.splitlines() if line.startswith("/")}
        assert found <= {"/run/sandforge", "/run/sandforge-root"}, host  # no grader code, only the output spools
        assert "/run/sandforge-root': Permission denied" in host, host  # and the verifiers' spool is closed to it
        users = {line.split()[1] for line in procs.splitlines() if line.split()[0].isdigit()}
        assert users <= {"root", "sandbox"} and len(users) > 0, procs  # its own init and shell, nothing of the host's
        assert not any(name in procs for name in ("python", "raylet", "dockerd", "containerd", "pytest")), procs
        assert "sandforge-guard" in files  # PID 1 is this sandbox's own (tini, and the guard it runs)
        assert "denied" in sudo and "uid=0" not in sudo
        everything = "\n".join(obs) + t.task.instruction
        assert secret not in everything.replace(f"{secret}-{i}-mine", "")  # the verifier's secret never shows
        assert f"{secret}-{other}" not in everything  # nor anything of the other episode
        assert t.reward.success  # and the verifier, outside, saw the work


def test_a_killed_rollout_worker_is_restarted_and_its_episodes_come_back_failed(live_job):
    """Case 7: ``ray.kill`` of a rollout worker actor while it runs episodes. Ray restarts it (``max_restarts``); the
    episodes it had in flight come back failed ("worker: ..."), counted in metrics, none lost and none doubled; the
    other worker's episodes finish; the next episodes run on the restarted worker."""
    import ray

    from sandforge.job.rollout_metrics import rollout_metrics

    job = live_job.job
    tasks = [scripted(f"long{i}", f"sleep 6.{i}", "echo done") for i in range(4)]  # episode i goes to worker i % 2
    killer = strike_container(live_job, "sleep 6.", lambda c: ray.kill(job.workers[0], no_restart=False))
    got = live_job.collect(tasks)
    killer.join(1)
    assert killer.hit
    assert sorted(t.task.id for t in got) == sorted(t.id for t in tasks)  # every episode accounted for, once
    lost = [t for t in got if t.failed]
    assert {t.task.id for t in lost} == {"chaos/long0", "chaos/long2"}, [(t.task.id, t.failure) for t in got]
    assert all(t.failure.startswith("worker: rollout worker 0 died") and t.reward.value == 0.0 for t in lost)
    assert all(observations(t)[1].startswith("done") for t in got if not t.failed)
    m = rollout_metrics(got)
    assert m["episodes/failed"] == 2 and m["episodes/failed_worker"] == 2
    again = live_job.collect([FINE, FINE])  # one per worker: the restarted one included
    assert all(not t.failed and t.reward.success for t in again), [t.failure for t in again]
    assert {t.metadata["worker"] for t in again} == {0, 1}
    live_job.job.fleet.close_workers()  # the dead worker's sandboxes are the run's: the end-of-run sweep takes them
