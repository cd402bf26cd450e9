"""Steps with nothing to learn from, said (job/no_signal.py, #55): an environment all of whose groups scored alike is
named on the step line with why, and the run warns once it has been so for STREAK steps in a row."""

from __future__ import annotations

from sandforge.job.no_signal import STREAK, SilentStreak, silent_envs, silent_in, silent_metrics, silent_note
from sandforge.job.rl_job import step_line
from sandforge.types import Reward, Task, Trajectory


def episode(env: str, group: str, value: float) -> Trajectory:
    task = Task(id=f"{env}/t", env=env, family="f", seed=0, instruction="")
    return Trajectory(task=task, group=group, reward=Reward(value, value >= 1.0))


def test_each_environment_whose_groups_were_all_flat_is_named_with_why():
    ok = [episode("terminal", "0/a", v) for v in (1, 0, 1, 0)]          # mixed: signal
    ok += [episode("repo", "0/b", 0) for _ in range(4)]                 # all failed
    ok += [episode("repo", "0/c", 0) for _ in range(4)]
    ok += [episode("slack", "0/d", 1) for _ in range(4)]                # all passed
    ok += [episode("notion", "0/e", 0.5) for _ in range(4)]             # flat within each group, mixed across them
    ok += [episode("notion", "0/f", 1.0) for _ in range(4)]
    signal = [t.reward.value for t in ok]
    assert silent_envs(ok, signal) == {"repo": "all failed", "slack": "all passed", "notion": "all alike"}
    m = silent_metrics(ok, signal)
    assert m["signal/flat_groups"] == 5 and m["signal/silent/terminal"] == 0 and m["signal/silent/repo"] == 1
    silent, seen = silent_in(m)
    assert silent == {"repo": "all failed", "slack": "all passed", "notion": "all alike"}
    assert seen == {"terminal", "repo", "slack", "notion"}
    note = silent_note(silent)
    assert note == "  no signal: notion (all alike), repo (all failed), slack (all passed)"
    line = step_line(0, 12, {"reward/mean": 0.0, "success/rate": 0.0, "episodes/failed": 0, "time/step": 1.0} | m)
    assert line.endswith(note) and line.startswith("step 1/12  reward 0.000")
    # one group with signal is enough for an environment
    ok.append(episode("repo", "0/g", 1))
    ok.append(episode("repo", "0/g", 0))
    assert "repo" not in silent_envs(ok, [t.reward.value for t in ok])


def test_the_run_warns_once_an_environment_has_been_silent_for_streak_steps():
    streak = SilentStreak()
    seen = {"repo", "terminal"}
    said = [streak.update({"repo": "all failed"}, seen) for _ in range(STREAK)]
    assert said[:-1] == [[]] * (STREAK - 1)
    assert len(said[-1]) == 1 and said[-1][0].startswith(f"RL has had nothing to learn on repo for {STREAK} steps")
    assert "all failed" in said[-1][0] and "warm start" in said[-1][0]
    assert streak.update({"repo": "all failed"}, seen) == []  # once per streak
    assert streak.update({}, seen) == []  # signal again: the streak ends
    assert [streak.update({"repo": "all passed"}, seen) for _ in range(STREAK)][-1][0].count("already succeeds") == 1
