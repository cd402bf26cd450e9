"""A Harbor task's ``[environment] healthcheck`` (#58): run as Docker runs a HEALTHCHECK, before the agent starts
(environments/harbor/healthcheck.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandforge.environments.harbor.healthcheck import Healthcheck, wait_healthy
from sandforge.environments.harbor.tasks import load_task
from sandforge.types import ExecResult, SandboxError

SHAPES = Path(__file__).resolve().parents[1] / "tests" / "data" / "harbor" / "shapes"


class Clock:
    """A clock that moves only when slept on, and a sandbox whose command fails until a given run."""

    def __init__(self, passes_at: int | None, timed_out: bool = False):
        self.now, self.passes_at, self.timed_out, self.runs, self.slept = 0.0, passes_at, timed_out, [], []

    def exec(self, command, timeout=10.0, user=None, workdir=None, session=True):
        self.runs.append((command, timeout, user, session))
        ok = self.passes_at is not None and len(self.runs) >= self.passes_at
        return ExecResult(output="" if ok else "not yet", exit_code=0 if ok else 1, seconds=0.0,
                          timed_out=self.timed_out and not ok)

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def _wait(check: Healthcheck, box: Clock) -> int:
    return wait_healthy(box, check, clock=lambda: box.now, sleep=box.sleep)


def test_healthy_at_the_first_pass_as_root_in_a_fresh_shell():
    box = Clock(passes_at=3)
    assert _wait(Healthcheck("curl -f localhost", interval=2.0, retries=3, timeout=7.0), box) == 3
    assert box.runs[0] == ("curl -f localhost", 7.0, "root", False) and box.slept == [2.0, 2.0]


def test_retries_failures_in_a_row_are_unhealthy_and_say_why():
    box = Clock(passes_at=None)
    with pytest.raises(SandboxError, match=r"failed 3 time\(s\) in a row \(exited 1: not yet\)"):
        _wait(Healthcheck("false", interval=1.0, retries=3), box)
    assert len(box.runs) == 3
    box = Clock(passes_at=None, timed_out=True)
    with pytest.raises(SandboxError, match="timed out"):
        _wait(Healthcheck("sleep 99", retries=1), box)


def test_failures_in_the_start_period_do_not_count_and_come_start_interval_apart():
    box = Clock(passes_at=6)
    check = Healthcheck("x", interval=5.0, start_period=4.0, start_interval=1.0, retries=2)
    assert _wait(check, box) == 6  # 4 runs in the start period (1 s apart), then 1 failure: healthy at the 6th
    assert box.slept == [1.0, 1.0, 1.0, 1.0, 5.0]


def test_the_task_carries_its_healthcheck_and_nothing_is_said_to_be_not_honoured():
    task = load_task(SHAPES / "healthcheck")
    assert Healthcheck.from_dict(task.setup["healthcheck"]) == Healthcheck("test -s /run/service-token", 1.0, 30.0,
                                                                           0.0, 1.0, 30)
    assert not task.setup.get("not_honoured")


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_the_oracle_waits_for_the_service_the_image_starts(mode):
    """The service writes its token 3 s after the sandbox starts, and solve.sh reads it at once: it scores 1 because
    the healthcheck held it back, as Harbor's does; doing nothing scores 0."""
    from sandforge.job.harbor_check import check

    [row] = check([SHAPES / "healthcheck"], mode=mode)
    assert (row.oracle, row.noop) == (1.0, 0.0), row
