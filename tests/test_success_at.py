"""An environment's ``success_at`` (#55): for a continuous reward, the reward at or above which an episode counts as a
success, on training and held-out tasks alike; the verifiers' own verdict without it."""

from __future__ import annotations

from sandforge.config import EnvironmentConfig
from sandforge.job.evaluation import heldout_tasks
from sandforge.job.task_sampler import TaskSampler
from sandforge.rollout.worker import at_threshold
from sandforge.types import Reward, Task, Trajectory


def test_training_and_held_out_tasks_carry_the_environments_threshold():
    envs = [EnvironmentConfig(name="terminal", success_at=0.5), EnvironmentConfig(name="slack")]
    drawn = TaskSampler(envs, seed=0).sample(40)
    assert {t.success_at for t in drawn if t.env == "terminal"} == {0.5}
    assert {t.success_at for t in drawn if t.env == "slack"} == {None}
    held = heldout_tasks(envs, 1)
    assert {t.success_at for t in held if t.env == "terminal"} == {0.5}
    t = next(t for t in drawn if t.env == "terminal")
    assert Task.from_dict(Trajectory(task=t, group="g").to_dict()["task"]).success_at == 0.5  # travels to workers


def test_a_graded_episode_succeeds_at_the_threshold():
    def graded(value, success_at, failed=False):
        task = Task(id="t", env="vf", family="f", seed=0, instruction="", success_at=success_at)
        traj = Trajectory(task=task, group="g", reward=Reward(value, False), failed=failed)
        at_threshold(traj)
        return traj.reward.success

    assert graded(0.6, 0.5) and graded(0.5, 0.5) and not graded(0.49, 0.5)
    assert not graded(0.9, None)  # no threshold: the verifiers' verdict stands
    assert not graded(0.9, 0.5, failed=True)  # a failed episode never succeeds


def test_task_files_carry_the_threshold_and_refuse_a_bad_one(tmp_path):
    """A task written with ``write_jsonl`` (success_at included) reads back; a threshold out of (0, 1] or not a number
    is an error naming the file and line."""
    import json
    from dataclasses import asdict

    import pytest

    from sandforge.environments.task_sources import TaskSourceError, load_jsonl

    task = Task(id="t", env="terminal", family="f", seed=0, instruction="do", checks=[{"verifier": "file_exists",
                                                                                        "path": "/a"}])
    path = tmp_path / "tasks.jsonl"
    for value, ok in ((None, True), (0.5, True), (1, True), (1.5, False), ("high", False), (True, False)):
        path.write_text(json.dumps({**asdict(task), "success_at": value}) + "\n")
        if ok:
            assert load_jsonl(path)[0].success_at == value
        else:
            with pytest.raises(TaskSourceError, match="tasks.jsonl.* 'success_at' must"):
                load_jsonl(path)
