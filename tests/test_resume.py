"""A run SIGKILLed mid-training and resumed with `sandforge train CONFIG --resume` ends as an uninterrupted run does.

Both runs have one rollout worker running one episode at a time, so the engine decodes one sequence at a time in both,
and every request carries a seed derived from (run seed, step, group, episode, turn): the resumed run samples the same
tokens from the same weights and every metric below matches bitwise. What cannot match is wall-clock time (``time/*``)
and the sandbox latency samples (``sandbox/*``: Docker's timings); those keys are left out.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_train_e2e import ROOT, sandforge

pytestmark = [pytest.mark.docker, pytest.mark.slow]

RUN = ["trainer.steps=4", "trainer.checkpoint_every=1", "trainer.entropy_coef=0.01", "warmup.steps=0",
       "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.workers=1", "rollout.concurrency=1",
       "sandbox.warm_pool=1", "logging.wandb.mode=offline", "logging.sample_trajectories=0"]
NOT_REPRODUCIBLE = ("time/", "sandbox/")  # wall-clock and Docker latencies


def rl_rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["phase"] == "rl"}


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("time", "phase") and not k.startswith(NOT_REPRODUCIBLE)}


def train(*args: str) -> subprocess.CompletedProcess:
    """``sandforge train`` in a session of its own; on a timeout everything it started is killed, Ray included."""
    proc = subprocess.Popen(sandforge("train", "configs/terminal.yaml", *RUN, *args), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (Ray's processes share its session), like a crash."""
    sid = proc.pid
    os.killpg(sid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid in os.listdir("/proc"):  # anything of that session that left the process group
        if pid.isdigit():
            try:
                if os.getsid(int(pid)) == sid:
                    os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_killed_run_resumes_to_the_same_metrics(tmp_path, terminal_image, docker_client):
    from containers import list_run_containers

    whole = tmp_path / "whole"
    proc = train(f"run.output_dir={whole}")
    assert proc.returncode == 0, proc.stderr[-4000:]

    crashed = tmp_path / "crashed"
    driver = subprocess.Popen(sandforge("train", "configs/terminal.yaml", f"run.output_dir={crashed}", *RUN),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    marker = crashed / "checkpoints" / "step_2" / "complete"
    deadline = time.monotonic() + 900
    while not marker.exists():
        assert driver.poll() is None, f"the run ended before step 2's checkpoint: {driver.stderr.read()[-4000:]}"
        if time.monotonic() > deadline:
            kill_session(driver)
            pytest.fail("no step-2 checkpoint within 15 minutes")
        time.sleep(0.2)
    kill_session(driver)
    run_id = (crashed / "run_id").read_text().strip()

    resumed = train("--resume", str(crashed))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming run {run_id} after step" in resumed.stderr
    assert list_run_containers(run_id, client=docker_client) == []  # the killed driver's sandboxes were reaped too

    want, got = rl_rows(whole), rl_rows(crashed)
    assert sorted(got) == [0, 1, 2, 3]  # rows past the checkpoint were dropped, not duplicated
    for step in (2, 3):
        assert comparable(got[step]) == comparable(want[step]), step
    assert got[3]["policy/version"] == want[3]["policy/version"]
    assert (crashed / "checkpoints" / "step_4" / "complete").is_file()


def test_resume_without_a_checkpoint_says_so(tmp_path):
    (tmp_path / "run_id").write_text("x\n")
    proc = subprocess.run(sandforge("train", "configs/terminal.yaml", "--resume", str(tmp_path)), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --resume {tmp_path}: no complete checkpoint under {tmp_path / 'checkpoints'} (a checkpoint counts "
        "once its 'complete' marker is written); start the run again without --resume"]
