"""job/rl_job.py's group selection and reward-to-advantage path (issue #31): dynamic sampling keyed on success with a
bounded number of refills, and trainer.reward_signal from the verifier's Reward to each policy token's advantage.
No fleet: a job without one, whose rollouts are scripted rewards."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandforge.config import ConfigError, JobConfig, TrainerConfig, load_config
from sandforge.job.rl_job import RLJob
from sandforge.trainer.algorithms import resolve
from sandforge.types import Reward, Task, Trajectory

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"

ALL_FAIL = [0.30, 0.30, 0.30, 0.338]  # the quickstart's all-fail group: a capitalised copy scored 0.338
ONE_WIN = [1.0, 0.30, 0.30, 0.338]


def script(t: Task | Trajectory) -> str:
    return (t.task if isinstance(t, Trajectory) else t).id.split("-")[0]


def episode(task: Task, group: str, value: float, failed: bool = False, policy_tokens: int = 2) -> Trajectory:
    """A prompt token, then ``policy_tokens`` of the policy's; success is the exact answer, 1.0."""
    n = 1 + policy_tokens
    return Trajectory(task=task, group=group, token_ids=list(range(n)), loss_mask=[0] + [1] * policy_tokens,
                      logprobs=[0.0] + [-1.0] * policy_tokens, reward=Reward(value, success=value == 1.0),
                      failed=failed)


def job_without_fleet(scripts: dict[str, list[float]], tasks_per_step: int = 1, failed: int = -1, **trainer) -> RLJob:
    """An RLJob whose task sampler draws ``scripts``' task ids in turn and whose rollouts give each group the rewards of
    its task's script (episode ``failed`` of every group failed in infrastructure); ``job.rounds`` records each
    round's task ids."""
    cfg = JobConfig.model_validate({"rollout": {"tasks_per_step": tasks_per_step, "group_size": 4},
                                    "trainer": trainer})
    job = RLJob.__new__(RLJob)
    job.cfg, job.settings, job.rounds = cfg, resolve(cfg.trainer, 8), []
    order = iter(list(scripts) * 100)
    drawn = iter(range(1000))

    class Sampler:  # task ids "<script>-<n>": distinct within a round, as the real sampler's are
        def sample(self, n):
            return [Task(id=f"{next(order)}-{next(drawn)}", env="terminal", family="f", seed=0, instruction="")
                    for _ in range(n)]

    def collect(tasks, groups, scripted, label):
        job.rounds.append(sorted({script(t) for t in tasks}))
        seen: dict[str, int] = {}
        out = []
        for task, group in zip(tasks, groups):
            k = seen[group] = seen.get(group, -1) + 1
            out.append(episode(task, group, scripts[script(task)][k], failed=k == failed))
        return out

    job.sampler, job.collect = Sampler(), collect
    return job


# ---------------------------------------------------------------- dynamic sampling
def test_dynamic_sampling_drops_the_all_fail_partial_credit_group_and_keeps_the_one_with_a_success():
    job = job_without_fleet({"fail": ALL_FAIL, "win": ONE_WIN}, tasks_per_step=2, dynamic_sampling=True)
    trajs, keep, metrics = job.sample_groups(0)
    assert job.rounds[0] == ["fail", "win"]
    # round 2 draws one task to refill with, "fail" again (dropped), round 3 "win"
    assert job.rounds == [["fail", "win"], ["fail"], ["win"]]
    assert {script(t) for t in keep} == {"win"} and len(keep) == 8
    assert metrics == {"dapo/filtered_groups": 2, "dapo/rounds": 3}
    # keyed on raw rewards (the old test), the all-fail group's 0.338 made it look informative
    job = job_without_fleet({"fail": ALL_FAIL, "win": ONE_WIN}, tasks_per_step=2, dynamic_sampling=True,
                            dynamic_sampling_on="reward")
    _, keep, metrics = job.sample_groups(0)
    assert {script(t) for t in keep} == {"fail", "win"} and metrics == {"dapo/filtered_groups": 0, "dapo/rounds": 1}


@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_dynamic_sampling_refills_at_most_max_rounds_times_and_then_trains_on_what_it_has(rounds):
    job = job_without_fleet({"fail": ALL_FAIL}, tasks_per_step=3, dynamic_sampling=True,
                            dynamic_sampling_max_rounds=rounds)
    trajs, keep, metrics = job.sample_groups(0)
    assert len(job.rounds) == rounds and metrics == {"dapo/filtered_groups": 3 * rounds, "dapo/rounds": rounds}
    assert keep == [] and len(trajs) == 3 * 4 * rounds  # every episode is still logged


def test_dynamic_sampling_refills_only_the_missing_groups_and_excludes_failed_episodes():
    # round 1: one informative group of two; round 2 draws one task, informative: done after 2 rounds
    job = job_without_fleet({"win": ONE_WIN, "fail": ALL_FAIL}, tasks_per_step=2, failed=2, dynamic_sampling=True)
    trajs, keep, metrics = job.sample_groups(0)
    assert [len(r) for r in job.rounds] == [2, 1] and metrics["dapo/rounds"] == 2
    assert all(not t.failed for t in keep) and len(keep) == 6  # two groups of 4, one failed episode each
    assert {t.group for t in keep} == {"0/win-0", "0.1/win-2"}  # a later round's groups are tagged with it


def test_without_dynamic_sampling_every_group_but_failed_episodes_trains():
    job = job_without_fleet({"fail": ALL_FAIL}, failed=0)
    _, keep, metrics = job.sample_groups(0)
    assert len(keep) == 3 and metrics == {} and len(job.rounds) == 1


# ---------------------------------------------------------------- reward to advantage
def advantages(reward_signal: str, values: list[float], lengths: list[int] | None = None, **trainer) -> list[float]:
    """Each episode's advantage (on its policy tokens) from rl_rows, for one group with these rewards."""
    job = job_without_fleet({}, reward_signal=reward_signal, **trainer)
    task = Task(id="t", env="terminal", family="f", seed=0, instruction="")
    lengths = lengths or [2] * len(values)
    rows, _ = job.rl_rows([episode(task, "g", v, policy_tokens=n) for v, n in zip(values, lengths)])
    for row in rows:
        assert row.advantages[0] == 0.0 and len(set(row.advantages[1:])) == 1  # the prompt token is masked
    return [row.advantages[1] for row in rows]


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_reward_signal_success_gives_the_all_fail_group_nothing_and_tiebreak_only_a_nudge(algorithm):
    if algorithm == "grpo":  # the default: partial credit, std-normalised -> +-1.73
        assert advantages("reward", ALL_FAIL, algorithm=algorithm) == pytest.approx([-0.57735] * 3 + [1.73205],
                                                                                     abs=1e-3)
    assert advantages("success", ALL_FAIL, algorithm=algorithm) == [0.0] * 4
    tie = advantages("tiebreak", ALL_FAIL, algorithm=algorithm, tiebreak_weight=0.1)
    assert tie == pytest.approx([-0.00095] * 3 + [0.00285], abs=1e-9)
    won = advantages("tiebreak", ONE_WIN, algorithm=algorithm, tiebreak_weight=0.1)
    assert won[0] > max(won[1:]) and won[3] > won[1] == won[2]


@pytest.mark.parametrize("signal", ["success", "tiebreak"])
def test_an_overlong_success_levelled_with_the_failures_is_not_overtaken_by_partial_credit(signal):
    # budget 8 (job_without_fleet), buffer 4: the success's 8 policy tokens cost it the whole penalty, 1.0
    assert advantages(signal, ONE_WIN, [8, 2, 2, 2], overlong_buffer=0)[0] > 0
    assert advantages(signal, ONE_WIN, [8, 2, 2, 2], overlong_buffer=4) == [0.0] * 4


# ---------------------------------------------------------------- the keys
def test_the_keys_load_and_fail_fast_with_the_key_named():
    cfg = load_config(QUICKSTART, ["trainer.reward_signal=tiebreak", "trainer.tiebreak_weight=0.05",
                                   "trainer.dynamic_sampling_on=reward"])
    assert (cfg.trainer.reward_signal, cfg.trainer.tiebreak_weight, cfg.trainer.dynamic_sampling_on) == (
        "tiebreak", 0.05, "reward")
    t = TrainerConfig()
    assert (t.reward_signal, t.tiebreak_weight, t.dynamic_sampling_on) == ("reward", 0.1, "success")
    with pytest.raises(ConfigError, match=r"'trainer.reward_signal'.*ppo"):
        load_config(QUICKSTART, ["trainer.algorithm=ppo", "trainer.reward_signal=tiebreak"])
    with pytest.raises(ConfigError, match="'trainer.tiebreak_weight'"):
        load_config(QUICKSTART, ["trainer.tiebreak_weight=0.9"])
    with pytest.raises(ConfigError, match="'trainer.dynamic_sampling_on'"):
        load_config(QUICKSTART, ["trainer.dynamic_sampling_on=value"])
