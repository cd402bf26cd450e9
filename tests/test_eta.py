"""The run ETA (job/eta.py): the plan counts the work a config asks for; the clock prices it by what it measured."""

from __future__ import annotations

from sandforge.config import JobConfig
from sandforge.job.eta import PRIORS, RunClock, RunPlan, eval_episodes


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
    assert plan.units == {"pretrain": 0, "scripted": 16, "sft": 50, "episode": 12 * 12 + 4 * 12, "update": 12}
    assert RunPlan.of(cfg, sft_only=True).units == {"pretrain": 0, "scripted": 16, "sft": 50, "episode": 0, "update": 0}
    resumed = RunPlan.of(cfg, start=10, warm=False)  # after step 10: steps 11, 12 and the last evaluation (+ before)
    assert resumed.units == {"pretrain": 0, "scripted": 0, "sft": 0, "episode": 2 * 12 + 2 * 12, "update": 2}
    more = RunPlan.of(job(eval={"tasks_per_family": 2, "samples": 3, "every": 5, "greedy": True, "base": True}))
    assert more.units["episode"] == 12 * 12 + 5 * 2 * 2 * 4  # the base evaluation too; each one greedy as well
    smaller_base = RunPlan.of(job(eval={"tasks_per_family": 2, "samples": 3, "every": 5, "greedy": True, "base": True,
                                        "base_tasks_per_family": 1}))
    assert smaller_base.units["episode"] == 12 * 12 + 4 * 2 * 2 * 4 + 2 * 1 * 4  # its one task per family
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
