"""Environments an RL step had nothing to learn from, said where the user reads the run.

A group whose episodes all score alike gives every one of them a zero advantage: an environment all of whose groups
did so in a step taught the policy nothing there, and a run that goes on so prints ``reward 0.000 loss 0.0000`` step
after step without saying why (#55). ``silent_envs`` names them per step, with why (all failed, all passed, all
alike), as metrics (``silent_metrics``: ``signal/silent/<env>``, 1 when every group of the environment was flat,
``signal/success/<env>``, ``signal/flat_groups``); the step line names them (``silent_note``), and ``SilentStreak``
warns once an environment has been silent for ``STREAK`` steps in a row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sandforge.types import Trajectory

STREAK = 3  # steps in a row without signal before the run warns about an environment


def silent_envs(ok: list[Trajectory], signal: list[float]) -> dict[str, str]:
    """Environment -> why, for every environment of ``ok`` (the step's graded episodes) whose groups all had one
    training signal each (``signal``: each episode's value the advantages were computed from): "all failed", "all
    passed" (by the verifiers' success) or "all alike" (equal rewards within each group, mixed across groups)."""
    values: dict[str, set[float]] = defaultdict(set)
    env_of: dict[str, str] = {}
    for t, s in zip(ok, signal):
        values[t.group].add(round(s, 9))
        env_of[t.group] = t.task.env
    flat: dict[str, bool] = {}
    for g, vs in values.items():
        env = env_of[g]
        flat[env] = flat.get(env, True) and len(vs) == 1
    out = {}
    for env, is_flat in flat.items():
        if not is_flat:
            continue
        successes = {t.reward.success for t in ok if t.task.env == env}
        out[env] = ("all passed" if successes == {True} else "all failed" if successes == {False} else "all alike")
    return out


def silent_metrics(ok: list[Trajectory], signal: list[float]) -> dict[str, float]:
    """For every environment of the step: ``signal/silent/<env>`` (1.0 when every group of it had no signal) and
    ``signal/success/<env>`` (its success rate); and ``signal/flat_groups``, the step's groups without signal."""
    silent = silent_envs(ok, signal)
    values: dict[str, set[float]] = defaultdict(set)
    for t, s in zip(ok, signal):
        values[t.group].add(round(s, 9))
    m: dict[str, float] = {}
    for env in sorted({t.task.env for t in ok}):
        mine = [t.reward.success for t in ok if t.task.env == env]
        m[f"signal/silent/{env}"] = float(env in silent)
        m[f"signal/success/{env}"] = sum(mine) / len(mine)
    m["signal/flat_groups"] = float(sum(len(v) == 1 for v in values.values()))
    return m


def silent_in(m: dict[str, float]) -> tuple[dict[str, str], set[str]]:
    """From a step's metrics (``silent_metrics``): the silent environments with why, and every environment seen."""
    seen = {k.removeprefix("signal/silent/") for k in m if k.startswith("signal/silent/")}
    silent = {}
    for env in seen:
        if m[f"signal/silent/{env}"]:
            rate = m.get(f"signal/success/{env}", 0.5)
            silent[env] = "all passed" if rate >= 1.0 else "all failed" if rate <= 0.0 else "all alike"
    return silent, seen


def silent_note(silent: dict[str, str]) -> str:
    """The step line's note: "" when every environment had signal."""
    if not silent:
        return ""
    return "  no signal: " + ", ".join(f"{env} ({why})" for env, why in sorted(silent.items()))


@dataclass
class SilentStreak:
    """Steps in a row each environment has been silent; ``update`` returns the warnings to print (once per streak,
    when it reaches ``STREAK``)."""

    streak: int = STREAK
    runs: dict[str, int] = field(default_factory=dict)

    def update(self, silent: dict[str, str], seen: set[str]) -> list[str]:
        warnings = []
        for env in seen:
            self.runs[env] = self.runs.get(env, 0) + 1 if env in silent else 0
            if env in silent and self.runs[env] == self.streak:
                why = silent[env]
                hint = {"all failed": "no episode succeeds, so no group has a success to reinforce: a warm start "
                                      "(warmup), easier tasks, partial credit or more turns would give it one",
                        "all passed": "every episode already succeeds: nothing left to learn there at this difficulty",
                        "all alike": "every group's episodes score the same: a reward with more levels (partial "
                                     "credit), or a higher temperature for more varied episodes"}[why]
                warnings.append(f"RL has had nothing to learn on {env} for {self.streak} steps in a row, its groups "
                                f"{why} ({hint})")
        return warnings
