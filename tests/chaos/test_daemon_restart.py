"""Case 5: the Docker daemon restarts while episodes of a live job run. The in-flight episodes fail cleanly (as data,
"sandbox: ..." or, if grading is what broke, "verifier: ..."), the job's actors live on, and episodes started once
the daemon is back succeed.

Restarting dockerd stops every container on the host, other users' too: this test is marked ``daemon_restart`` so it
can be left out (``-m "chaos and not daemon_restart"``) or run alone. It restarts dockerd the way
scripts/ensure_docker.sh starts it, and always leaves a daemon answering.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness import ROOT, scripted, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.docker, pytest.mark.slow, pytest.mark.daemon_restart,
              pytest.mark.alone]

LOG = "/var/log/sandforge-dockerd.log"


def dockerd_pids() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0].decode(errors="replace")) == "dockerd":
            pids.append(int(pid))
    return pids


def daemon_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0


def restart_dockerd() -> None:
    """Stop dockerd (TERM, then KILL after 30 s) and start it again as scripts/ensure_docker.sh does."""
    pids = dockerd_pids()
    assert pids, "no dockerd process to restart: this test needs the daemon started by scripts/ensure_docker.sh"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while dockerd_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in dockerd_pids():
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["sh", "-c", f"setsid nohup dockerd >>{LOG} 2>&1 </dev/null &"], check=True)  # outlives pytest


@pytest.fixture
def daemon_kept_running():
    yield
    if not daemon_answers():  # whatever happened above, leave a daemon behind
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure_docker.sh")], timeout=120)
    assert daemon_answers()


def test_in_flight_episodes_fail_cleanly_and_new_ones_succeed_after_a_daemon_restart(live_job, daemon_kept_running):
    import threading

    tasks = [scripted(f"inflight{i}", f"sleep 30.{i}", "echo done") for i in range(2)]
    seen = threading.Event()

    def restart_when_running():
        wait_for(lambda: len(live_job.containers()) >= 2, "both episodes' sandboxes", timeout=120)
        seen.set()
        time.sleep(2)  # both are inside their sleep
        restart_dockerd()

    restarter = threading.Thread(target=restart_when_running, daemon=True)
    restarter.start()
    started = time.monotonic()
    got = live_job.collect(tasks)
    restarter.join(120)
    assert seen.is_set()
    assert time.monotonic() - started < 180
    assert len(got) == 2
    for t in got:
        # failed as data, with the reason: its sandbox (or the grading of it) went with the daemon; "error:" is a bug
        assert t.failed and t.failure.split(":")[0] in ("sandbox", "verifier", "tool"), (t.task.id, t.failure)
        assert t.reward.value == 0.0

    wait_for(daemon_answers, "the daemon back", timeout=120)
    fine = scripted("after", "echo back > back.txt", "cat back.txt",
                    checks=[{"verifier": "file_contains", "path": "/workspace/back.txt", "text": "back"}])
    again = live_job.collect([fine, fine])
    assert all(not t.failed and t.reward.success for t in again), [t.failure for t in again]
    assert live_job.containers() == []
