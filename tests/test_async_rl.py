"""Async RL (trainer.mode async): admission control bounds staleness, the engine swaps weights under running
sequences (partial rollouts, tokens tagged with the version that sampled them), and a tiny async run completes."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engine import peaky_k3, request, serve

from sandforge.models.sampling import SamplingParams
from sandforge.engine.naive import generate_batch_naive
from sandforge.job.async_loop import admits, episode_staleness

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_admission_lets_an_episode_start_only_within_max_staleness_of_its_batch():
    # the batch trained at version 5 may start at versions 4 and 5 with max_staleness 1, from 5 on with 0
    assert [admits(5, v, 1) for v in (2, 3, 4, 5, 6)] == [False, False, True, True, True]
    assert [admits(5, v, 0) for v in (4, 5)] == [False, True]
    assert admits(5, 2, 3) and not admits(5, 1, 3)
    # whatever it ran on after it started, an admitted episode is at most max_staleness old when it is consumed
    for max_staleness in range(4):
        for current in range(10):
            if admits(7, current, max_staleness):
                assert episode_staleness(7, [-1, current, current + 1, -1]) <= max_staleness


def test_episode_staleness_counts_its_oldest_policy_token():
    assert episode_staleness(6, [-1, -1, 4, 4, -1, 5, 6]) == 2
    assert episode_staleness(6, [-1, -1]) == 0  # no policy token: nothing stale


def test_weights_swapped_mid_generation_continue_on_the_new_weights():
    """A generation running when interrupting weights arrive goes on under them: the tokens before the switch are
    the old policy's greedy tokens, the ones after are the new policy's greedy continuation of that prefix, and
    ``token_versions`` says which sampled which."""
    old, new = peaky_k3(seed=7), peaky_k3(seed=8)
    prompt = [4, 5, 6, 7]

    async def fn(engine):
        assert await engine.load_weights(old.state_dict(), 1) == 1
        running = asyncio.ensure_future(engine.generate(request(prompt, session_id="s", max_tokens=80)))
        while engine.stats()["generated_tokens"] < 3 and not running.done():
            await asyncio.sleep(0.001)
        assert await engine.load_weights(new.state_dict(), 2, interrupt=True) == 2
        [out] = await running
        return out

    out, stats = serve(peaky_k3(seed=0), fn)
    ids, versions = out.token_ids, out.token_versions
    switch = versions.count(1)
    assert 0 < switch < len(ids), "the load should land mid-generation"
    assert versions == [1] * switch + [2] * (len(ids) - switch)
    assert out.version == 1 and stats["version"] == 2 and stats["interrupted_rows"] == 1
    assert ids[:switch] == generate_batch_naive(old, [prompt], SamplingParams(switch, temperature=0.0))[0].token_ids
    rest = generate_batch_naive(new, [prompt + ids[:switch]], SamplingParams(len(ids) - switch, temperature=0.0))[0]
    assert ids[switch:] == rest.token_ids
    torch.testing.assert_close(torch.tensor(out.logprobs[switch:]), torch.tensor(rest.logprobs), atol=1e-4, rtol=0)
    # the old weights would have continued differently: the switch is visible in the tokens, not only in the tags
    again = generate_batch_naive(old, [prompt], SamplingParams(len(ids), temperature=0.0))[0].token_ids
    assert again != ids


@pytest.mark.docker
@pytest.mark.slow
def test_a_tiny_async_run_completes_with_bounded_staleness(tmp_path, terminal_image):
    out = tmp_path / "run"
    overrides = ["trainer.mode=async", "trainer.max_staleness=1", "trainer.steps=3", "warmup.steps=0",
                 "rollout.workers=1", "rollout.concurrency=4", "rollout.tasks_per_step=1", "rollout.group_size=2",
                 "rollout.max_turns=2", "rollout.max_new_tokens=24", "logging.wandb.mode=disabled",
                 f"run.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "train", "configs/terminal.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert len(steps) == 3
    assert all(r["async/staleness_max"] <= 1 for r in steps)
    assert [r["policy/version"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 0 <= r["time/trainer_idle_frac"] <= 1 and 0 <= r["time/engine_idle_frac"] <= 1
        assert sum(v for k, v in r.items() if k.startswith("async/staleness_count_")) == 2  # every episode, once
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 3 * 2


@pytest.mark.docker
def test_terminal_setup_commands_run_in_the_sandbox_before_the_episode(terminal_spec, run_id, docker_client):
    """The bench's slow environment: a task's setup commands run at reset (a failing one fails the episode)."""
    from containers import list_run_containers
    from sandforge.environments.terminal.env import TerminalEnv
    from sandforge.types import SandboxError, Task

    task = Task(id="t/1", env="terminal", family="setup", seed=1, instruction="look",
                setup={"files": {"a.txt": "x"}, "commands": ["cat a.txt > boot.txt; echo up >> boot.txt"]})
    env = TerminalEnv(task, terminal_spec, run_id, client=docker_client)
    try:
        env.reset()
        assert env.sandbox.exec("cat /workspace/boot.txt").output == "xup\n"
    finally:
        env.close()
    broken = Task(id="t/2", env="terminal", family="setup", seed=2, instruction="look", setup={"commands": ["exit 3"]})
    env = TerminalEnv(broken, terminal_spec, run_id, client=docker_client)
    with pytest.raises(SandboxError, match="exited 3"):
        env.reset()
    assert list_run_containers(run_id, client=docker_client) == []
