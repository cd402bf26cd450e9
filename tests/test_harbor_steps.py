"""Harbor's multi-step tasks in containers (tests/data/harbor/shapes/two-step: write three notes, then, after a step
set-up that appends one more, sort them): `sandforge harbor check` runs each step's set-up, solve.sh and tests as an
episode runs them, and a real episode through the agent loop runs each step in a fresh context, graded as it ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agent_fakes import CHAT

from sandforge.config import SandboxConfig
from sandforge.environments.harbor.env import HarborEnv
from sandforge.environments.harbor.tasks import load_task, load_tasks
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.policy_client import scripted_policy
from sandforge.sandbox.images import build_images
from sandforge.sandbox.job_spec import sandbox_spec

pytestmark = pytest.mark.docker

TWO_STEP = Path(__file__).parent / "data" / "harbor" / "shapes" / "two-step"


@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_harbor_check_runs_a_multi_step_task_step_by_step(mode):
    from sandforge.job.harbor_check import check

    [row] = check([TWO_STEP], mode=mode)
    assert (row.task, row.oracle, row.noop, row.reason) == ("harbor/two-step", 1.0, 0.0, ""), row


@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_an_episode_runs_each_step_in_a_fresh_context_and_grades_it(mode, run_id, docker_client):
    """The warm start's replay: each step's solve.sh typed through the bash tool, then submit; the first step's tokens
    are an earlier row, the second's the episode's own; the reward is the final step's."""
    task = load_task(TWO_STEP, mode)
    [(name, context)] = load_tasks(TWO_STEP, mode)[1].items()
    image = build_images([], client=docker_client, show_progress=False, contexts={name: context})[name]
    env = HarborEnv(task, sandbox_spec(SandboxConfig(), image, HarborEnv, task.sandbox, docker_client), run_id,
                    exec_timeout=30, client=docker_client)
    limits = EpisodeLimits(max_turns=3, max_context=16384, max_new_tokens=4096, stop_ids=CHAT.stop_ids)
    traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits, group="g"))
    assert not traj.failed, traj.failure
    assert (traj.reward.value, traj.reward.success) == (1.0, True), traj.reward.reason
    assert traj.metadata["steps"] == [{"name": "write-notes", "reward": 1.0, "success": True},
                                      {"name": "sort-notes", "reward": 1.0, "success": True}]
    first, second = (CHAT.tokenizer.decode(r.token_ids) for r in traj.rows())
    assert "Write three lines" in first and "Sort /app/notes.txt" not in first
    assert "Sort /app/notes.txt" in second and "Write three lines" not in second


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_multi_step_task_warm_starts_and_trains_for_one_step(tmp_path):
    """`sandforge train configs/harbor.yaml` on two-step: the warm start replays both steps' solve.sh (two rows, both
    trained), and an RL step runs its episodes step by step through the rollout worker."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    overrides = ["trainer.steps=1", "warmup.steps=1", "warmup.episodes=2", "warmup.batch_size=2", "rollout.workers=1",
                 "rollout.concurrency=2", "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2",
                 "rollout.max_new_tokens=32", "trainer.grad_accum_steps=1", "logging.wandb.mode=disabled",
                 "eval.every=0", f"run.output_dir={out}", f"environments.harbor.tasks={TWO_STEP}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/harbor.yaml", *overrides],
                          cwd=root, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert rows and all(not r["failed"] for r in rows), rows[0]["failure"]
    assert all(len(r["metadata"]["steps"]) >= 1 and r["task"]["steps"] for r in rows)
    assert all("files" in r["task"]["steps"][0]["checks"][0] for r in rows)
    assert all(isinstance(f, dict) and "sha256" in f for r in rows
               for f in r["task"]["steps"][0]["checks"][0]["files"].values())  # kept by hash, not contents


@pytest.mark.parametrize("plant", ["ln -s /etc/passwd /app/ABOUT.txt", "ln -s /etc /app/ABOUT.txt"],
                         ids=["file-link", "folder-link"])
def test_a_link_the_policy_plants_where_a_step_puts_its_files_leads_root_nowhere(plant, run_id, docker_client):
    """A step's workdir/ files land in the policy's working directory. Written and handed over by root, a link the
    policy left in step 1 where step 2's ABOUT.txt goes made root write the step's text into /etc/passwd (the user
    database gone: the set-up's own `chown` then failed on it). The files are now written as the agent (a link leads
    only where it could write already; only the step's setup.sh runs as root), and a step whose set-up fails on what
    the policy left scores 0, never a skipped step (under "final" the step before's 1 would have been the reward)."""
    from dataclasses import replace

    from sandforge.types import ToolCall

    task = load_task(TWO_STEP, "hardened")
    [(name, context)] = load_tasks(TWO_STEP, "hardened")[1].items()
    image = build_images([], client=docker_client, show_progress=False, contexts={name: context})[name]
    seen = []

    class Watched(HarborEnv):
        def close(self):
            if self._sandbox is not None:
                seen.append(self._sandbox.exec("stat -c '%U %s' /etc/passwd /etc; head -c 100 /etc/passwd",
                                               timeout=30, user="root", session=False).output)
            super().close()

    env = Watched(task, sandbox_spec(SandboxConfig(), image, HarborEnv, task.sandbox, docker_client), run_id,
                  exec_timeout=30, client=docker_client)
    plan = [ToolCall("bash", {"command": f"{plant}; printf 'pear\\napple\\nfig\\n' > /app/notes.txt"}),
            ToolCall("submit"), *task.solution[2:]]
    limits = EpisodeLimits(max_turns=3, max_context=16384, max_new_tokens=4096, stop_ids=CHAT.stop_ids)
    traj = asyncio.run(run_episode(task, env, scripted_policy(replace(task, solution=plan), CHAT), CHAT, limits,
                                   group="g"))
    assert not traj.failed, traj.failure
    [after] = seen
    owners = after.split("\n")[:2]
    assert [o.split()[0] for o in owners] == ["root", "root"] and "root:x:0:0" in after and "fruit" not in after, after
    assert traj.reward.value == 0.0 and traj.reward.zero_causes == ["state"], traj.reward
    assert [s["name"] for s in traj.metadata["steps"]] == ["write-notes", "sort-notes"]
