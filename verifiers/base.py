"""Verifier registry and ``score_task``: run a task's checks against the sandbox after the episode.

A check is plain data in ``Task.checks``: ``{"verifier": name, **arguments}``. Each verifier takes the sandbox and
those arguments and returns (score in [0, 1], short reason). Verifiers act through fresh execs (as root), never through
the policy's shell, so the policy can influence the result only through the state it left behind.
"""

from __future__ import annotations

from typing import Callable

from sandforge.environments.sandbox.docker_sandbox import Sandbox
from sandforge.types import Reward, Task

Verifier = Callable[[Sandbox, dict], tuple[float, str]]
VERIFIERS: dict[str, Verifier] = {}


class VerifierError(RuntimeError):
    """A check could not be run (unknown verifier, bad arguments, broken sandbox): the episode has failed."""


def register(name: str) -> Callable[[Verifier], Verifier]:
    def add(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        return fn

    return add


def score_task(sandbox: Sandbox, task: Task) -> Reward:
    """Run every check of ``task``: value = mean score, success = every check scored 1.0."""
    if not task.checks:
        raise VerifierError(f"task {task.id} has no checks: nothing can score it")
    scores: dict[str, float] = {}
    reasons: list[str] = []
    for i, check in enumerate(task.checks):
        args = {k: v for k, v in check.items() if k != "verifier"}
        name = check.get("verifier")
        verifier = VERIFIERS.get(name)
        if verifier is None:
            known = ", ".join(sorted(VERIFIERS)) or "none"
            raise VerifierError(f"task {task.id}, check {i}: unknown verifier {name!r} (known: {known})")
        try:
            score, reason = verifier(sandbox, args)
        except VerifierError:
            raise
        except Exception as e:  # a bad argument, a dead sandbox: the episode cannot be scored
            raise VerifierError(f"task {task.id}, check {i} ({name}) failed: {type(e).__name__}: {e}") from e
        if not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
            raise VerifierError(f"task {task.id}, check {i} ({name}) returned score {score!r}, expected [0, 1]")
        key = f"{name}:{args.get('path', i)}"
        scores[key if key not in scores else f"{key}#{i}"] = float(score)
        reasons.append(reason)
    value = sum(scores.values()) / len(scores)
    return Reward(
        value=value,
        success=all(s == 1.0 for s in scores.values()),
        breakdown=scores,
        reason="; ".join(reasons),
    )


# The built-in verifiers register themselves on import.
from sandforge.verifiers import file as _file  # noqa: E402,F401
from sandforge.verifiers import state as _state  # noqa: E402,F401
