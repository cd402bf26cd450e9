"""Processes of a running ``sandforge train`` die: the driver itself (case 1) or a trainer rank (case 8). Either way
the next ``sandforge train --resume`` removes what the dead run left, continues from its last checkpoint, and ends
with every RL step logged exactly once."""

from __future__ import annotations

import os
import re
import signal

import pytest

from harness import finish, kill_session, metric_rows, run_containers, run_log, start_train, trajectories, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.docker, pytest.mark.slow]

STEPS = ["trainer.steps=3", "trainer.checkpoint_every=1"]


def session_pids(leader: int, marker: str) -> list[int]:
    """Processes of the run's session whose command line holds ``marker`` (Ray names actor processes ray::Class)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == leader and marker in open(f"/proc/{pid}/cmdline").read():
                found.append(int(pid))
        except (OSError, ProcessLookupError):
            continue
    return found


def assert_resumed_to_the_end(out, run_id: str, docker_client) -> None:
    assert run_containers(docker_client, run_id) == []
    assert sorted(r["step"] for r in metric_rows(out)) == [0, 1, 2]  # each step once: none lost, none doubled
    rl = [t for t in trajectories(out) if t["phase"] == "rl"]
    assert sorted(t["step"] for t in rl) == [0, 0, 1, 1, 2, 2]
    assert (out / "checkpoints" / "step_3" / "complete").is_file()


@pytest.mark.alone  # a job another test starts meanwhile would reap the killed run's sandboxes first
def test_a_sigkilled_driver_is_reaped_and_resumed(tmp_path, terminal_image, docker_client):
    """Case 1: SIGKILL the driver (and its Ray) while its sandboxes are up, after the step-1 checkpoint."""
    out = tmp_path / "run"
    proc = start_train(out, *STEPS)
    wait_for(lambda: (out / "checkpoints" / "step_1" / "complete").is_file(), "step-1 checkpoint", proc=proc, out=out)
    run_id = (out / "run_id").read_text().strip()
    wait_for(lambda: run_containers(docker_client, run_id), "sandbox of step 2", proc=proc, out=out)
    kill_session(proc)
    left = run_containers(docker_client, run_id)
    assert left, "the crash should leave the run's sandboxes behind (or the test proves nothing)"

    resumed = start_train(out, *STEPS, resume=True)
    assert finish(resumed, out) == 0, run_log(out)[-4000:]
    log = run_log(out)
    assert f"resuming run {run_id} after step" in log
    # the resumed run's own lines, and among them the one about this run: leftovers of other runs (another test's,
    # a crashed run's on a shared machine) may be reaped by either start and are no concern of this test
    resumed_log = log.split(f"resuming run {run_id} after step", 1)[1]
    reaped = re.findall(rf"^reaped (\d+) container\(s\) of dead run {re.escape(run_id)}$", resumed_log, re.M)
    assert reaped and int(reaped[0]) >= len(left), resumed_log[-4000:]
    assert_resumed_to_the_end(out, run_id, docker_client)


def test_a_killed_trainer_rank_stops_the_run_with_one_line_and_resume_continues(tmp_path, terminal_image,
                                                                               docker_client):
    """Case 8: SIGKILL the trainer rank's process mid-run, after the step-1 checkpoint."""
    out = tmp_path / "run"
    proc = start_train(out, *STEPS)
    wait_for(lambda: (out / "checkpoints" / "step_1" / "complete").is_file(), "step-1 checkpoint", proc=proc, out=out)
    ranks = wait_for(lambda: session_pids(proc.pid, "ray::TrainerRank"), "trainer rank process", proc=proc, out=out)
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    code = finish(proc, out)
    run_id = (out / "run_id").read_text().strip()
    errors = [line for line in run_log(out).splitlines() if line.startswith("error:")]
    assert code == 1, run_log(out)[-4000:]
    assert len(errors) == 1 and "TrainerRank actor died" in errors[0], errors
    assert f"--resume {out}" in errors[0] and "step_" in errors[0], errors
    assert "Traceback" not in run_log(out)
    assert run_containers(docker_client, run_id) == []  # a clean stop: its sandboxes are gone
    wait_for(lambda: not session_pids(proc.pid, "ray::"), "end of the stopped run's Ray processes", timeout=60)

    resumed = start_train(out, *STEPS, resume=True)
    assert finish(resumed, out) == 0, run_log(out)[-4000:]
    assert f"resuming run {run_id} after step" in run_log(out)
    assert_resumed_to_the_end(out, run_id, docker_client)
