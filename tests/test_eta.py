"""The run ETA (job/eta.py): the plan counts the work a config asks for; the clock prices it by what it measured."""

from __future__ import annotations

from sandforge.config import JobConfig
from sandforge.job.eta import PRIORS, REFERENCE_FORWARD, RunClock, RunPlan, eval_episodes


def job(**sections) -> JobConfig:
    base = {"environments": [{"name": "terminal", "families": ["write_file", "count_words"]}],
            "rollout": {"tasks_per_step": 3, "group_size": 4},
            "warmup": {"steps": 50, "episodes": 16},
            "eval": {"tasks_per_family": 2, "samples": 3, "every": 5},
            "trainer": {"steps": 12}}
    return JobConfig.model_validate({**base, **sections})


def test_the_plan_counts_every_kind_of_work():
    cfg = job()
    assert eval_episodes(cfg) == 2 * 2 * 3  # families x tasks x samples
    plan = RunPlan.of(cfg)
    # evaluations: before RL, after steps 5 and 10, at the end (12)
    assert plan.units == {"pretrain": 0, "scripted": 16, "sft": 50, "base": 0, "episode": 12 * 12 + 4 * 12,
                          "update": 12}
    assert RunPlan.of(cfg, sft_only=True).units == {"pretrain": 0, "scripted": 16, "sft": 50, "base": 0, "episode": 0,
                                                    "update": 0}
    resumed = RunPlan.of(cfg, start=10, warm=False)  # after step 10: steps 11, 12 and the last evaluation (+ before)
    assert resumed.units == {"pretrain": 0, "scripted": 0, "sft": 0, "base": 0, "episode": 2 * 12 + 2 * 12,
                             "update": 2}
    more = RunPlan.of(job(eval={"tasks_per_family": 2, "samples": 3, "every": 5, "greedy": True, "base": True}))
    # each evaluation greedy as well; the base evaluation's episodes are a kind of their own
    assert (more.units["episode"], more.units["base"]) == (12 * 12 + 4 * 2 * 2 * 4, 2 * 2 * 4)
    smaller_base = RunPlan.of(job(eval={"tasks_per_family": 2, "samples": 3, "every": 5, "greedy": True, "base": True,
                                        "base_tasks_per_family": 1}))
    assert smaller_base.units["base"] == 2 * 1 * 4  # its one task per family
    fewer_samples = RunPlan.of(job(eval={"tasks_per_family": 2, "samples": 3, "every": 5, "greedy": True, "base": True,
                                         "base_tasks_per_family": 1, "base_samples": 1}))
    assert fewer_samples.units["base"] == 2 * 1 * 2  # one sampled episode a task and the greedy one
    assert fewer_samples.units["episode"] == more.units["episode"]  # the others' samples as configured
    no_eval = RunPlan.of(job(eval={"tasks_per_family": 0}), warm=False)
    assert no_eval.units["episode"] == 12 * 12


def test_the_clock_prices_the_rest_by_what_it_measured():
    clock = RunClock(RunPlan({"scripted": 10, "sft": 100, "episode": 40, "update": 4}))
    before = clock.remaining()
    assert before == 10 * PRIORS["scripted"] + 100 * PRIORS["sft"] + 40 * PRIORS["episode"] + 4 * PRIORS["update"]
    clock.add("scripted", 10, 5.0)  # 0.5 s each, all done
    clock.add("sft", 20, 60.0)  # 3 s each, 80 left
    assert clock.cost("sft") == 3.0
    assert clock.remaining() == 80 * 3.0 + 40 * PRIORS["episode"] + 4 * PRIORS["update"]
    clock.add("episode", 50, 50.0)  # more than planned (dynamic sampling): nothing left of it, never negative
    assert clock.remaining() == 80 * 3.0 + 4 * PRIORS["update"]
    assert "min left" in clock.line()


def test_the_base_evaluations_episodes_do_not_price_the_trained_policys():
    """A pretrained policy that cannot call the tools runs every episode to its limits: 30 of them at 9.6 s each must
    not price the 468 episodes of a trained policy that follow (a run once read "about 105 min left" with 35 to go)."""
    clock = RunClock(RunPlan({"base": 30, "episode": 468, "update": 12}))
    clock.add("base", 30, 288.0)
    assert clock.remaining() == 468 * PRIORS["episode"] + 12 * PRIORS["update"]
    clock.add("episode", 180, 500.0)
    assert clock.remaining() == 288 * 500.0 / 180 + 12 * PRIORS["update"]


def test_the_jobs_base_evaluation_is_priced_as_its_own_kind(monkeypatch, tmp_path):
    """RLJob.evaluate(base=True) feeds the clock "base" units; a later held-out evaluation feeds "episode" ones."""
    from types import SimpleNamespace

    from sandforge.job import rl_job
    from sandforge.job.task_sampler import TaskSampler
    from sandforge.types import Reward, Trajectory

    def episodes(workers, tasks, groups, *args):
        return [Trajectory(task=t, group=g, reward=Reward(0.0, False)) for t, g in zip(tasks, groups)]

    monkeypatch.setattr(rl_job, "collect_episodes", episodes)
    cfg = job(eval={"tasks_per_family": 1, "samples": 2, "base": True})
    quiet = SimpleNamespace(console=SimpleNamespace(print=lambda *a, **k: None))
    logger = SimpleNamespace(log_trajectories=lambda *a: None, log=lambda *a: None)
    job_ = rl_job.RLJob.__new__(rl_job.RLJob)
    job_.cfg, job_.fleet, job_.logger, job_.bar, job_.version = cfg, SimpleNamespace(workers=[]), logger, quiet, 0
    job_.sampler = TaskSampler(cfg.environments, cfg.run.seed)
    job_.clock = RunClock(RunPlan.of(cfg))
    job_.evaluate(0, base=True)
    assert job_.clock.done == {"base": 2 * 2}
    job_.evaluate(0)
    assert job_.clock.done == {"base": 2 * 2, "episode": 2 * 2}
    job_.cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"base_samples": 1})})
    job_.clock = RunClock(RunPlan.of(job_.cfg))
    job_.evaluate(0, base=True)  # eval.base_samples: one sampled episode of each of its tasks
    job_.evaluate(0)
    assert job_.clock.done == {"base": 2 * 1, "episode": 2 * 2}


def test_an_update_not_yet_measured_is_priced_from_the_warm_starts_sft_steps():
    """After the warm start the trainer's cost per episode is known: the RL updates still ahead are priced from it
    (the quickstart's 12 updates took 23-52 s each where the prior says 4, and the line after its warm start read
    "about 19 min left" with 31 to go)."""
    cfg = job(rollout={"tasks_per_step": 6, "group_size": 4}, warmup={"steps": 32, "episodes": 256, "batch_size": 8},
              trainer={"steps": 12, "kl_coef": 0.05, "log_kl": False})
    plan = RunPlan.of(cfg)
    assert plan.update_in_sft_steps == 24 / 8 * REFERENCE_FORWARD  # 3 SFT batches of episodes, with the reference
    no_reference = RunPlan.of(job(rollout={"tasks_per_step": 6, "group_size": 4},
                                  warmup={"steps": 32, "episodes": 256, "batch_size": 8},
                                  trainer={"steps": 12, "kl_coef": 0.0, "log_kl": False, "epochs": 2}))
    assert no_reference.update_in_sft_steps == 24 / 8 * 2  # two PPO passes over the batch, no reference forward
    clock = RunClock(plan)
    assert clock.cost("update") == PRIORS["update"]  # nothing measured yet
    clock.add("sft", 32, 32 * 8.8)
    assert clock.cost("update") == 8.8 * plan.update_in_sft_steps
    clock.add("update", 1, 30.0)  # the update's own measurement wins
    assert clock.cost("update") == 30.0
    resumed = RunClock(RunPlan.of(cfg, start=4, warm=False))  # no warm start in this run: the prior
    resumed.add("episode", 24, 48.0)
    assert resumed.plan.update_in_sft_steps == 0.0 and resumed.cost("update") == PRIORS["update"]
