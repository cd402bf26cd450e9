"""Held-out evaluation, for a run (before RL, every ``eval.every`` steps, at the end: ``eval`` rows and eval.json) and
for ``sandforge eval CONFIG --checkpoint DIR`` (a policy directory, no trainer): a fixed set of held-out tasks, several
episodes each, summarised per environment.

The task set is the same every time it is built (seeds 0..n-1 of every family, split "heldout"), so numbers before
and after training compare the same tasks, and are compared task by task (``paired``: the mean and standard error of
each task's change in success rate). Success counts every episode (a failed one is a failure: it did not solve the
task); pass@k uses the unbiased estimator of Chen et al. (2021) from n samples with c successes. Sampled episodes run at
``eval.temperature`` (the rollout temperature unless set), greedy ones at 0.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from math import comb, sqrt
from pathlib import Path
from statistics import fmean, stdev
from typing import Callable

from rich.table import Table

from sandforge.config import EnvironmentConfig, JobConfig
from sandforge.job.console import JobError
from sandforge.environments.task_sources import FiniteSource
from sandforge.job.task_sampler import env_source, with_reward_rule, with_success_at
from sandforge.types import Task, Trajectory


def heldout_tasks(envs: list[EnvironmentConfig], per_family: int, sources: list | None = None) -> list[Task]:
    """``per_family`` held-out tasks (an environment's ``eval_tasks_per_family`` where set) of every family of every
    configured environment, in a fixed order: seeds 0..n-1 of a generator, or the first n held-out tasks of a task
    file or folder (a family without held-out tasks there is left out). ``sources``: the environments' task sources,
    in order, as the run opened them (opened here when not given)."""
    tasks: list[Task] = []
    for i, env in enumerate(envs):
        n = env.eval_tasks(per_family)
        source = sources[i] if sources is not None else env_source(env)
        for family in env.families or source.families():
            if isinstance(source, FiniteSource):
                found = [t for t in source.tasks if t.family == family and t.split == "heldout"][:n]
            else:
                found = [source.task(family, seed, "heldout") for seed in range(n)]
            # success is the same reward as training's, at the same threshold
            tasks += [with_success_at(with_reward_rule(t, env.reward_rule), env.success_at) for t in found]
    return tasks


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, c of them correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def stderr(wins: list[float]) -> float:
    """The standard error of a success rate over these episodes, treated as independent draws (samples of one task are
    not quite, so this is a lower bound): the spread a second evaluation of the same policy would show from sampling
    alone. 0 for fewer than two episodes."""
    n = len(wins)
    if n < 2:
        return 0.0
    p = fmean(wins)
    return (p * (1 - p) / (n - 1)) ** 0.5


def won(t: Trajectory) -> bool:
    """The episode solved its task (a failed episode did not)."""
    return not t.failed and t.reward is not None and t.reward.success


def reward_of(t: Trajectory) -> float:
    """The episode's reward as its verifiers gave it (a continuous one included); a failed episode's is 0."""
    return 0.0 if t.failed or t.reward is None else float(t.reward.value)


def summarize(trajs: list[Trajectory], k: int) -> dict:
    """{"success", "pass@k", "reward" (the mean reward, continuous ones included, with "reward_stderr"), "episodes",
    "failed", "per_env": {env: {...same...}}, "per_task": {task id: {"env", "wins", "episodes", "reward_sum"}}} over
    the episodes of held-out tasks (grouped by task id; each task should have the same
    number of samples n >= k). ``per_task`` is what ``paired`` compares between two evaluations."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task[t.task.id].append(t)

    def block(tasks: dict[str, list[Trajectory]]) -> dict:
        episodes = [t for ts in tasks.values() for t in ts]
        wins = [float(won(t)) for t in episodes]
        rewards = [reward_of(t) for t in episodes]
        passes = [pass_at_k(len(ts), sum(not t.failed and t.reward.success for t in ts), min(k, len(ts)))
                  for ts in tasks.values()]
        return {"success": fmean(wins) if wins else 0.0, "pass@k": fmean(passes) if passes else 0.0,
                "stderr": stderr(wins), "reward": fmean(rewards) if rewards else 0.0,
                "reward_stderr": stdev(rewards) / sqrt(len(rewards)) if len(rewards) >= 2 else 0.0,
                "tasks": len(tasks), "episodes": len(episodes), "failed": sum(t.failed for t in episodes)}

    envs: dict[str, dict[str, list[Trajectory]]] = defaultdict(dict)
    for task_id, ts in by_task.items():
        envs[ts[0].task.env][task_id] = ts
    per_task = {task_id: {"env": ts[0].task.env, "wins": sum(map(won, ts)), "episodes": len(ts),
                          "reward_sum": round(sum(map(reward_of, ts)), 6)}
                for task_id, ts in sorted(by_task.items())}
    return {"k": k, **block(by_task), "per_env": {env: block(tasks) for env, tasks in sorted(envs.items())},
            "per_task": per_task}


def metric_row(summary: dict) -> dict[str, float]:
    """The summary as flat metrics (``eval/success``, ``eval/success/<env>``, ``eval/pass@k/<env>``, ...; with a
    greedy evaluation ``eval/greedy/success`` and ``eval/greedy/success/<env>``)."""
    row = {"eval/success": summary["success"], "eval/pass@k": summary["pass@k"], "eval/k": summary["k"],
           "eval/failed": summary["failed"], "eval/stderr": summary["stderr"]}
    if "reward" in summary:
        row["eval/reward"] = summary["reward"]
    for env, s in summary["per_env"].items():
        row[f"eval/success/{env}"] = s["success"]
        row[f"eval/pass@k/{env}"] = s["pass@k"]
        if "reward" in s:
            row[f"eval/reward/{env}"] = s["reward"]
    if "greedy" in summary:
        row["eval/greedy/success"] = summary["greedy"]["success"]
        for env, s in summary["greedy"]["per_env"].items():
            row[f"eval/greedy/success/{env}"] = s["success"]
    return row


def eval_temperature(cfg: JobConfig) -> float:
    """The temperature of held-out sampled episodes: ``eval.temperature``, else ``rollout.temperature``."""
    return cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature


@dataclass(frozen=True)
class HeldoutRun:
    """One held-out pass over the tasks: ``samples`` episodes of each at ``temperature``, in groups ``<tag>/<task id>``
    (the group names seed their sampling)."""

    tag: str
    tasks: tuple[Task, ...]
    samples: int
    temperature: float

    @property
    def groups(self) -> list[str]:
        return [f"{self.tag}/{task.id}" for task in self.tasks for _ in range(self.samples)]

    @property
    def episodes(self) -> list[Task]:
        return [task for task in self.tasks for _ in range(self.samples)]

    def label(self) -> str:
        how = "greedy" if self.temperature == 0 else f"at T={self.temperature:g}"
        return f"{how}: {len(self.tasks)} tasks x {self.samples}"


def heldout_run(cfg: JobConfig, tag: str, greedy: bool = False, per_family: int | None = None,
                samples: int | None = None, sources: list | None = None) -> HeldoutRun:
    """``eval.samples`` episodes of each held-out task at ``eval_temperature``; ``greedy``: one episode per task at
    temperature 0 (more would repeat it). ``per_family``: that many tasks of every family of every environment
    instead of the configured numbers; ``samples``: that many sampled episodes of each instead of ``eval.samples``."""
    envs = cfg.environments
    if per_family is not None:
        envs = [env.model_copy(update={"eval_tasks_per_family": per_family}) for env in envs]
    tasks = tuple(heldout_tasks(envs, cfg.eval.tasks_per_family, sources))
    if greedy:
        return HeldoutRun(tag, tasks, 1, 0.0)
    return HeldoutRun(tag, tasks, samples or cfg.eval.samples, eval_temperature(cfg))


def heldout_episodes(runs: list[HeldoutRun], collect: Callable[..., list[Trajectory]]
                     ) -> list[tuple[list[Trajectory], dict]]:
    """Run every pass of ``runs`` in one ``collect(tasks, groups, scripted, label, temperature)`` call, a temperature
    per episode: the workers start the longest episodes of all of them first, so the passes share one tail instead of
    each ending on its own slowest episodes. Per pass: its episodes and their summary (which records the
    temperature)."""
    tasks = [task for run in runs for task in run.episodes]
    groups = [group for run in runs for group in run.groups]
    temperatures = [run.temperature for run in runs for _ in run.episodes]
    trajs = collect(tasks, groups, scripted=False, label="held-out eval " + ", ".join(run.label() for run in runs),
                    temperature=temperatures)
    out = []
    for run in runs:
        mine = [t for t in trajs if t.group.startswith(f"{run.tag}/")]
        out.append((mine, {"temperature": run.temperature, **summarize(mine, run.samples)}))
    return out


def evaluation(cfg: JobConfig, collect: Callable[..., list[Trajectory]], tag: str,
               per_family: int | None = None, samples: int | None = None, sources: list | None = None
               ) -> tuple[list[Trajectory], dict]:
    """One held-out evaluation as configured: at ``eval.temperature`` (the rollout temperature unless set), plus
    greedy with ``eval.greedy`` (its summary under ``"greedy"``, its episodes appended), both in one pass of the
    workers. ``per_family``: that many tasks per family everywhere, ``samples``: that many sampled episodes of each (the
    base evaluation's ``eval.base_tasks_per_family`` and ``eval.base_samples``); ``sources``: the run's opened task
    sources (``heldout_tasks``)."""
    runs = [heldout_run(cfg, tag, per_family=per_family, samples=samples, sources=sources)]
    if cfg.eval.greedy:
        runs.append(heldout_run(cfg, f"{tag}g", greedy=True, per_family=per_family, sources=sources))
    (trajs, summary), *greedy = heldout_episodes(runs, collect)
    if greedy:
        more, summary["greedy"] = greedy[0]
        trajs = trajs + more
    return trajs, summary


def compared(summary: dict, earlier: dict, source: str) -> dict:
    """``sandforge eval --against``: this evaluation against an earlier one of another checkpoint on the same held-out
    tasks, task by task (``paired``: this minus the earlier, in points) and overall (``delta_points``)."""
    check_comparable(earlier, source)
    return {"file": source, "delta_points": points(summary, earlier), "paired": paired(summary, earlier)}


def check_comparable(earlier: dict, source: str) -> None:
    """Refuse an ``--against`` file without per-task results (nothing to pair with)."""
    if "per_task" not in earlier:
        raise JobError(f"--against {source}: it holds no per-task results (not a `sandforge eval` summary, or one "
                       "written before summaries kept them)")


def against_lines(cmp: dict) -> list[str]:
    """The comparison in words, for the end of ``sandforge eval --against``."""
    pair = cmp["paired"]
    lines = [f"against {cmp['file']}: {share(pair['success'])}"]
    if "greedy" in pair:
        lines.append(f"  greedy: {share(pair['greedy']['success'])}")
    lines += [f"  {env}: {share(p)}" for env, p in pair["per_env"].items()]
    return lines


def evaluate_checkpoint(cfg: JobConfig, checkpoint: Path, out_file: Path, against: Path | None = None) -> dict:
    """``sandforge eval``: ``cfg.eval.samples`` episodes of each held-out task with the policy in ``checkpoint``, on the
    same fleet a run starts (without trainer ranks); writes the summary (success and pass@k, overall and per
    environment) to ``out_file`` and returns it. ``against``: an earlier ``sandforge eval`` summary (another
    checkpoint, the same config), compared task by task (``compared``, under ``against`` in the summary)."""
    earlier = None
    if against is not None:
        try:
            earlier = json.loads(against.read_text())
        except (OSError, ValueError) as e:
            raise JobError(f"--against {against}: cannot read it as JSON ({e})") from None
        check_comparable(earlier, str(against))  # refused before the fleet starts, not after the episodes
    from sandforge.job.console import console, make_run_id, progress
    from sandforge.job.fleet.lifecycle import checkpoint_policy, open_fleet
    from sandforge.job.fleet.rollout_workers import collect_episodes, stop_if_all_failed

    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": checkpoint})})
    with open_fleet(cfg, make_run_id(f"{cfg.run.name}-eval"), frozenset({"engine", "workers"}),
                    policy=checkpoint_policy(checkpoint)) as fleet, progress() as bar:

        def collect(tasks, groups, scripted, label, temperature=None):
            trajs = collect_episodes(fleet.workers, tasks, groups, cfg.run.seed, 0, scripted, bar, label, temperature)
            stop_if_all_failed(trajs, label)
            return trajs

        _, summary = evaluation(cfg, collect, "eval")
    summary = {"checkpoint": str(checkpoint), **summary}
    if earlier is not None:
        summary["against"] = compared(summary, earlier, str(against))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(summary, indent=1) + "\n")
    console.print(summary_table(summary))
    if earlier is not None:
        console.print("\n".join(against_lines(summary["against"])), soft_wrap=True, markup=False)
    console.print(f"[green]done[/]: {out_file}")
    return summary


def summary_table(summary: dict) -> Table:
    k = summary["k"]
    at = f" at temperature {summary['temperature']:g}" if "temperature" in summary else ""
    table = Table(title=f"held-out success{at}: {summary['tasks']} tasks x "
                        f"{summary['episodes'] // max(summary['tasks'], 1)} episodes")
    for column in ("environment", "tasks", "success (pass@1)", f"pass@{k}", "mean reward", "failed episodes"):
        table.add_column(column)
    greedy = summary.get("greedy")
    if greedy:
        table.add_column("greedy")
    rows = [*summary["per_env"].items(), ("all", summary)]
    for env, s in rows:
        g = greedy if env == "all" else (greedy or {}).get("per_env", {}).get(env)
        reward = f"{s['reward']:.3f} ± {s['reward_stderr']:.3f}" if "reward" in s else "—"
        table.add_row(env, str(s["tasks"]), f"{100 * s['success']:.1f}% ± {100 * s['stderr']:.1f}",
                      f"{100 * s['pass@k']:.1f}%", reward, str(s["failed"]),
                      *([f"{100 * g['success']:.1f}%"] if g else []))
    return table


def eval_line(summary: dict) -> str:
    """One evaluation during a run, in one line."""
    envs = "  ".join(f"{env} {s['success']:.2f}" for env, s in summary["per_env"].items())
    when = "of the pretrained base" if summary.get("base") else f"after step {summary['step']}"
    if "temperature" in summary:
        when += f" (T={summary['temperature']:g})"
    greedy = f"  greedy {summary['greedy']['success']:.2f}" if "greedy" in summary else ""
    reward = f"  reward {summary['reward']:.3f}" if "reward" in summary else ""
    return (f"held-out eval {when}: success {summary['success']:.2f} ± {summary['stderr']:.2f}{greedy}{reward}  "
            f"pass@{summary['k']} {summary['pass@k']:.2f}  ({envs})")


def eval_summary(result: dict) -> str:
    """Before -> after held-out success per environment (an ``EvalRecord``), for the end of a run."""
    if "before" not in result:
        return "held-out eval: nothing measured"
    b, a, base = result["before"], result["after"], result.get("base")

    def pct(s: dict | None, env: str | None = None) -> str:
        if s is not None and env is not None:
            s = s["per_env"].get(env)
        return "—" if s is None else f"{100 * s['success']:.1f}%"

    first = f"{pct(base)} pretrained base -> " if base else ""
    pair = result.get("paired") or {}
    lines = [f"held-out success (eval.json): {first}{pct(b)} after step {b['step']} -> {pct(a)} after step "
             f"{a['step']} ({result['delta_points']['success']:+.1f} points over RL)"]
    if pair:
        lines.append(f"  RL's share: {share(pair['success'])}")
    if "reward" in a and "reward" in b:  # a continuous reward reads here where success stays at 0
        paired_reward = f"; RL's share {share(pair['reward'])} (reward x 100)" if "reward" in pair else ""
        lines.append(f"  mean reward: {b['reward']:.3f} -> {a['reward']:.3f}{paired_reward}")
    if "greedy" in a and "greedy" in b:
        paired_greedy = f"; RL's share {share(pair['greedy']['success'])}" if "greedy" in pair else ""
        lines.append(f"  greedy: {pct(b['greedy'])} -> {pct(a['greedy'])} "
                     f"({result['delta_points']['greedy']:+.1f} points over RL){paired_greedy}")
    if head := result.get("rl_trained"):
        greedy = head.get("greedy")
        lines.append(f"  the environments RL trained on ({', '.join(head['environments'])}): {head['before']:.1f}% -> "
                     f"{head['after']:.1f}%, RL's share {share(head['paired'])}"
                     + (f"; greedy {greedy['before']:.1f}% -> {greedy['after']:.1f}%, RL's share "
                        f"{share(greedy['paired'])}" if greedy else ""))
    for env, delta in result["delta_points"]["per_env"].items():
        start = f"{pct(base, env)} -> " if base else ""
        paired_env = f"; RL's share {share(pair['per_env'][env])}" if env in pair.get("per_env", {}) else ""
        lines.append(f"  {env}: {start}{pct(b, env)} -> {pct(a, env)} ({delta:+.1f}{paired_env})")
    return "\n".join(lines)


def share(p: dict) -> str:
    """A paired comparison in words: "+x.x ± y.y points (paired over N tasks)"."""
    if p["mean_points"] is None:
        return f"no task measured both times ({p['left_out']} on one side only)"
    se = "" if p["stderr_points"] is None else f" ± {p['stderr_points']:.1f}"
    left = f"; {p['left_out']} measured once left out" if p["left_out"] else ""
    return f"{p['mean_points']:+.1f}{se} points (paired over {p['tasks']} task{'s' * (p['tasks'] != 1)}{left})"


def points(after: dict, before: dict) -> dict:
    """after - before in percentage points: overall, per environment, and greedy where both have it."""
    envs = sorted(set(before["per_env"]) | set(after["per_env"]))
    out = {"success": round(100 * (after["success"] - before["success"]), 2),
           "per_env": {env: round(100 * (after["per_env"].get(env, {}).get("success", 0.0)
                                         - before["per_env"].get(env, {}).get("success", 0.0)), 2) for env in envs}}
    if "greedy" in after and "greedy" in before:
        out["greedy"] = points(after["greedy"], before["greedy"])["success"]
    return out


def paired_difference(after: dict[str, float], before: dict[str, float]) -> dict:
    """RL's share task by task: over the tasks both evaluations measured, d_t = after_t - before_t (success rates, in
    points); its mean, its standard error sd(d)/sqrt(n) (None under two tasks), n (``tasks``), and how many tasks only
    one side measured (``left_out``). Pairing takes out how much tasks differ from each other, which the difference
    of two unpaired means carries in its spread."""
    both = sorted(after.keys() & before.keys())
    d = [100 * (after[t] - before[t]) for t in both]
    return {"mean_points": round(fmean(d), 2) if d else None,
            "stderr_points": round(stdev(d) / sqrt(len(d)), 2) if len(d) >= 2 else None,
            "tasks": len(both), "left_out": len(after.keys() ^ before.keys())}


def task_rates(summary: dict, env: str | None = None, envs: frozenset[str] | None = None) -> dict[str, float]:
    """Task id -> success rate in one evaluation (its episodes' wins / episodes), of ``env``'s tasks alone if given,
    or of the environments in ``envs``."""
    return {task: s["wins"] / s["episodes"] for task, s in summary["per_task"].items()
            if s["episodes"] and env in (None, s["env"]) and (envs is None or s["env"] in envs)}


def task_rewards(summary: dict, env: str | None = None) -> dict[str, float]:
    """Task id -> mean reward in one evaluation, of ``env``'s tasks alone if given (tasks an older eval.json kept
    without rewards are left out)."""
    return {task: s["reward_sum"] / s["episodes"] for task, s in summary["per_task"].items()
            if s["episodes"] and "reward_sum" in s and env in (None, s["env"])}


def success_over(summary: dict, envs: frozenset[str]) -> float:
    """Success over the episodes of the environments in ``envs`` (an evaluation's summary)."""
    blocks = [s for env, s in summary["per_env"].items() if env in envs]
    episodes = sum(s["episodes"] for s in blocks)
    return sum(s["success"] * s["episodes"] for s in blocks) / episodes if episodes else 0.0


def rl_trained(after: dict, before: dict, envs: list[str]) -> dict | None:
    """eval.json's ``rl_trained``: the environments RL drew tasks from (``envs``), before and after, and RL's share
    over their tasks alone, paired (sampled, and greedy where both have it). The headline when the warm start covers
    environments RL leaves out (at their floor, say): their tasks cannot move, and would only dilute the comparison.
    None when RL trained on every evaluated environment or a summary has no ``per_task``."""
    chosen = frozenset(envs)
    evaluated = {env for s in (after, before) for env in s["per_env"]}
    if not chosen or evaluated <= chosen or "per_task" not in after or "per_task" not in before:
        return None
    out = {"environments": sorted(chosen), "before": round(100 * success_over(before, chosen), 2),
           "after": round(100 * success_over(after, chosen), 2),
           "paired": paired_difference(task_rates(after, envs=chosen), task_rates(before, envs=chosen))}
    if "greedy" in after and "greedy" in before and "per_task" in after["greedy"] and "per_task" in before["greedy"]:
        g_after, g_before = after["greedy"], before["greedy"]
        out["greedy"] = {"before": round(100 * success_over(g_before, chosen), 2),
                         "after": round(100 * success_over(g_after, chosen), 2),
                         "paired": paired_difference(task_rates(g_after, envs=chosen),
                                                     task_rates(g_before, envs=chosen))}
    return out


def paired(after: dict, before: dict) -> dict | None:
    """eval.json's ``paired``: ``paired_difference`` overall (``success``), per environment (``per_env``), and the
    same for greedy (``greedy``) where both evaluations have it. None when either summary has no ``per_task`` (an
    eval.json written before summaries kept it)."""
    if "per_task" not in after or "per_task" not in before:
        return None
    envs = sorted({s["env"] for s in [*after["per_task"].values(), *before["per_task"].values()]})
    out = {"success": paired_difference(task_rates(after), task_rates(before)),
           "per_env": {env: paired_difference(task_rates(after, env), task_rates(before, env)) for env in envs},
           # the mean reward (continuous ones as they are), in points of reward x 100
           "reward": paired_difference(task_rewards(after), task_rewards(before)),
           "reward_per_env": {env: paired_difference(task_rewards(after, env), task_rewards(before, env))
                              for env in envs}}
    greedy = paired(after["greedy"], before["greedy"]) if "greedy" in after and "greedy" in before else None
    if greedy is not None:
        out["greedy"] = greedy
    return out


class EvalRecord:
    """``eval.json`` in a run directory: every held-out evaluation of the run, "before" (the first, the policy RL
    starts from) and "after" (the last), and the change in percentage points per environment. Rewritten after each
    evaluation, so a killed run keeps what it measured; ``resume_from(step)`` drops evaluations a resumed run redoes."""

    def __init__(self, path, k: int, per_family: int, trained: list[str] | None = None):
        self.path = Path(path)
        self.k, self.per_family = k, per_family
        self.trained = trained or []  # the environments RL draws from: ``rl_trained``
        saved = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.history: list[dict] = saved.get("history", [])
        self.base: dict | None = saved.get("base")  # the pretrained policy before any training (``eval.base``)

    def resume_from(self, step: int) -> None:
        """A run resumed after ``step`` RL steps redoes everything after it: evaluations of later steps go."""
        self.history = [h for h in self.history if h["step"] <= step]
        self._write()

    def has(self, step: int) -> bool:
        return any(h["step"] == step for h in self.history)

    def add(self, summary: dict) -> None:
        self.history.append(summary)
        self._write()

    def set_base(self, summary: dict) -> None:
        self.base = summary
        self._write()

    def as_dict(self) -> dict:
        """eval.json: ``history``; ``before`` (RL's start: after the warm start) and ``after`` (the last); ``base``
        (the pretrained policy, with ``eval.base``); ``delta_points``: after - before, in points (RL's own share), and
        ``over_base``: after - base (all training); ``paired``: after vs before task by task (``paired``);
        ``rl_trained``: the same over the environments RL trained on, where it left some out (``rl_trained``)."""
        out: dict = {"k": self.k, "tasks_per_family": self.per_family, "history": self.history}
        if self.base is not None:
            out["base"] = self.base
        if self.history:
            before, after = self.history[0], self.history[-1]
            out["before"], out["after"] = before, after
            out["delta_points"] = points(after, before)
            if (pair := paired(after, before)) is not None:
                out["paired"] = pair
            if (head := rl_trained(after, before, self.trained)) is not None:
                out["rl_trained"] = head
            if self.base is not None:
                out["over_base"] = points(after, self.base)
        return out

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        tmp.replace(self.path)


def run_record(cfg: JobConfig, out: Path, resume: bool, start: int) -> EvalRecord | None:
    """The run's eval.json (None without held-out evaluation); a resumed run drops evaluations after ``start``."""
    if not cfg.eval.tasks_per_family:
        return None
    path = out / "eval.json"
    if not resume:
        path.unlink(missing_ok=True)
    record = EvalRecord(path, cfg.eval.samples, cfg.eval.tasks_per_family,
                        [env.name for env in cfg.environments if env.draw_weight("rl") > 0])
    record.resume_from(start)
    return record
