"""One held-out evaluation's results as a typed object, and its JSON form (an entry of a run's eval.json, the file
``sandforge eval`` writes): success, pass@k and the mean reward overall and per environment, each task's tally (what
a paired comparison pairs), and the greedy pass beside the sampled one.

``EvalSummary.from_json`` reads what earlier versions wrote too (no per-task tallies, no mean reward: those read as
None) and what a user hands ``sandforge eval --against``; anything else is a ValueError that names the key.
Success counts every episode (a failed one did not solve its task); pass@k is the unbiased estimator of Chen et al.
(2021) from n samples with c successes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from math import comb, sqrt
from statistics import fmean, stdev

from sandforge.types import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def stderr(wins: list[float]) -> float:
    """The standard error of a success rate over episodes: sqrt(p(1 - p) / (n - 1)), the sampling noise of the rate
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


def _number(d: dict, key: str, where: str, default: float | None = 0.0) -> float | None:
    value = d.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        if value is None and default is None:
            return None
        raise ValueError(f"{where}{key} must be a number, got {str(value)[:40]}")
    return value


def _object(d, where: str) -> dict:
    if not isinstance(d, dict):
        raise ValueError(f"{where.rstrip('.') or 'the summary'} must be an object, got {type(d).__name__}")
    return d


@dataclass(frozen=True)
class Rates:
    """Held-out results over a set of episodes (all of an evaluation's, or one environment's)."""

    success: float = 0.0  # the share of episodes that solved their task (pass@1)
    pass_at_k: float = 0.0  # the mean over tasks of pass@k
    stderr: float = 0.0  # of ``success``: ``stderr``
    tasks: int = 0
    episodes: int = 0
    failed: int = 0  # episodes that failed (host-side faults; they count as unsolved)
    reward: float | None = None  # the mean reward, continuous ones as they are; None in an older eval.json
    reward_stderr: float | None = None

    @classmethod
    def of(cls, tasks: dict[str, list[Trajectory]], k: int) -> Rates:
        episodes = [t for ts in tasks.values() for t in ts]
        wins = [float(won(t)) for t in episodes]
        rewards = [reward_of(t) for t in episodes]
        passes = [pass_at_k(len(ts), sum(map(won, ts)), min(k, len(ts))) for ts in tasks.values()]
        return cls(success=fmean(wins) if wins else 0.0, pass_at_k=fmean(passes) if passes else 0.0,
                   stderr=stderr(wins), tasks=len(tasks), episodes=len(episodes),
                   failed=sum(t.failed for t in episodes), reward=fmean(rewards) if rewards else 0.0,
                   reward_stderr=stdev(rewards) / sqrt(len(rewards)) if len(rewards) >= 2 else 0.0)

    def to_json(self) -> dict:
        out = {"success": self.success, "pass@k": self.pass_at_k, "stderr": self.stderr}
        if self.reward is not None:
            out |= {"reward": self.reward, "reward_stderr": self.reward_stderr or 0.0}
        return out | {"tasks": self.tasks, "episodes": self.episodes, "failed": self.failed}

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> Rates:
        d = _object(d, where)
        return cls(success=_number(d, "success", where), pass_at_k=_number(d, "pass@k", where),
                   stderr=_number(d, "stderr", where), tasks=int(_number(d, "tasks", where)),
                   episodes=int(_number(d, "episodes", where)), failed=int(_number(d, "failed", where)),
                   reward=_number(d, "reward", where, None), reward_stderr=_number(d, "reward_stderr", where, None))


@dataclass(frozen=True)
class TaskTally:
    """One held-out task's episodes in an evaluation: what ``paired`` compares task by task."""

    env: str
    wins: int
    episodes: int
    reward_sum: float | None = None  # None in an older eval.json

    def to_json(self) -> dict:
        out = {"env": self.env, "wins": self.wins, "episodes": self.episodes}
        return out if self.reward_sum is None else out | {"reward_sum": self.reward_sum}

    @classmethod
    def from_json(cls, d: dict, where: str) -> TaskTally:
        d = _object(d, where)
        if not isinstance(d.get("env"), str):
            raise ValueError(f"{where}env must be an environment's name")
        return cls(env=d["env"], wins=int(_number(d, "wins", where)), episodes=int(_number(d, "episodes", where)),
                   reward_sum=_number(d, "reward_sum", where, None))


@dataclass(frozen=True)
class EvalSummary:
    """One held-out evaluation: ``rates`` over all its episodes, ``per_env``, ``per_task`` (None in an eval.json
    written before summaries kept it), the greedy pass of the same tasks where there was one, and where it was taken:
    after RL ``step`` (of a run), of the pretrained ``base``, or of a ``checkpoint`` (``sandforge eval``)."""

    k: int
    rates: Rates
    per_env: dict[str, Rates]
    per_task: dict[str, TaskTally] | None = None
    temperature: float | None = None  # of the sampled episodes (0: greedy)
    greedy: EvalSummary | None = None
    step: int | None = None
    policy_version: int | None = None
    base: bool = False
    checkpoint: str | None = None

    def at(self, **where) -> EvalSummary:
        """This summary, placed: ``step``, ``policy_version``, ``base``, ``checkpoint``."""
        return dataclasses.replace(self, **where)

    def to_json(self) -> dict:
        out: dict = {} if self.checkpoint is None else {"checkpoint": self.checkpoint}
        if self.step is not None:
            out["step"] = self.step
        if self.policy_version is not None:
            out["policy_version"] = self.policy_version
        if self.base:
            out["base"] = True
        if self.temperature is not None:
            out["temperature"] = self.temperature
        out |= {"k": self.k, **self.rates.to_json(), "per_env": {env: r.to_json() for env, r in self.per_env.items()}}
        if self.per_task is not None:
            out["per_task"] = {task: t.to_json() for task, t in self.per_task.items()}
        if self.greedy is not None:
            out["greedy"] = self.greedy.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> EvalSummary:
        """A summary's JSON form; ValueError names the key that is not what a summary holds (``where``: a prefix for
        it, such as ``after.``)."""
        d = _object(d, where)
        per_env = _object(d.get("per_env", {}), f"{where}per_env")
        per_task = d.get("per_task")
        greedy = d.get("greedy")
        step, version = _number(d, "step", where, None), _number(d, "policy_version", where, None)
        return cls(k=int(_number(d, "k", where, 1)), rates=Rates.from_json(d, where),
                   per_env={str(env): Rates.from_json(r, f"{where}per_env.{env}.") for env, r in per_env.items()},
                   per_task=None if per_task is None else {
                       str(task): TaskTally.from_json(t, f"{where}per_task.{task}.")
                       for task, t in _object(per_task, f"{where}per_task").items()},
                   temperature=_number(d, "temperature", where, None),
                   greedy=None if greedy is None else cls.from_json(greedy, f"{where}greedy."),
                   step=None if step is None else int(step), policy_version=None if version is None else int(version),
                   base=d.get("base") is True, checkpoint=d.get("checkpoint") if isinstance(d.get("checkpoint"), str)
                   else None)


def summarize(trajs: list[Trajectory], k: int, temperature: float | None = None) -> EvalSummary:
    """The summary of a held-out pass's episodes (grouped by task id; each task should have the same number of
    samples n >= k)."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task[t.task.id].append(t)
    envs: dict[str, dict[str, list[Trajectory]]] = defaultdict(dict)
    for task_id, ts in by_task.items():
        envs[ts[0].task.env][task_id] = ts
    per_task = {task_id: TaskTally(env=ts[0].task.env, wins=sum(map(won, ts)), episodes=len(ts),
                                   reward_sum=round(sum(map(reward_of, ts)), 6))
                for task_id, ts in sorted(by_task.items())}
    return EvalSummary(k=k, rates=Rates.of(by_task, k),
                       per_env={env: Rates.of(tasks, k) for env, tasks in sorted(envs.items())}, per_task=per_task,
                       temperature=temperature)


@dataclass(frozen=True)
class RunEvals:
    """The evaluations a run's eval.json places: of the pretrained ``base``, ``before`` RL and ``after`` it, each None
    where the file has none or it cannot be read as a summary (a report draws what there is)."""

    k: int | None = None
    base: EvalSummary | None = None
    before: EvalSummary | None = None
    after: EvalSummary | None = None

    @classmethod
    def from_json(cls, d: dict) -> RunEvals:
        def read(key: str) -> EvalSummary | None:
            try:
                return EvalSummary.from_json(d[key], f"{key}.") if isinstance(d.get(key), dict) else None
            except ValueError:
                return None

        k = d.get("k") if isinstance(d, dict) else None
        return cls(k=k if isinstance(k, int) and not isinstance(k, bool) else None,
                   **{key: read(key) for key in ("base", "before", "after")} if isinstance(d, dict) else {})
