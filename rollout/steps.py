"""Multi-step tasks (Harbor's ``[[steps]]``): the steps of one episode, each graded as it ends, and the episode's
reward made from theirs.

A multi-step task runs its steps in order in one sandbox. Each step starts in a fresh context (the policy sees only
that step's instruction, as Harbor starts its agent afresh for each step) after the step's files were placed (as the
policy's user) and its set-up ran (as root); when the step ends, its checks grade the sandbox as a task's checks do (the policy's processes stopped
first), and a step scoring below its ``min_reward`` ends the episode there. The episode's reward is the steps' mean
(over the steps that ran, as Harbor's ``mean``) or the last step's (``final``).
"""

from __future__ import annotations

import dataclasses

from sandforge.types import STEP_REWARDS, Reward, SandboxError, Task, TaskStep
from sandforge.verifiers.command import run_as_grader


@dataclasses.dataclass
class StepResult:
    """What one step of an episode came to: its name and its reward."""

    name: str
    reward: Reward

    def to_json(self) -> dict:
        return {"name": self.name, "reward": self.reward.value, "success": self.reward.success}


def step_task(task: Task, index: int) -> Task:
    """The task one step is graded as: the step's checks (and time), no steps of its own."""
    step = task.steps[index]
    return dataclasses.replace(task, instruction=step.instruction, checks=list(step.checks), steps=[],
                               agent_timeout=step.agent_timeout or task.agent_timeout)


def stops_after(step: TaskStep, reward: Reward) -> bool:
    """Whether the episode ends after ``step``: its reward fell below the step's ``min_reward``."""
    return step.min_reward is not None and reward.value < step.min_reward


def prepare(sandbox, step: TaskStep, timeout: float = 300.0) -> str:
    """``step.place`` as the policy's own user, then ``step.setup`` as root behind the graders' start-up
    (sandforge/grading/startup.py: it runs among the files the policy left, as a check does); "" when both succeeded
    (or there are none), else what went wrong. A sandbox that is gone raises (SandboxError): a host-side fact."""
    for command, as_root in ((step.place, False), (step.setup, True)):
        if not command:
            continue
        try:
            result = run_as_grader(sandbox, command, timeout) if as_root else \
                sandbox.exec(command, timeout=timeout, session=False)
        except OSError as e:  # the start-up could not be written: a root policy can break its sandbox that far
            return f"step {step.name}'s set-up could not start: {e}"
        if result.timed_out:
            return f"step {step.name}'s set-up timed out after {timeout:g}s"
        if result.exit_code != 0:
            return f"step {step.name}'s set-up exited {result.exit_code}: {result.output.strip()[-200:]}"
    return ""


def unprepared(why: str) -> Reward:
    """The reward of a step whose set-up failed once the policy had acted: among what it left (its links, its files,
    a full disk), so the step scores 0 with a cause, never a failed episode, and never a skipped step (under
    ``final`` a skipped last step would hand the episode the step before's reward)."""
    return Reward(0.0, False, {}, reason=f"{why} (on what the steps before left)", zero_causes=["state"])


def first_prepare(sandbox, task: Task) -> None:
    """The first step's set-up, before the policy has acted: a failure is the task's (SandboxError: the episode
    fails), never the policy's."""
    if task.steps and (why := prepare(sandbox, task.steps[0])):
        raise SandboxError(f"task {task.id}: {why}")


def combine(task: Task, results: list[StepResult], note: str = "") -> Reward:
    """The episode's reward from its steps' (those that ran, in order): their mean, or the last one's (``final``).
    A success needs every step run and each a success (``final``: the last step run and a success). ``note`` says why
    the steps stopped early, where they did."""
    if task.step_reward not in STEP_REWARDS:
        raise ValueError(f"task {task.id}: step_reward {task.step_reward!r}; use one of {', '.join(STEP_REWARDS)}")
    if not results:
        raise ValueError(f"task {task.id}: no step was graded")
    ran_all = len(results) == len(task.steps)
    if task.step_reward == "final":
        value = results[-1].reward.value
        success = ran_all and results[-1].reward.success
    else:
        value = sum(r.reward.value for r in results) / len(results)
        success = ran_all and all(r.reward.success for r in results)
    breakdown = {f"step/{r.name}": r.reward.value for r in results}
    for r in results:
        breakdown |= {f"step/{r.name}/{key}": v for key, v in r.reward.breakdown.items()}
    reasons = [f"{r.name}: {r.reward.reason}" for r in results]
    if not ran_all:
        skipped = [s.name for s in task.steps[len(results):]]
        reasons.append(note or f"not run: {', '.join(skipped)}")
    causes = sorted({c for r in results for c in r.reward.zero_causes})
    return Reward(value=value, success=success, breakdown=breakdown, reason="; ".join(reasons), zero_causes=causes)
