"""Two held-out evaluations of the same tasks compared (eval.json's ``delta_points``, ``paired``, ``rl_trained``,
``over_base``; ``sandforge eval --against``): the unpaired change in points, and RL's share task by task.

Pairing takes out how much tasks differ from each other, which the difference of two unpaired means carries in its
spread: over the tasks both evaluations measured, d_t = after_t - before_t (success rates, in points), its mean and its
standard error sd(d)/sqrt(n).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import sqrt
from statistics import fmean, stdev

from sandforge.job.eval_summary import EvalSummary


@dataclass(frozen=True)
class Paired:
    """A paired difference: its mean in points (None when no task was measured both times), its standard error
    (None under two tasks), the tasks paired and how many only one side measured."""

    mean_points: float | None
    stderr_points: float | None
    tasks: int
    left_out: int

    def to_json(self) -> dict:
        return {"mean_points": self.mean_points, "stderr_points": self.stderr_points, "tasks": self.tasks,
                "left_out": self.left_out}

    def words(self) -> str:
        """"+x.x ± y.y points (paired over N tasks)"."""
        if self.mean_points is None:
            return f"no task measured both times ({self.left_out} on one side only)"
        se = "" if self.stderr_points is None else f" ± {self.stderr_points:.1f}"
        left = f"; {self.left_out} measured once left out" if self.left_out else ""
        return f"{self.mean_points:+.1f}{se} points (paired over {self.tasks} task{'s' * (self.tasks != 1)}{left})"


def paired_difference(after: dict[str, float], before: dict[str, float]) -> Paired:
    """RL's share task by task: ``Paired`` over the tasks both maps (task id -> rate) hold."""
    both = sorted(after.keys() & before.keys())
    d = [100 * (after[t] - before[t]) for t in both]
    return Paired(mean_points=round(fmean(d), 2) if d else None,
                  stderr_points=round(stdev(d) / sqrt(len(d)), 2) if len(d) >= 2 else None,
                  tasks=len(both), left_out=len(after.keys() ^ before.keys()))


@dataclass(frozen=True)
class Points:
    """after - before in percentage points, unpaired: overall, per environment, greedy where both have it."""

    success: float
    per_env: dict[str, float]
    greedy: float | None = None

    def to_json(self) -> dict:
        out = {"success": self.success, "per_env": self.per_env}
        return out if self.greedy is None else out | {"greedy": self.greedy}


def points(after: EvalSummary, before: EvalSummary) -> Points:
    envs = sorted(set(before.per_env) | set(after.per_env))

    def rate(s: EvalSummary, env: str) -> float:
        return s.per_env[env].success if env in s.per_env else 0.0

    greedy = (points(after.greedy, before.greedy).success
              if after.greedy is not None and before.greedy is not None else None)
    return Points(success=round(100 * (after.rates.success - before.rates.success), 2),
                  per_env={env: round(100 * (rate(after, env) - rate(before, env)), 2) for env in envs}, greedy=greedy)


def task_rates(summary: EvalSummary, env: str | None = None, envs: frozenset[str] | None = None) -> dict[str, float]:
    """Task id -> success rate in one evaluation (its episodes' wins / episodes), of ``env``'s tasks alone if given,
    or of the environments in ``envs``."""
    return {task: t.wins / t.episodes for task, t in (summary.per_task or {}).items()
            if t.episodes and env in (None, t.env) and (envs is None or t.env in envs)}


def task_rewards(summary: EvalSummary, env: str | None = None) -> dict[str, float]:
    """Task id -> mean reward in one evaluation, of ``env``'s tasks alone if given (tasks an older eval.json kept
    without rewards are left out)."""
    return {task: t.reward_sum / t.episodes for task, t in (summary.per_task or {}).items()
            if t.episodes and t.reward_sum is not None and env in (None, t.env)}


def success_over(summary: EvalSummary, envs: frozenset[str]) -> float:
    """Success over the episodes of the environments in ``envs``."""
    blocks = [r for env, r in summary.per_env.items() if env in envs]
    episodes = sum(r.episodes for r in blocks)
    return sum(r.success * r.episodes for r in blocks) / episodes if episodes else 0.0


@dataclass(frozen=True)
class PairedComparison:
    """eval.json's ``paired``: ``paired_difference`` overall, per environment, of the mean reward (continuous ones as
    they are, in points of reward x 100) and the same for the greedy pass where both evaluations had one."""

    success: Paired
    per_env: dict[str, Paired]
    reward: Paired
    reward_per_env: dict[str, Paired]
    greedy: PairedComparison | None = None

    def to_json(self) -> dict:
        out = {"success": self.success.to_json(), "per_env": {e: p.to_json() for e, p in self.per_env.items()},
               "reward": self.reward.to_json(),
               "reward_per_env": {e: p.to_json() for e, p in self.reward_per_env.items()}}
        return out if self.greedy is None else out | {"greedy": self.greedy.to_json()}


def paired(after: EvalSummary, before: EvalSummary) -> PairedComparison | None:
    """None when either summary has no per-task tallies (an eval.json written before summaries kept them)."""
    if after.per_task is None or before.per_task is None:
        return None
    envs = sorted({t.env for t in [*after.per_task.values(), *before.per_task.values()]})
    greedy = paired(after.greedy, before.greedy) if after.greedy is not None and before.greedy is not None else None
    return PairedComparison(
        success=paired_difference(task_rates(after), task_rates(before)),
        per_env={env: paired_difference(task_rates(after, env), task_rates(before, env)) for env in envs},
        reward=paired_difference(task_rewards(after), task_rewards(before)),
        reward_per_env={env: paired_difference(task_rewards(after, env), task_rewards(before, env)) for env in envs},
        greedy=greedy)


@dataclass(frozen=True)
class Share:
    """Success before and after over some environments' episodes (in percent), and RL's share over their tasks."""

    before: float
    after: float
    paired: Paired

    def to_json(self) -> dict:
        return {"before": self.before, "after": self.after, "paired": self.paired.to_json()}


def share_over(after: EvalSummary, before: EvalSummary, envs: frozenset[str]) -> Share:
    return Share(before=round(100 * success_over(before, envs), 2), after=round(100 * success_over(after, envs), 2),
                 paired=paired_difference(task_rates(after, envs=envs), task_rates(before, envs=envs)))


@dataclass(frozen=True)
class TrainedShare:
    """eval.json's ``rl_trained``: the environments RL drew tasks from, sampled and greedy (where both have it)."""

    environments: list[str]
    sampled: Share
    greedy: Share | None = None

    def to_json(self) -> dict:
        out = {"environments": self.environments, **self.sampled.to_json()}
        return out if self.greedy is None else out | {"greedy": self.greedy.to_json()}


def rl_trained(after: EvalSummary, before: EvalSummary, envs: list[str]) -> TrainedShare | None:
    """The headline when the warm start covers environments RL leaves out (at their floor, say): their tasks cannot
    move, and would only dilute the comparison. None when RL trained on every evaluated environment or a summary has
    no per-task tallies."""
    chosen = frozenset(envs)
    evaluated = set(after.per_env) | set(before.per_env)
    if not chosen or evaluated <= chosen or after.per_task is None or before.per_task is None:
        return None
    g_after, g_before = after.greedy, before.greedy
    greedy = (share_over(g_after, g_before, chosen) if g_after is not None and g_before is not None
              and g_after.per_task is not None and g_before.per_task is not None else None)
    return TrainedShare(environments=sorted(chosen), sampled=share_over(after, before, chosen), greedy=greedy)
