"""A Harbor task folder written in a test's tmp_path, and its episodes graded through run_episode, the real Harbor
env and a real container, the policy a non-root user (hardened) running the commands it is given."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from agent_fakes import CHAT, limits

from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

TEST_DONE = "def test_done():\n    assert open('/workspace/done.txt').read().strip() == 'done'\n"


def harbor_task(tmp_path, image, test_sh, tests=None, instruction="Write done into /workspace/done.txt.\n",
                verifier_env=""):
    """A Harbor task folder in tmp_path: its instruction, task.toml, test.sh and tests/ files."""
    from sandforge.environments.harbor.tasks import load_tasks

    task_dir = tmp_path / "task"
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "instruction.md").write_text(instruction)
    (task_dir / "task.toml").write_text(f'version = "2.0"\n[environment]\ndocker_image = "{image}"\n'
                                        f'[verifier]\ntimeout_sec = 60\n{verifier_env}')
    for rel, text in {"test_outputs.py": TEST_DONE, **(tests or {}), "test.sh": test_sh}.items():
        (task_dir / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / "tests" / rel).write_text(text)
    [task], images = load_tasks(task_dir, "hardened")
    return task, images


def grader(task, images, run_id, client):
    """run(commands): one episode of ``task`` whose policy runs ``commands`` and submits; its trajectory."""
    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.job_spec import sandbox_spec

    tags = build_images([], client=client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, client)

    def run(*commands):
        env = HarborEnv(task, spec, run_id, exec_timeout=20, client=client)
        calls = [ToolCall("bash", {"command": c}) for c in commands] + [ToolCall("submit")]
        scripted = replace(task, solution=calls)
        traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=6), "g"))
        assert not traj.failed, traj.failure
        return traj

    return run


def write(path, text):
    return f"mkdir -p $(dirname {path}) && printf %s {quoted(text)} > {path}"


def quoted(text):
    return "'" + text.replace("'", "'\\''") + "'"
