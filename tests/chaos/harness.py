"""Helpers for the chaos suite (conftest.py makes ``live_job`` a fixture): faults are injected into real running jobs,
never into fakes.

Two kinds of running job:
- ``sandforge train`` in a subprocess of its own session (``start_train``), watched through its run directory and
  ``docker ps`` with the run label, killed like a crash (``kill_session``) and resumed.
- ``live_job``: an RLJob in this process (real Ray actors: trainer rank, engine, rollout workers; real containers), for
  faults aimed at one episode. Its episodes replay scripted tool calls (``scripted``), so a test knows which
  episode is inside which command when it strikes; its verifiers include the broken ones in chaos_verifiers.py.

Waits on a ``start_train`` run follow its progress, not the clock (``wait_for``): the machine may be busy.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from sandforge.types import Task, ToolCall, Trajectory

ROOT = Path(__file__).resolve().parents[2]
CHAOS_DIR = Path(__file__).resolve().parent

# one RL step of the smallest job that still runs every part: 1 task x 2 samples, 2 short turns, no warm start
TINY_RUN = ["warmup.steps=0", "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2",
            "rollout.max_new_tokens=16", "rollout.workers=1", "rollout.concurrency=2", "sandbox.warm_pool=0",
            "logging.wandb.mode=disabled", "logging.sample_trajectories=0", "model.k3.n_experts=4"]


def sandforge(*args: str) -> list[str]:
    return [sys.executable, "-m", "sandforge.job.cli", *args]


def start_train(out: Path, *overrides: str, resume: bool = False) -> subprocess.Popen:
    """``sandforge train`` of the tiny quickstart into ``out``, in a session of its own; stderr goes to out.log."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(f"{out}.log", "a")
    args = ["train", "configs/terminal.yaml", f"run.output_dir={out}", *TINY_RUN, *overrides]
    if resume:
        args.append("--resume")
    return subprocess.Popen(sandforge(*args), cwd=ROOT, stdout=log, stderr=log, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, out: Path) -> int:
    """The exit status of a ``start_train`` run into ``out``; a run that stops making progress (``wait_for``) is
    killed, with everything it started, and the test fails."""
    wait_for(lambda: proc.poll() is not None, "end of the run", out=out, kill=proc)
    return proc.returncode


def run_log(out: Path) -> str:
    return Path(f"{out}.log").read_text(errors="replace")


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (Ray's processes share its session), like a crash."""
    sid = proc.pid
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    for pid in os.listdir("/proc"):  # anything of that session that left the process group
        if pid.isdigit():
            try:
                if os.getsid(int(pid)) == sid:
                    os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


STALL_S = 300  # how long a run may show no progress at all before a wait on it fails
CEILING_S = 1800  # a run that keeps making progress may take this long in all (a busy machine)


def run_progress(out: Path) -> frozenset[str]:
    """What a ``start_train`` run has visibly done: the distinct lines of its log, and each file it wrote with its size.
    A heartbeat's clock and durations are left out, so a heartbeat that only says time passed is no progress; a new
    phase, a bar's count moving, a row or a checkpoint shard written are."""
    log = Path(f"{out}.log")
    text = log.read_text(errors="replace") if log.exists() else ""
    seen = {re.sub(r"^\[\d\d:\d\d:\d\d\] |\(\d+(m\d\d)?s\)", "", line) for line in text.splitlines()}
    for path in out.rglob("*") if out.exists() else ():
        try:
            seen.add(f"{path} {path.stat().st_size}")
        except OSError:  # written or removed as we look
            continue
    return frozenset(seen)


def wait_for(condition: Callable[[], object], what: str, timeout: float = STALL_S,
             proc: subprocess.Popen | None = None, out: Path | None = None,
             kill: subprocess.Popen | None = None) -> object:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` (with the run's log) otherwise.

    Given a run (``out``), the wait follows its progress, not the clock: it fails only after ``timeout`` seconds in
    which ``run_progress`` saw nothing new (or after CEILING_S in all), so a run slowed by a busy machine still
    passes, and a stuck one still fails. Without one it fails after ``timeout`` seconds. ``proc`` ending first fails
    the wait; ``kill`` (default ``proc``) is killed with its session when the wait fails.
    """
    kill = kill or proc
    start = moved = time.monotonic()
    seen = run_progress(out) if out is not None else frozenset()
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()  # what it did just before it ended
            if value:
                return value
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{run_log(out)[-4000:] if out else ''}")
        now = time.monotonic()
        if out is not None:
            latest = run_progress(out)
            if not latest <= seen:  # something new (a file being rewritten may read short: that is not progress)
                seen, moved = seen | latest, now
        if now - moved > timeout or now - start > CEILING_S:
            if kill is not None:
                kill_session(kill)
            if now - start > CEILING_S:
                why = f"within {CEILING_S:.0f} s, though the run kept making progress"
            elif out is not None:
                why = f"and no progress from the run for {timeout:.0f} s"
            else:
                why = f"within {timeout:.0f} s"
            pytest.fail(f"no {what} {why}" + (f":\n{run_log(out)[-4000:]}" if out is not None else ""))
        time.sleep(0.5 if out is not None else 0.2)


def run_containers(client, run_id: str) -> list:
    from sandforge.sandbox.labels import LABEL_RUN

    return client.containers.list(all=True, sparse=True, filters={"label": f"{LABEL_RUN}={run_id}"})


def trajectories(out: Path) -> list[dict]:
    import json

    path = out / "trajectories.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def metric_rows(out: Path, phase: str = "rl") -> list[dict]:
    import json

    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r.get("phase") == phase]


# --- an RLJob in this process ---------------------------------------------------------------------------------------


def scripted(name: str, *commands: str, checks: list[dict] | None = None, setup: dict | None = None) -> Task:
    """A terminal task whose episode runs ``commands`` in the policy's shell, one per turn, then submits."""
    solution = [ToolCall("bash", {"command": c}) for c in commands] + [ToolCall("submit")]
    return Task(id=f"chaos/{name}", env="terminal", family="chaos", seed=0, instruction=f"chaos: {name}",
                setup=setup or {}, checks=checks or [{"verifier": "command", "command": "true"}], solution=solution)


def observations(traj: Trajectory) -> list[str]:
    return [o for turn in traj.turns for o in turn.observations]


LIVE_JOB = ["warmup.steps=0", "trainer.steps=1", "rollout.workers=2", "rollout.concurrency=4",
            "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_turns=4", "rollout.max_new_tokens=16",
            "rollout.max_context=8192", "rollout.max_tool_output=1024",
            "sandbox.warm_pool=0", "sandbox.exec_timeout=4", "sandbox.memory=256m", "sandbox.pids_limit=64",
            "sandbox.tmp_size=32m", "sandbox.workspace_size=32m", "logging.wandb.mode=disabled",
            "logging.sample_trajectories=0", "model.k3.n_experts=4"]


class LiveJob:
    """An RLJob and the ways to reach it: ``collect`` runs episodes on its rollout workers."""

    def __init__(self, job, client, out: Path):
        self.job, self.client, self.out = job, client, out
        self.run_id = job.run_id
        self.calls = 0

    def collect(self, tasks: list[Task], scripted_policy: bool = True) -> list[Trajectory]:
        self.calls += 1
        groups = [f"chaos{self.calls}/{i}" for i in range(len(tasks))]
        return self.job.collect(tasks, groups, scripted=scripted_policy, label="chaos")

    def containers(self) -> list:
        return run_containers(self.client, self.run_id)


@pytest.fixture(scope="module")
def live_job(tmp_path_factory, terminal_image, docker_client):
    import ray

    from sandforge.config import load_config
    from sandforge.job.console import progress
    from sandforge.job.fleet.lifecycle import open_fleet
    from sandforge.job.rl_job import RLJob
    from sandforge.job.runlog import RunLogger

    out = tmp_path_factory.mktemp("live") / "run"
    cfg = load_config(ROOT / "configs/terminal.yaml", [f"run.output_dir={out}", *LIVE_JOB])
    run_id = f"chaos-{uuid.uuid4().hex[:10]}"
    # the fleet joins this Ray instance, whose workers know the chaos verifiers
    # workers at the driver's niceness, as sandforge's own local Ray (job/fleet/lifecycle.py): Ray's default 15 starves them on
    # a busy machine, where a trainer step waited past half an hour beside two busy processes
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2,
             runtime_env={"env_vars": {"PYTHONPATH": str(CHAOS_DIR)},
                          "worker_process_setup_hook": "chaos_verifiers.register_all"},
             _system_config={"worker_niceness": 0})
    logger = RunLogger(out, cfg, run_id)
    try:
        with open_fleet(cfg, run_id) as fleet, progress() as bar:
            yield LiveJob(RLJob(cfg, fleet, logger, bar), docker_client, out)
    finally:
        logger.close()
