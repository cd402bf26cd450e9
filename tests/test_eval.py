"""Held-out evaluation (job/evaluation.py), `sandforge sft` and `sandforge eval`, and a run's eval.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.config import EnvironmentConfig, JobConfig
from sandforge.job.eval_compare import paired, paired_difference
from sandforge.job.eval_summary import EvalSummary, pass_at_k, summarize
from sandforge.job.evaluation import EvalRecord, eval_summary, evaluation, heldout_tasks, metric_row
from sandforge.types import Reward, Task, Trajectory

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)


def _traj(env: str, task: str, success: bool, failed: bool = False) -> Trajectory:
    t = Trajectory(task=Task(id=task, env=env, family="f", seed=0, instruction="", split="heldout"), group="g")
    t.failed = failed
    t.reward = Reward(value=float(success), success=success and not failed)
    return t


def test_summary_per_environment_counts_failed_episodes_as_failures():
    trajs = ([_traj("terminal", "a", s) for s in (True, False, False, False)]
             + [_traj("terminal", "b", False) for _ in range(4)]
             + [_traj("repo", "c", True), _traj("repo", "c", True, failed=True), _traj("repo", "c", False),
                _traj("repo", "c", True)])
    s = summarize(trajs, k=4)
    assert s.per_env["terminal"].to_json() == {
        "success": 0.125, "pass@k": 0.5, "tasks": 2, "episodes": 8, "failed": 0,
        "stderr": pytest.approx((0.125 * 0.875 / 7) ** 0.5), "reward": 0.125, "reward_stderr": pytest.approx(0.125)}
    assert s.per_env["repo"].success == 0.5 and s.per_env["repo"].failed == 1
    assert s.per_env["repo"].reward == 0.5  # the failed episode's 1.0 counts 0, as its success does
    assert s.rates.success == pytest.approx(3 / 12) and s.rates.tasks == 3
    assert EvalSummary.from_json(json.loads(json.dumps(s.to_json()))) == s  # its JSON form reads back the same
    row = metric_row(s)
    assert row["eval/success/repo"] == 0.5 and row["eval/pass@k/terminal"] == 0.5 and row["eval/k"] == 4


def test_a_continuous_reward_is_reported_beside_success_and_paired(tmp_path):
    """#55: an environment whose reward is continuous read 0% -> 0% everywhere; the mean reward (with its standard
    error), its paired change over RL and the end-of-run summary carry it beside success."""
    def run(values):
        trajs = []
        for task, vs in values.items():
            for v in vs:
                t = Trajectory(task=Task(id=task, env="vf", family="f", seed=0, instruction="", split="heldout"),
                               group="g")
                t.reward = Reward(value=v, success=v >= 1.0)
                trajs.append(t)
        return summarize(trajs, k=2)

    before = run({"a": [0.1, 0.2], "b": [0.0, 0.1], "c": [0.3, 0.3]})
    after = run({"a": [0.5, 0.6], "b": [0.2, 0.2], "c": [0.4, 0.6]})
    assert before.rates.success == after.rates.success == 0.0
    assert after.rates.reward == pytest.approx((0.5 + 0.6 + 0.2 + 0.2 + 0.4 + 0.6) / 6)
    assert after.per_env["vf"].reward_stderr > 0 and metric_row(after)["eval/reward/vf"] == after.rates.reward
    pair = paired(after, before).reward
    assert pair.tasks == 3 and pair.mean_points == pytest.approx(100 * (0.4 + 0.15 + 0.2) / 3, abs=0.01)
    record = EvalRecord(tmp_path / "eval.json", k=2, per_family=3)
    record.add(before.at(step=0))
    record.add(after.at(step=5))
    text = eval_summary(record)
    assert f"mean reward: {before.rates.reward:.3f} -> {after.rates.reward:.3f}; RL's share +25.0" in text, text


def test_heldout_tasks_are_fixed_and_held_out():
    envs = [EnvironmentConfig(name="terminal")]
    a, b = heldout_tasks(envs, 3), heldout_tasks(envs, 3)
    assert [t.id for t in a] == [t.id for t in b] and len(a) == 3 * 2  # two terminal families
    assert all(t.split == "heldout" for t in a) and len({t.id for t in a}) == len(a)


def test_eval_record_before_after_and_resume(tmp_path):
    path = tmp_path / "eval.json"
    record = EvalRecord(path, k=2, per_family=1)
    for step, success in ((0, 0.1), (5, 0.3), (10, 0.6)):
        record.add(EvalSummary.from_json({"step": step, "success": success, "pass@k": success, "k": 2,
                                          "per_env": {"terminal": {"success": success}}}))
    saved = json.loads(path.read_text())
    assert saved["before"]["step"] == 0 and saved["after"]["step"] == 10
    assert saved["delta_points"] == {"success": 50.0, "per_env": {"terminal": 50.0}}
    resumed = EvalRecord(path, k=2, per_family=1)
    resumed.resume_from(5)  # a run resumed after step 5 redoes step 10's evaluation
    assert [h["step"] for h in json.loads(path.read_text())["history"]] == [0, 5]
    assert resumed.has(5) and not resumed.has(10)


def _summary(step: int, success: float, greedy: float | None = None, **envs: float) -> EvalSummary:
    out = {"step": step, "success": success, "pass@k": success, "k": 2,
           "per_env": {env: {"success": v, "pass@k": v} for env, v in envs.items()}}
    return EvalSummary.from_json(out | ({"greedy": _summary(step, greedy, **envs).to_json()} if greedy is not None
                                        else {}))


def test_eval_json_keeps_the_base_and_reports_rl_s_share_and_all_training_greedy_included(tmp_path):
    path = tmp_path / "eval.json"
    record = EvalRecord(path, k=2, per_family=1)
    record.set_base(_summary(0, 0.0, 0.0, terminal=0.0, repo=0.0).at(base=True))
    record.add(_summary(0, 0.4, 0.5, terminal=0.5, repo=0.3))  # after the warm start: RL begins here
    record.add(_summary(10, 0.6, 0.75, terminal=0.75, repo=0.45))
    saved = json.loads(path.read_text())
    assert saved["base"]["success"] == 0.0 and saved["before"]["step"] == 0 and saved["after"]["step"] == 10
    assert saved["delta_points"] == {"success": 20.0, "per_env": {"repo": 15.0, "terminal": 25.0}, "greedy": 25.0}
    assert saved["over_base"] == {"success": 60.0, "per_env": {"repo": 45.0, "terminal": 75.0}, "greedy": 75.0}
    again = EvalRecord(path, k=2, per_family=1)  # a resumed run keeps the base it measured
    again.resume_from(0)
    assert json.loads(path.read_text())["base"]["success"] == 0.0 and "over_base" in json.loads(path.read_text())
    again.add(EvalSummary.from_json(saved["after"]))  # the run's last evaluation, redone
    text = eval_summary(again)
    assert "0.0% pretrained base -> 40.0% after step 0 -> 60.0% after step 10" in text
    assert "greedy: 50.0% -> 75.0% (+25.0 points over RL)" in text
    row = metric_row(_summary(10, 0.6, 0.75, terminal=0.75))
    assert row["eval/greedy/success"] == 0.75 and row["eval/greedy/success/terminal"] == 0.75


def _eval_job(**eval_keys) -> JobConfig:
    return JobConfig.model_validate({"environments": [{"name": "terminal"}], "rollout": {"temperature": 1.0},
                                     "eval": {"tasks_per_family": 2, "samples": 3, "greedy": True, **eval_keys}})


def _fake_collect(calls: list):
    """collect() as the run's: every episode of the second task of each family wins, except greedy ones (group
    ``<tag>g/...``) of the first, which win too; records each call's temperatures, episode count and label; returns
    the episodes in an order of its own, as the workers finish them."""
    def collect(tasks, groups, scripted, label, temperature=None):
        calls.append((temperature, len(tasks), label))
        out = []
        for t, g in zip(tasks, groups):
            out.append(_traj(t.env, t.id, t.seed == 1 or g.split("/")[0].endswith("g")))
            out[-1].group = g
        return out[::-1]
    return collect


def test_eval_temperature_reaches_the_episodes_and_is_recorded():
    calls: list = []
    trajs, summary = evaluation(_eval_job(temperature=0.7), _fake_collect(calls), "eval0")
    # one pass of the workers: sampled at eval.temperature, greedy at 0, each episode with its own
    [(temperatures, n, label)] = calls
    assert n == 2 * 2 * 3 + 2 * 2 and temperatures == [0.7] * (2 * 2 * 3) + [0.0] * (2 * 2)
    assert label == "held-out eval at T=0.7: 4 tasks x 3, greedy: 4 tasks x 1"
    assert summary.temperature == 0.7 and summary.greedy.temperature == 0.0
    # the passes are told apart by group, whatever order the episodes came back in
    assert summary.rates.episodes == 12 and summary.greedy.rates.episodes == 4 and len(trajs) == 16
    assert summary.rates.success == 0.5 and summary.greedy.rates.success == 1.0
    calls.clear()
    _, summary = evaluation(_eval_job(), _fake_collect(calls), "eval0")  # unset: the rollout temperature, as before
    assert sorted(set(calls[0][0])) == [0.0, 1.0] and summary.temperature == 1.0
    with pytest.raises(ValueError, match="temperature"):
        _eval_job(temperature=-0.1)


def test_the_base_evaluation_can_take_fewer_tasks_everywhere():
    cfg = JobConfig.model_validate({"environments": [{"name": "terminal"}, {"name": "slack", "families": ["post_message"],
                                                                             "eval_tasks_per_family": 5}],
                                    "eval": {"tasks_per_family": 2, "samples": 3, "greedy": True, "base": True,
                                             "base_tasks_per_family": 1}})
    calls: list = []
    evaluation(cfg, _fake_collect(calls), "base", per_family=cfg.eval.base_tasks_per_family)
    assert [c[1] for c in calls] == [3 * 3 + 3]  # one task of each of 3 families (slack's 5 too), x 3 samples; greedy
    calls.clear()
    evaluation(cfg, _fake_collect(calls), "eval0")
    assert [c[1] for c in calls] == [(2 * 2 + 5) * 3 + 2 * 2 + 5]  # the others as configured
    calls.clear()
    _, summary = evaluation(cfg, _fake_collect(calls), "base", per_family=1, samples=1)  # eval.base_samples: 1
    assert [c[1] for c in calls] == [3 * 1 + 3]  # one sampled episode of each task, and the greedy one
    assert summary.rates.episodes == 3 and summary.greedy.rates.episodes == 3


def test_the_worker_samples_eval_episodes_at_the_temperature_it_is_given(monkeypatch):
    """The last hop: RolloutWorker.run_episodes gives its episodes limits at the requested temperature (no Docker:
    the worker's client is a stand-in and its episodes record their limits instead of running)."""
    import asyncio
    from dataclasses import asdict

    from sandforge.rollout import worker as worker_module

    monkeypatch.setattr(worker_module, "docker_client", lambda **_: None)
    job = JobConfig.model_validate({"rollout": {"temperature": 1.0}})
    setup = worker_module.WorkerSetup(run_id="t", engine="unused", images={}, labels={}, environments=(),
                                      rollout=job.rollout, sandbox=job.sandbox, model=job.model)
    w = worker_module.RolloutWorker(0, setup, engine=object())
    got: list[float] = []

    async def episode(task, group, version, scripted, seed=None, temperature=None):
        got.append(w.episode_limits(task.env, temperature).temperature)
        return {}

    monkeypatch.setattr(w, "_episode", episode)
    task = asdict(_traj("terminal", "a", False).task)
    for temperature in (0.7, 0.0, None):
        asyncio.run(w.run_episodes([task], ["g"], 0, temperature=temperature))
    assert got == [0.7, 0.0, 1.0]


def _library_worker(monkeypatch, job: dict):
    """A RolloutWorker of ``job`` without Docker whose episodes take the library (verifiers) path, stood in for: each
    records (env, the limits it was given) in the returned list and comes back as an empty trajectory."""
    from sandforge.rollout import worker as worker_module

    monkeypatch.setattr(worker_module, "docker_client", lambda **_: None)
    monkeypatch.setattr(worker_module.RolloutWorker, "_pool", lambda *args, **kwargs: None)  # no warm pools
    cfg = JobConfig.model_validate(job)
    setup = worker_module.WorkerSetup(run_id="t", engine="unused", images={}, labels={},
                                      environments=tuple(cfg.environments), rollout=cfg.rollout, sandbox=cfg.sandbox,
                                      model=cfg.model)
    w = worker_module.RolloutWorker(0, setup, engine=object())
    w.env_classes = {}  # every episode takes the library path
    got: list[tuple] = []

    async def vf_episode(task, envs, policy, chat, limits, *args, **kwargs):
        got.append((task.env, limits))
        return Trajectory(task=task, group="g")

    monkeypatch.setattr(worker_module, "run_vf_episode", vf_episode)
    return w, got


def test_an_environments_own_max_turns_bounds_its_episodes(monkeypatch):
    """``environments[].max_turns`` reaches the episodes of that environment, sampled or greedy, and no other's."""
    import asyncio
    from dataclasses import asdict

    w, got = _library_worker(monkeypatch, {"environments": [{"name": "terminal", "max_turns": 3}, {"name": "slack"}],
                                           "rollout": {"max_turns": 8}})
    tasks = [asdict(_traj(env, "a", False).task) for env in ("terminal", "slack")]
    asyncio.run(w.run_episodes(tasks, ["g1", "g2"], 0))
    asyncio.run(w.run_episodes(tasks[:1], ["g3"], 0, temperature=0.0))
    assert [(env, lim.max_turns, lim.temperature) for env, lim in got] == [("terminal", 3, 1.0), ("slack", 8, 1.0),
                                                                           ("terminal", 3, 0.0)]
    with pytest.raises(ValueError, match="max_turns"):
        JobConfig.model_validate({"environments": [{"name": "terminal", "max_turns": 0}]})


def test_an_environments_own_temperature_samples_its_rollouts_and_not_the_evaluation(monkeypatch):
    """``environments[].temperature`` is what RL rollouts of that environment sample at (others keep
    ``rollout.temperature``); a temperature given for held-out evaluation wins; each episode records the one it
    sampled at, for the trainer to score it under, and a scripted one records none."""
    import asyncio
    from dataclasses import asdict

    from sandforge.job.rl_job import training_rows
    from sandforge.rollout import worker as worker_module

    w, got = _library_worker(monkeypatch, {"environments": [{"name": "terminal", "temperature": 1.0},
                                                            {"name": "slack"}], "rollout": {"temperature": 0.7}})
    tasks = [asdict(_traj(env, "a", False).task) for env in ("terminal", "slack")]
    rl = asyncio.run(w.run_episodes(tasks, ["g1", "g2"], 0))
    held_out = asyncio.run(w.run_episodes(tasks, ["g3", "g4"], 0, temperature=0.7))
    greedy = asyncio.run(w.run_episodes(tasks[:1], ["g5"], 0, temperature=0.0))
    assert [(env, lim.temperature) for env, lim in got] == [("terminal", 1.0), ("slack", 0.7), ("terminal", 0.7),
                                                            ("slack", 0.7), ("terminal", 0.0)]
    assert [d["temperature"] for d in rl + held_out + greedy] == [1.0, 0.7, 0.7, 0.7, 0.0]
    rows = training_rows([Trajectory.from_dict(d) for d in rl])
    assert [r.temperature for r in rows] == [1.0, 0.7]
    monkeypatch.setattr(worker_module, "scripted_policy", lambda *args: None)
    assert asyncio.run(w.run_episodes(tasks[:1], ["g6"], 0, scripted=True))[0]["temperature"] is None
    with pytest.raises(ValueError, match="temperature"):
        JobConfig.model_validate({"environments": [{"name": "terminal", "temperature": -1}]})


def test_paired_difference_on_known_per_task_numbers():
    before = {"a": 0.0, "b": 0.5, "c": 0.25, "d": 1.0, "only_before": 0.5}
    after = {"a": 0.5, "b": 0.5, "c": 1.0, "d": 0.75, "only_after": 1.0}
    p = paired_difference(after, before)  # d = 50, 0, 75, -25 points
    sd = ((25 ** 2 + 25 ** 2 + 50 ** 2 + 50 ** 2) / 3) ** 0.5
    assert p.to_json() == {"mean_points": 25.0, "stderr_points": pytest.approx(round(sd / 2, 2)), "tasks": 4,
                           "left_out": 2}
    assert p.stderr_points == pytest.approx(22.82)
    one = paired_difference({"a": 1.0, "x": 0.0}, {"a": 0.25})  # one task in common: no standard error
    assert one.to_json() == {"mean_points": 75.0, "stderr_points": None, "tasks": 1, "left_out": 1}
    assert paired_difference({"x": 1.0}, {"y": 0.0}).mean_points is None


def _evaluated(wins: dict[str, tuple[str, list[bool]]]) -> EvalSummary:
    """A summary made from episodes: task id -> (env, each episode's success)."""
    trajs = [_traj(env, task, s) for task, (env, outcomes) in wins.items() for s in outcomes]
    return summarize(trajs, k=2)


def test_eval_json_pairs_before_and_after_task_by_task(tmp_path):
    before = _evaluated({"t/0": ("terminal", [False, False]), "t/1": ("terminal", [True, False]),
                         "t/2": ("terminal", [False, False]), "r/0": ("repo", [True, True]),
                         "r/gone": ("repo", [True, True])}).at(step=0)
    after = _evaluated({"t/0": ("terminal", [True, True]), "t/1": ("terminal", [True, False]),
                        "t/2": ("terminal", [True, False]), "r/0": ("repo", [False, True])}).at(step=10)
    before = before.at(greedy=_evaluated({"t/0": ("terminal", [False]), "t/1": ("terminal", [True])}))
    after = after.at(greedy=_evaluated({"t/0": ("terminal", [True]), "t/1": ("terminal", [True])}))
    assert before.to_json()["per_task"]["t/1"] == {"env": "terminal", "wins": 1, "episodes": 2, "reward_sum": 1.0}
    record = EvalRecord(tmp_path / "eval.json", k=2, per_family=3)
    record.add(before)
    record.add(after)
    saved = json.loads((tmp_path / "eval.json").read_text())
    p = saved["paired"]
    # per task, in points: t/0 +100, t/1 0, t/2 +50, r/0 -50; r/gone was measured before only
    d = [100.0, 0.0, 50.0, -50.0]
    sd = (sum((x - 25) ** 2 for x in d) / 3) ** 0.5
    assert p["success"] == {"mean_points": 25.0, "stderr_points": round(sd / 2, 2), "tasks": 4, "left_out": 1}
    assert p["per_env"]["terminal"]["mean_points"] == 50.0 and p["per_env"]["terminal"]["tasks"] == 3
    assert p["per_env"]["terminal"]["stderr_points"] == round(((50 ** 2 + 50 ** 2) / 2) ** 0.5 / 3 ** 0.5, 2)
    assert p["per_env"]["repo"] == {"mean_points": -50.0, "stderr_points": None, "tasks": 1, "left_out": 1}
    assert p["greedy"]["success"] == {"mean_points": 50.0, "stderr_points": 50.0, "tasks": 2, "left_out": 0}
    assert set(saved["delta_points"]) == {"success", "per_env", "greedy"}  # the unpaired numbers stay as they were
    text = eval_summary(EvalRecord(tmp_path / "eval.json", k=2, per_family=3))  # as a resumed run reads it back
    assert f"RL's share: +25.0 ± {round(sd / 2, 2):.1f} points (paired over 4 tasks; 1 measured once left out)" in text
    assert ("greedy: 50.0% -> 100.0% (+50.0 points over RL); RL's share +50.0 ± 50.0 points (paired over 2 tasks)"
            in text)
    assert "repo: 100.0% -> 50.0% (-50.0; RL's share -50.0 points (paired over 1 task" in text


def test_eval_json_headlines_the_environments_rl_trained_on(tmp_path):
    """Repo left to the warm start (rl_weight 0) is evaluated and reported, but RL's headline share is over the
    environments RL drew from."""
    before = _evaluated({"t/0": ("terminal", [False, False]), "t/1": ("terminal", [True, False]),
                         "s/0": ("slack", [False, True]), "r/0": ("repo", [False, False]),
                         "r/1": ("repo", [False, False])}).at(step=0)
    after = _evaluated({"t/0": ("terminal", [True, True]), "t/1": ("terminal", [True, False]),
                        "s/0": ("slack", [True, True]), "r/0": ("repo", [False, False]),
                        "r/1": ("repo", [False, False])}).at(step=12)
    before = before.at(greedy=_evaluated({"t/0": ("terminal", [False]), "s/0": ("slack", [True]),
                                          "r/0": ("repo", [False])}))
    after = after.at(greedy=_evaluated({"t/0": ("terminal", [True]), "s/0": ("slack", [True]),
                                        "r/0": ("repo", [False])}))
    record = EvalRecord(tmp_path / "eval.json", k=2, per_family=2, trained=["terminal", "slack"])
    record.add(before)
    record.add(after)
    saved = json.loads((tmp_path / "eval.json").read_text())
    head = saved["rl_trained"]
    assert head["environments"] == ["slack", "terminal"]
    assert head["before"] == pytest.approx(100 * 2 / 6, abs=0.01) and head["after"] == pytest.approx(100 * 5 / 6,
                                                                                                   abs=0.01)
    # per task, in points: t/0 +100, t/1 0, s/0 +50; the repo tasks (0 both times) are left out of it
    assert head["paired"]["mean_points"] == 50.0 and head["paired"]["tasks"] == 3
    assert saved["paired"]["success"]["tasks"] == 5 and saved["paired"]["success"]["mean_points"] == 30.0
    assert head["greedy"]["before"] == 50.0 and head["greedy"]["after"] == 100.0
    assert head["greedy"]["paired"] == {"mean_points": 50.0, "stderr_points": 50.0, "tasks": 2, "left_out": 0}
    assert "the environments RL trained on (slack, terminal): 33.3% -> 83.3%, RL's share +50.0" in eval_summary(record)
    # RL on every evaluated environment: the overall numbers are the headline, no second block
    everything = EvalRecord(tmp_path / "all.json", k=2, per_family=2, trained=["terminal", "slack", "repo"])
    everything.add(before)
    everything.add(after)
    assert "rl_trained" not in json.loads((tmp_path / "all.json").read_text())


def test_eval_against_an_earlier_evaluation_pairs_task_by_task(tmp_path):
    """``sandforge eval --against``: a checkpoint's summary compared with an earlier one's, task by task."""
    from sandforge.job.console import JobError
    from sandforge.job.evaluation import compared, read_against

    earlier = _evaluated({"t/0": ("terminal", [False, False]), "t/1": ("terminal", [True, False]),
                          "s/0": ("slack", [False, True])})
    now = _evaluated({"t/0": ("terminal", [True, True]), "t/1": ("terminal", [True, False]),
                      "s/0": ("slack", [True, True])})
    cmp = compared(now, earlier, "warm.json")
    assert cmp.paired.success.mean_points == 50.0 and cmp.paired.success.tasks == 3
    assert cmp.to_json()["delta_points"]["success"] == pytest.approx(100 * (5 / 6 - 2 / 6), abs=0.01)
    lines = cmp.lines()
    assert lines[0].startswith("against warm.json: +50.0 ± 28.9 points (paired over 3 tasks)")
    assert any(line.startswith("  terminal: +50.0") for line in lines)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"success": 0.5, "per_env": {}}))
    with pytest.raises(JobError, match="--against .*old.json: it holds no per-task results"):
        read_against(old)
    old.write_text(json.dumps({"success": "half", "per_env": {}}))
    with pytest.raises(JobError, match="cannot read it as an evaluation summary .*success must be a number"):
        read_against(old)


def test_an_environment_can_evaluate_more_or_fewer_tasks_than_the_eval():
    envs = [EnvironmentConfig(name="terminal"), EnvironmentConfig(name="slack", families=["post_message"], eval_tasks_per_family=5),
            EnvironmentConfig(name="notion", eval_tasks_per_family=0)]
    tasks = heldout_tasks(envs, 2)
    assert sum(t.env == "terminal" for t in tasks) == 2 * 2  # two families at the eval's 2
    assert sum(t.env == "slack" for t in tasks) == 5 and not any(t.env == "notion" for t in tasks)


def test_an_eval_json_without_per_task_results_has_no_paired_block(tmp_path):
    old = EvalSummary.from_json({"step": 0, "success": 0.5, "pass@k": 0.5, "k": 2,
                                 "per_env": {"terminal": {"success": 0.5}}})
    assert paired(old, old) is None
    record = EvalRecord(tmp_path / "eval.json", k=2, per_family=1)
    record.add(old)
    record.add(old.at(step=5))
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert "paired" not in saved and "RL's share" not in eval_summary(record)


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandforge.job.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


SHORT = ["warmup.episodes=4", "rollout.tasks_per_step=1", "rollout.group_size=2", "rollout.max_turns=2",
         "rollout.max_new_tokens=64", "logging.wandb.mode=disabled"]


@pytest.mark.docker
@pytest.mark.slow
def test_sft_then_train_with_eval_then_eval_the_checkpoint(tmp_path, terminal_image):
    sft_dir = tmp_path / "sft"
    proc = _cli("sft", "configs/terminal.yaml", f"run.output_dir={sft_dir}", "warmup.steps=10", *SHORT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    policy = sft_dir / "checkpoints" / "step_0" / "policy"
    assert (policy / "model.safetensors").is_file() and "model.init_from=" in proc.stderr
    rows = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in rows} == {"warmup"} and len(rows) == 10

    run = tmp_path / "run"
    proc = _cli("train", "configs/terminal.yaml", f"run.output_dir={run}", f"model.init_from={policy}",
                "warmup.steps=0", "trainer.steps=2", "eval.tasks_per_family=1", "eval.samples=2", "eval.every=1",
                *SHORT, "logging.wandb.mode=offline")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((run / "eval.json").read_text())
    assert [h["step"] for h in result["history"]] == [0, 1, 2]
    assert result["before"]["step"] == 0 and result["after"]["step"] == 2 and result["k"] == 2
    assert result["after"]["per_env"]["terminal"]["episodes"] == 2 * 2  # 2 families x 1 task x 2 samples
    assert set(result["delta_points"]["per_env"]) == {"terminal"}
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("eval/success/terminal" in r for r in evals)
    assert "held-out success (eval.json)" in proc.stderr
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (run / "report.html").is_file()
    from wandb_offline import find_run_file, history_rows

    history = history_rows(find_run_file(run))  # the same curves in the offline wandb run
    assert [r["eval/success/terminal"] for r in history if "eval/success" in r] == [
        r["eval/success/terminal"] for r in evals]
    assert sum("reward/mean" in r and "entropy" in r for r in history) == 2

    out = tmp_path / "eval.json"
    proc = _cli("eval", "configs/terminal.yaml", "--checkpoint", str(run / "checkpoints" / "step_2" / "policy"),
                "--out", str(out), "eval.tasks_per_family=1", "eval.samples=2", *SHORT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["episodes"] == 4 and summary["k"] == 2 and "terminal" in summary["per_env"]
    assert "held-out success" in proc.stdout + proc.stderr


def test_eval_without_a_policy_directory_fails_in_one_line(tmp_path):
    proc = _cli("eval", "configs/terminal.yaml", "--checkpoint", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
