"""What the driver prints off a terminal: a status line whenever it has been silent too long, and one line when every
episode of a batch failed for the same reason."""

from __future__ import annotations

import time

import pytest

from sandforge.job import console as out
from sandforge.job.console import JobError, heartbeat, phase, progress, status_line
from sandforge.job.fleet.rollout_workers import common_failure, stop_if_all_failed
from sandforge.types import Reward, Task, Trajectory


def test_off_a_terminal_silence_turns_into_status_lines(capsys):
    """Redirected output (pytest captures it: no terminal) gets the phase and each open bar's count while nothing else
    is printed, and nothing more once the block ends."""
    assert not out.console.is_terminal
    bar = progress()
    with heartbeat(every=0.4), phase("starting the trainer ranks"), bar:
        task = bar.add_task("pretraining", total=800)
        bar.advance(task, 120)
        time.sleep(1.6)
    lines = [line for line in capsys.readouterr().err.splitlines() if "starting the trainer ranks" in line]
    assert 2 <= len(lines) <= 5, lines
    assert all("pretraining: 120/800" in line for line in lines)
    time.sleep(0.6)
    assert "starting" not in capsys.readouterr().err


def test_anything_printed_resets_the_silence(capsys):
    with heartbeat(every=0.6), phase("rolling out"):
        for _ in range(8):
            out.console.print("step line")
            time.sleep(0.15)
    assert "rolling out" not in capsys.readouterr().err


def test_status_line_names_the_innermost_phase():
    with phase("outer"), phase("inner"):
        assert "inner (0s)" in status_line() and "outer" not in status_line()
    assert "inner" not in status_line()


def episode(failure: str | None) -> Trajectory:
    return Trajectory(task=Task(id="t", env="terminal", family="write_file", seed=0, instruction="x"), group="g", failed=failure is not None,
                      failure=failure, reward=Reward(0.0, False))


def test_one_reason_for_every_failed_episode_stops_the_job_in_one_line():
    tokenizer = "worker: rollout worker {} could not start: OSError: Can't load tokenizer for 'x'\nTraceback ..."
    trajs = [episode(tokenizer.format(i % 2)) for i in range(8)]
    assert common_failure(trajs) == tokenizer.format(0).splitlines()[0]
    with pytest.raises(JobError) as e:
        stop_if_all_failed(trajs, "held-out eval: 4 tasks x 2")
    assert "\n" not in str(e.value) and "all 8 episodes of 'held-out eval: 4 tasks x 2' failed" in str(e.value)
    assert "Can't load tokenizer" in str(e.value)


@pytest.mark.parametrize("failures", [
    [None, "sandbox: gone"],  # one succeeded: the policy's business
    ["sandbox: gone", "verifier: timed out"],  # different reasons: not one cause
    ["sandbox: gone"],  # one episode says little
])
def test_mixed_or_single_failures_go_on(failures):
    trajs = [episode(f) for f in failures]
    assert common_failure(trajs) is None
    stop_if_all_failed(trajs, "x")
