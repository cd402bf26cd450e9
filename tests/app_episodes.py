"""The mock-app envs (slack, notion) on real containers, for their tests: a spec of the apps image they share, one
episode through the real agent loop, one tool call, and one training step of a shipped config."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from agent_fakes import CHAT, limits

from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall, Trajectory

ROOT = Path(__file__).resolve().parents[1]
ONE_STEP = ["trainer.steps=1", "warmup.steps=0", "rollout.workers=1", "rollout.concurrency=2",
            "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=16",
            "logging.wandb.mode=disabled"]


def app_spec(client, env_class: type) -> SandboxSpec:
    """The apps image (built if its sources changed) with what ``env_class`` asks of its sandboxes."""
    image = build_images(["apps"], client=client, show_progress=False)["apps"]
    return SandboxSpec(image=image, memory="256m", **env_class.sandbox_defaults)


def episode(env_class: type, task, spec, run_id, client, solution=None) -> Trajectory:
    """One episode through the real agent loop, replaying ``solution`` (default: the task's reference solution)."""
    replayed = task if solution is None else dataclasses.replace(task, solution=solution)
    env = env_class(task, spec, run_id, client=client)
    traj = asyncio.run(run_episode(task, env, scripted_policy(replayed, CHAT), CHAT, limits(max_turns=8), "g"))
    assert not traj.failed, traj.failure
    return traj


def act(env, name: str, **args) -> str:
    """What the tool call ``name(**args)`` returned to the policy."""
    return env.step(ToolCall(name, args))[0]


def train_one_step(config: str, out: Path) -> list[dict]:
    """``sandforge train <config>`` for one small step into ``out``; the rows of its metrics.jsonl."""
    command = [sys.executable, "-m", "sandforge.job.cli", "train", config, *ONE_STEP, f"run.output_dir={out}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
