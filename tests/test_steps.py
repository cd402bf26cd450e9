"""Multi-step tasks (rollout/steps.py): each step in a fresh context of its own, graded as it ends, a reward gate that
stops the episode, and the episode's reward made from the steps' (Harbor's mean or final)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from agent_fakes import CHAT, TASK, FakeEnv, ReplayPolicy, limits, reply

from sandforge.rollout.agent import run_episode
from sandforge.rollout.steps import StepResult, combine, step_task
from sandforge.types import Reward, Task, TaskStep, ToolCall


def steps_task(values: list[float], gates: list[float | None] | None = None, strategy: str = "mean") -> Task:
    """A task of len(values) steps; step i's check says the reward the fake grader gives it."""
    gates = gates or [None] * len(values)
    steps = [TaskStep(f"s{i}", f"Step {i}: do thing {i}.", [{"verifier": "fake", "value": v}], min_reward=g)
             for i, (v, g) in enumerate(zip(values, gates))]
    return dataclasses.replace(TASK, instruction=steps[0].instruction, checks=steps[-1].checks, steps=steps,
                               step_reward=strategy)


graded: list[str] = []


def fake_score(sandbox, task) -> Reward:
    """The step's own check, read: what it says is what it scores (and the instruction it was graded for)."""
    assert not task.steps and len(task.checks) == 1  # each step graded as a task of its own
    graded.append(task.instruction)
    value = task.checks[0]["value"]
    return Reward(value, value == 1.0, {"fake": value}, reason=f"scored {value}")


def run(task: Task, policy=None):
    graded.clear()
    policy = policy or ReplayPolicy([reply(ToolCall("echo", {"text": "hi"})), reply(ToolCall("submit"))] * 3)
    traj = asyncio.run(run_episode(task, FakeEnv(), policy, CHAT, limits(), "g", session_id="g/0",
                                   score=fake_score))
    return traj, policy


def test_each_step_runs_in_a_fresh_context_of_its_own_and_is_graded_as_it_ends():
    traj, policy = run(steps_task([1.0, 0.0, 1.0]))
    assert not traj.failed, traj.failure
    assert graded == ["Step 0: do thing 0.", "Step 1: do thing 1.", "Step 2: do thing 2."]
    rows = traj.rows()
    assert len(rows) == 3 and len(traj.earlier_rows) == 2
    for i, row in enumerate(rows):  # each row is its step's prompt and turns, nothing of another step's
        text = CHAT.tokenizer.decode(row.token_ids)
        assert f"Step {i}:" in text and all(f"Step {j}:" not in text for j in range(3) if j != i), text
        assert sum(row.loss_mask) > 0 and len(row.token_ids) == len(row.loss_mask) == len(row.logprobs)
    firsts = [r.prompt_ids for r in policy.requests]
    assert [len(p) for p in firsts[::2]] == [len(CHAT.render_prompt(FakeEnv().tools, [
        dataclasses.replace(traj.messages[0], content=f"Step {i}: do thing {i}.")])) for i in range(3)]
    assert [r.session_id for r in policy.requests] == ["g/0"] * 2 + ["g/0/s1"] * 2 + ["g/0/s2"] * 2
    assert policy.closed == ["g/0", "g/0/s1", "g/0/s2"]  # each step's engine session closed as it ends
    assert traj.reward.value == pytest.approx(2 / 3) and not traj.reward.success
    assert traj.reward.breakdown["step/s1"] == 0.0 and traj.reward.breakdown["step/s2/fake"] == 1.0
    assert traj.metadata["steps"] == [{"name": "s0", "reward": 1.0, "success": True},
                                      {"name": "s1", "reward": 0.0, "success": False},
                                      {"name": "s2", "reward": 1.0, "success": True}]
    assert traj.finish_reason == "submit" and traj.response_tokens == sum(sum(r.loss_mask) for r in rows)


def test_a_step_below_its_min_reward_ends_the_episode_there():
    traj, _ = run(steps_task([1.0, 0.5, 1.0], gates=[None, 1.0, None]))
    assert graded == ["Step 0: do thing 0.", "Step 1: do thing 1."] and len(traj.rows()) == 2
    assert traj.reward.value == pytest.approx(0.75) and not traj.reward.success  # Harbor: the mean of those run
    assert "below its min_reward 1" in traj.reward.reason and "did not run" in traj.reward.reason
    passed, _ = run(steps_task([1.0, 1.0, 1.0], gates=[1.0, 1.0, None]))
    assert passed.reward.value == 1.0 and passed.reward.success and len(passed.rows()) == 3


def test_final_takes_the_last_steps_reward():
    traj, _ = run(steps_task([0.0, 0.0, 1.0], strategy="final"))
    assert traj.reward.value == 1.0 and traj.reward.success


def test_combine_and_step_task():
    task = steps_task([1.0, 0.0], strategy="mean")
    one, zero = Reward(1.0, True, {"a": 1.0}, "ok", []), Reward(0.0, False, {}, "no", ["missing"])
    mean = combine(task, [StepResult("s0", one), StepResult("s1", zero)])
    assert (mean.value, mean.success, mean.zero_causes) == (0.5, False, ["missing"])
    assert mean.reason == "s0: ok; s1: no" and mean.breakdown == {"step/s0": 1.0, "step/s1": 0.0, "step/s0/a": 1.0}
    cut = combine(task, [StepResult("s0", one)])
    assert (cut.value, cut.success) == (1.0, False) and "not run: s1" in cut.reason  # every step must run to succeed
    graded_as = step_task(task, 1)
    assert graded_as.checks == task.steps[1].checks and graded_as.steps == [] and graded_as.id == task.id
    with pytest.raises(ValueError, match="no step was graded"):
        combine(task, [])


def test_a_task_round_trips_with_its_steps_through_a_task_file(tmp_path):
    from seeded import dump_jsonl

    from sandforge.environments.task_sources import TaskSourceError, load_jsonl

    task = dataclasses.replace(steps_task([1.0, 1.0], gates=[1.0, None], strategy="final"), env="terminal")
    dump_jsonl([task], tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl", env="terminal") == [task]
    bad = (tmp_path / "t.jsonl").read_text().replace('"min_reward": 1.0', '"min_reward": "high"')
    (tmp_path / "bad.jsonl").write_text(bad)
    with pytest.raises(TaskSourceError, match=r"bad.jsonl line 1: steps\[0\]: 'min_reward' has the wrong type"):
        load_jsonl(tmp_path / "bad.jsonl", env="terminal")
