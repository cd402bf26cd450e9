"""Held-out evaluation: a fixed set of held-out tasks, several episodes each, summarised per environment.

The task set is the same every time it is built (seeds 0..n-1 of every family, split "heldout"), so numbers before
and after training compare the same tasks. Success counts every episode (a failed one is a failure: it did not solve
the task); pass@k uses the unbiased estimator of Chen et al. (2021) from n samples with c successes.
"""

from __future__ import annotations

from collections import defaultdict
from math import comb
from statistics import fmean

from sandforge.config import EnvironmentConfig
from sandforge.environments.task_sources import FiniteSource, open_source
from sandforge.registry import environment
from sandforge.types import Task, Trajectory


def heldout_tasks(envs: list[EnvironmentConfig], per_family: int) -> list[Task]:
    """``per_family`` held-out tasks of every family of every configured environment, in a fixed order: seeds
    0..per_family-1 of a generator, or the first ``per_family`` held-out tasks of a task file or folder (a family
    without held-out tasks there is left out)."""
    tasks: list[Task] = []
    for env in envs:
        source = open_source(environment(env.name), env.tasks)
        for family in env.families or source.families():
            if isinstance(source, FiniteSource):
                tasks += [t for t in source.tasks if t.family == family and t.split == "heldout"][:per_family]
            else:
                tasks += [source.task(family, seed, "heldout") for seed in range(per_family)]
    return tasks


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, c of them correct, is correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(trajs: list[Trajectory], k: int) -> dict:
    """{"success", "pass@k", "episodes", "failed", "per_env": {env: {...same...}}} over the episodes of held-out tasks
    (grouped by task id; each task should have the same number of samples n >= k)."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task[t.task.id].append(t)

    def block(tasks: dict[str, list[Trajectory]]) -> dict:
        episodes = [t for ts in tasks.values() for t in ts]
        wins = [float(not t.failed and t.reward is not None and t.reward.success) for t in episodes]
        passes = [pass_at_k(len(ts), sum(not t.failed and t.reward.success for t in ts), min(k, len(ts)))
                  for ts in tasks.values()]
        return {"success": fmean(wins) if wins else 0.0, "pass@k": fmean(passes) if passes else 0.0,
                "tasks": len(tasks), "episodes": len(episodes), "failed": sum(t.failed for t in episodes)}

    envs: dict[str, dict[str, list[Trajectory]]] = defaultdict(dict)
    for task_id, ts in by_task.items():
        envs[ts[0].task.env][task_id] = ts
    return {"k": k, **block(by_task), "per_env": {env: block(tasks) for env, tasks in sorted(envs.items())}}


def metric_row(summary: dict) -> dict[str, float]:
    """The summary as flat metrics (``eval/success``, ``eval/success/<env>``, ``eval/pass@k/<env>``, ...)."""
    row = {"eval/success": summary["success"], "eval/pass@k": summary["pass@k"], "eval/k": summary["k"],
           "eval/failed": summary["failed"]}
    for env, s in summary["per_env"].items():
        row[f"eval/success/{env}"] = s["success"]
        row[f"eval/pass@k/{env}"] = s["pass@k"]
    return row


class EvalRecord:
    """``eval.json`` in a run directory: every held-out evaluation of the run, "before" (the first, the policy RL
    starts from) and "after" (the last), and the change in percentage points per environment. Rewritten after each
    evaluation, so a killed run keeps what it measured; ``resume_from(step)`` drops evaluations a resumed run redoes."""

    def __init__(self, path, k: int, per_family: int):
        import json
        from pathlib import Path

        self.path = Path(path)
        self.k, self.per_family = k, per_family
        self.history: list[dict] = json.loads(self.path.read_text())["history"] if self.path.is_file() else []

    def resume_from(self, step: int) -> None:
        """A run resumed after ``step`` RL steps redoes everything after it: evaluations of later steps go."""
        self.history = [h for h in self.history if h["step"] <= step]
        self._write()

    def has(self, step: int) -> bool:
        return any(h["step"] == step for h in self.history)

    def add(self, summary: dict) -> None:
        self.history.append(summary)
        self._write()

    def as_dict(self) -> dict:
        out: dict = {"k": self.k, "tasks_per_family": self.per_family, "history": self.history}
        if self.history:
            before, after = self.history[0], self.history[-1]
            out["before"], out["after"] = before, after
            envs = sorted(set(before["per_env"]) | set(after["per_env"]))
            out["delta_points"] = {
                "success": round(100 * (after["success"] - before["success"]), 2),
                "per_env": {env: round(100 * (after["per_env"].get(env, {}).get("success", 0.0)
                                              - before["per_env"].get(env, {}).get("success", 0.0)), 2)
                            for env in envs},
            }
        return out

    def _write(self) -> None:
        import json

        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        tmp.replace(self.path)
