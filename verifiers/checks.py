"""Finding a check's verifier, and ``score_task``: run a task's checks against the sandbox after the episode.

A check is plain data in ``Task.checks``: ``{"verifier": name, **arguments}``. Each verifier takes the sandbox and
those arguments and returns (score in [0, 1], short reason), or (score, reason, parts) where the score has parts worth
showing (a rubric's items, FAIL_TO_PASS and PASS_TO_PASS fractions): they go into the reward's breakdown as
``<check>/<part>``, but only the score counts. Verifiers act through fresh execs (as root), never through the policy's
shell, so the policy can influence the result only through the state it left behind.

The built-in verifiers are named in sandforge/registry.py (``BUILTIN_VERIFIERS``) and imported when a check first
names them, so this module imports none of them and they import its helpers; plugins' come from entry points, and
``register`` adds others at run time (tests, scripts). A verifier states its properties as attributes of its function:
``partial_credit = True`` (its checks take ``"partial": true``) and ``default_timeout(args)`` (its budget when the
check names none).

Every check runs within a timeout: its ``timeout`` argument (seconds; default: what the verifier's
``default_timeout(args)`` says, e.g. a rubric's sum over its items, else ``DEFAULT_TIMEOUT``) sets a deadline. The
argument still reaches the verifier, and ``time_left()`` says what remains: verifiers pass it to their sandbox execs and
HTTP calls, so a command the policy made hang is killed inside the container in time and scores 0 for itself. The check
runs in a worker thread; one that has not reported ``REPORT_GRACE`` seconds after its deadline (a verifier stuck in
Python, a dead connection) is abandoned with a ``VerifierError`` naming the check. Whether such an error fails the
episode or scores 0 is decided once, in ``failure_rule``, from host-side facts only. Python cannot
kill a thread, so such a thread lives on as a daemon until whatever it waits for ends (the sandbox it reads is removed
with the episode, which ends most waits).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Union

from sandforge.policy_text import bounded
from sandforge.registry import BUILTIN_VERIFIERS, find_verifier
from sandforge.types import Reward, Sandbox, Task, ZeroScore

DEFAULT_TIMEOUT = 60.0  # seconds per check
# what of a check's reason and part names is kept (sandforge/policy_text.py bounded: head and tail), and of an episode's
# reason: they quote the policy's leavings, and the agent's own observations are capped at rollout.max_tool_output
MAX_REASON_CHARS, MAX_PART_CHARS, MAX_TASK_REASON_CHARS = 1000, 120, 4000
# What a check may take beyond its timeout before it counts as hung: a command killed at the deadline (TERM, then KILL
# a couple of seconds later) reporting back, or a verifier's own setup around the step its ``timeout`` bounds (a grading
# container's start).
REPORT_GRACE = 30.0


@dataclass
class CheckResult:
    """One check's verdict, validated. ``breakdown`` holds the parts of ``score`` (a rubric's items) by name."""

    score: float
    reason: str
    breakdown: dict[str, float] = field(default_factory=dict)
    cause: str = ""  # one of ZERO_CAUSES when what the policy left made the check unanswerable (score 0)


Verifier = Callable[[Sandbox, dict], Union[tuple[float, str], tuple[float, str, dict]]]
VERIFIERS: dict[str, Verifier] = {}  # added by ``register``; built-ins and plugins are found in sandforge/registry.py


class VerifierError(RuntimeError):
    """A check could not be run (unknown verifier, bad arguments, broken sandbox, timeout): the episode fails, unless
    ``failure_rule`` shows that what the policy left broke it."""

    located = False  # the message already says which check (set by this module), so callers add no prefix
    ran = False  # the verifier failed in a way it did not mean (an unexpected exception, a hang, no verdict)
    host = False  # a fault the host itself showed, outside the sandbox (HostFault): the episode fails


class HostFault(VerifierError):
    """A check could not be run for a reason outside the sandbox that the host sees for itself: an external service
    the check calls (a judge endpoint) down, overloaded or not answering. The episode fails whatever the policy left
    (``failure_rule`` tests nothing on a pristine sandbox: a check that short-cuts there would hide the fault)."""

    host = True


class Inconclusive(VerifierError):
    """A check reached no verdict for a reason what the policy left may have caused: a read of its sandbox gave
    output the verifier cannot interpret (an examining exec that printed nothing, a query that printed no JSON), or an
    external grader refused the answer's content (a judge's HTTP 413). Not the verifier's considered verdict on the
    task: ``failure_rule`` decides whose fault it is by running the same check on a pristine sandbox."""

    ran = True


def _located(message: str, ran: bool = False, host: bool = False) -> VerifierError:
    error = VerifierError(message)
    error.located, error.ran, error.host = True, ran, host
    return error


def register(name: str, default_timeout: Callable[[dict], float] | None = None,
             partial: bool = False) -> Callable[[Verifier], Verifier]:
    """Make ``fn`` the verifier of checks ``{"verifier": name, ...}`` in this process, ahead of a built-in or plugin of
    that name. ``default_timeout(args)`` gives the budget of a check that names no ``timeout`` (default
    ``DEFAULT_TIMEOUT``). ``partial``: its checks take ``"partial": true`` (see ``gives_partial_credit``). Both are set
    as attributes of ``fn``, as a built-in or plugin verifier sets them itself."""

    def add(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        if default_timeout is not None:
            fn.default_timeout = default_timeout
        if partial:
            fn.partial_credit = True
        return fn

    return add


def lookup(name: str) -> Verifier | None:
    """The verifier of checks named ``name``: a registered one, else a built-in or a plugin's (sandforge/registry.py,
    imported on first use); None when there is none."""
    return VERIFIERS.get(name) or find_verifier(name)


def known_verifiers() -> list[str]:
    """The names a check can use without a plugin: the built-ins and the registered ones."""
    return sorted({*BUILTIN_VERIFIERS, *VERIFIERS})


def gives_partial_credit(name: object) -> bool:
    """Do checks of verifier ``name`` take ``"partial": true`` (credit below 1 for an answer that is close)? Said by a
    ``partial_credit = True`` attribute on the verifier's function (``register(..., partial=True)`` sets it). A
    verifier that cannot be found or loaded says no here; scoring the check reports why."""
    return _declares(name, "partial_credit")


def takes_reward_rule(name: object) -> bool:
    """Do checks of verifier ``name`` take ``"reward": RULE``, how several named rewards become one (Harbor's
    reward.json)? Said by a ``reward_rule = True`` attribute on the verifier's function."""
    return _declares(name, "reward_rule")


def _declares(name: object, attribute: str) -> bool:
    if not isinstance(name, str):
        return False
    try:
        fn = lookup(name)
    except Exception:  # a plugin that fails to load: the check's own scoring fails that episode with the reason
        return False
    return bool(getattr(fn, attribute, False))


# --- budgets --------------------------------------------------------------------------------------------------------

_local = threading.local()  # .deadline (monotonic seconds) and .where of the check running in this thread


def time_left() -> float:
    """Seconds left before the running check's deadline; pass it as the timeout of sandbox execs and HTTP calls.

    Raises VerifierError when nothing is left (the check has overrun its timeout). Outside a check (a verifier called
    directly, as in tests) it is ``DEFAULT_TIMEOUT``.
    """
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return DEFAULT_TIMEOUT
    left = deadline - time.monotonic()
    if left <= 0:
        raise _located(f"{_local.where}: ran out of its timeout", ran=True)  # a hang, seen from inside
    return left


def check_timeout(check: dict) -> float:
    """The budget of ``check`` in seconds: its ``timeout``, else its verifier's default. VerifierError if invalid."""
    if "timeout" in check:
        value = check["timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise VerifierError(f"timeout must be a positive number of seconds, got {value!r}")
        return float(value)
    name = check.get("verifier")
    try:
        default = getattr(lookup(name), "default_timeout", None) if isinstance(name, str) else None
    except Exception:  # a plugin that fails to load: running the check reports why
        default = None
    return float(default({k: v for k, v in check.items() if k != "verifier"})) if default else DEFAULT_TIMEOUT


def without_timeout(args: dict) -> dict:
    """A check's arguments less ``timeout``, for verifiers that bound their work with ``time_left()`` instead."""
    return {k: v for k, v in args.items() if k != "timeout"}


# --- running checks ------------------------------------------------------------------------------------------------


def run_check(sandbox: Sandbox, check: dict, where: str) -> CheckResult:
    """Run one check within its timeout and validate its result; ``where`` names it in errors ("task t, check 2").

    Called inside another check (a rubric's item, ``where`` = "item 1"), the item gets the smaller of its own timeout
    and what the outer check has left, runs in the outer check's thread, and is named after it. Raises VerifierError
    for anything that is not a verdict.
    """
    outer = getattr(_local, "deadline", None)
    if outer is not None:
        where = f"{_local.where}, {where}"
    if not isinstance(check, dict):
        raise _located(f"{where}: a check is a mapping {{'verifier': name, ...}}, got {check!r}")
    name = check.get("verifier")
    verifier = lookup(name) if isinstance(name, str) else None
    if verifier is None:
        known = ", ".join(known_verifiers())
        raise _located(f"{where}: unknown verifier {name!r} (known: {known})")
    where = f"{where} ({name})"
    try:
        timeout = check_timeout(check)
    except VerifierError as e:
        raise _located(f"{where}: {e}") from None
    args = {k: v for k, v in check.items() if k != "verifier"}
    deadline = time.monotonic() + timeout if outer is None else min(outer, time.monotonic() + timeout)
    if outer is not None:  # already inside a check's worker thread: that thread's join bounds us
        return _validated(_call(verifier, name, sandbox, args, deadline, where), where)

    box: list = []
    worker = threading.Thread(target=lambda: box.append(_capture(verifier, name, sandbox, args, deadline, where)),
                              name=f"verifier-{name}", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()) + REPORT_GRACE)
    if not box:
        raise _located(f"{where} did not finish within its {timeout:g} s timeout (set the check's `timeout` if it "
                       "needs longer)", ran=True)
    outcome = box[0]
    if isinstance(outcome, BaseException) and not isinstance(outcome, ZeroScore):
        raise outcome
    return _validated(outcome, where)


def _capture(verifier: Verifier, name: str, sandbox: Sandbox, args: dict, deadline: float, where: str):
    try:
        return _call(verifier, name, sandbox, args, deadline, where)
    except BaseException as e:  # handed to the waiting thread, which raises it
        return e


def _call(verifier: Verifier, name: str, sandbox: Sandbox, args: dict, deadline: float, where: str):
    """Run ``verifier`` with this thread's budget set to ``deadline``; every error becomes one naming ``where``."""
    saved = getattr(_local, "deadline", None), getattr(_local, "where", None)
    _local.deadline, _local.where = deadline, where
    try:
        return verifier(sandbox, args)
    except ZeroScore as e:  # a verdict, not an error
        return e
    except VerifierError as e:  # the verifier's own verdict that the check cannot run (the task's fault), unless
        # it said it is Inconclusive
        if e.located:
            raise
        raise _located(f"{where}: {str(e).removeprefix(f'{name}: ')}", ran=e.ran, host=e.host) from e  # not "(command): command: ..."
    except Exception as e:  # a bad argument, a dead sandbox, or what the policy left: score_task's rule decides
        raise _located(f"{where} failed: {type(e).__name__}: {e}", ran=True) from e
    finally:
        _local.deadline, _local.where = saved


def _validated(outcome, where: str) -> CheckResult:
    """The verifier's outcome as a CheckResult, its reason and part names bounded: they quote what the policy left
    (an answer's keys, a file's text), which may be megabytes, and land in every trajectory row and log."""
    if isinstance(outcome, ZeroScore):
        return CheckResult(0.0, bounded(str(outcome.reason), MAX_REASON_CHARS), cause=outcome.cause)
    shape_ok = isinstance(outcome, tuple) and (len(outcome) == 2 or len(outcome) == 3 and isinstance(outcome[2], dict))
    if not shape_ok:
        raise _located(f"{where} returned {bounded(repr(outcome), MAX_REASON_CHARS)}, expected (score, reason) or "
                       "(score, reason, parts)", ran=True)
    score, reason, *parts = outcome
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
        raise _located(f"{where} returned score {bounded(repr(score), MAX_PART_CHARS)}, expected [0, 1]", ran=True)
    named = {bounded(str(k), MAX_PART_CHARS): float(v) for k, v in (parts[0] if parts else {}).items()}
    return CheckResult(float(score), bounded(str(reason), MAX_REASON_CHARS), named)


SERVICE_STOPPED = "the policy's service on port"  # how the note begins (`harbor check` shows it in full)


def service_stopped_note(ports: tuple[int, ...]) -> str:
    """One line for an episode that did not score while the policy had left a service listening: the checks never
    saw it, because every process of a non-root policy is stopped before grading (a security invariant)."""
    shown = ", ".join(map(str, ports))
    return (f"{SERVICE_STOPPED} {shown} was stopped before grading (every process of a non-root policy is: "
            "a check cannot reach it); a task graded on a service the agent leaves running cannot score in this "
            "mode: run it as root (Harbor's harbor_mode: root), or start the service from the image's ENTRYPOINT")


def failure_rule(sandbox: Sandbox, check: dict, where: str, error: VerifierError) -> CheckResult:
    """What a check that raised (or hung, or returned no verdict) means, decided from host-side facts only (#56): under
    RL a policy that cannot win learns to make its losses vanish, and a failed episode leaves the gradient, so nothing
    the policy could cause may fail one. The episode fails (``error`` is raised) only when something outside the
    policy's reach is shown broken:

    - the check was refused before its verifier ran (an unknown verifier, a bad argument), or its verifier said so
      itself with a ``VerifierError`` (a query that does not parse, a judge endpoint down: ``HostFault``): a
      verifier's considered verdict that the check cannot run is never second-guessed; what the policy left is a
      ``ZeroScore``, and what the policy may have caused without the verifier knowing is ``Inconclusive``;
    - the sandbox is no longer running (the host asks Docker, reading nothing the policy wrote);
    - no pristine sandbox can be had to test the check on (the Docker daemon, the pool), or the sandbox has none;
    - the check's pristine self-test fails: the same check, run on a fresh sandbox from the same image with nothing
      of the policy's in it, raises or hangs too, so the check is broken by itself.

    That leaves the errors no verifier meant (an exception it did not expect, a hang, a result that is no verdict,
    an ``Inconclusive``)
    where the check works on a clean sandbox: only what the policy left broke it, and it scores 0 with the cause
    ``broke_check`` (``reward/zero_broke_check``) and the error as its reason."""
    alive = getattr(sandbox, "alive", None)
    fresh = getattr(sandbox, "fresh", None)
    if not error.ran or error.host or fresh is None or (alive is not None and not alive()):
        raise error
    try:
        pristine = fresh()
    except Exception:  # no clean sandbox to test the check on: the host's fault, not decidable here
        raise error from None
    try:
        run_check(pristine, check, f"{where}, its pristine self-test")
    except VerifierError:
        raise error from None  # the check fails on a sandbox the policy never touched: it is broken by itself
    finally:
        pristine.close()
    return CheckResult(0.0, bounded(f"{error} (the same check runs on a fresh sandbox: what the policy left broke "
                                    "it)", MAX_REASON_CHARS), cause="broke_check")


def score_task(sandbox: Sandbox, task: Task) -> Reward:
    """Run every check of ``task``: value = mean score, success = every check scored 1.0.

    ``breakdown`` has one entry per check ("file_equals:/workspace/answer.txt", "command:1"), then the parts of
    checks that have them under "check/part" (a rubric's items); ``reason`` joins the checks' reasons.
    """
    if not task.checks:
        raise VerifierError(f"task {task.id} has no checks: nothing can score it")
    stop = getattr(sandbox, "stop_policy", None)
    stopped = None
    if stop is not None:  # before any check runs the policy is gone: nothing it started can race or read a grader
        try:
            stopped = stop()
        except Exception as e:  # a dead sandbox, or processes that would not die: no sound grading is possible
            raise VerifierError(f"task {task.id}: {e}") from e
    scores: dict[str, float] = {}
    parts: dict[str, float] = {}
    reasons: list[str] = []
    causes: set[str] = set()
    for i, check in enumerate(task.checks):
        where = f"task {task.id}, check {i}"
        try:
            result = run_check(sandbox, check, where)
        except VerifierError as e:
            result = failure_rule(sandbox, check, where, e)
        key = f"{check.get('verifier')}:{check.get('path', i)}"
        key = key if key not in scores else f"{key}#{i}"
        scores[key] = result.score
        parts.update({f"{key}/{part}": s for part, s in result.breakdown.items()})
        reasons.append(result.reason)
        causes |= {result.cause} - {""}
    value = sum(scores.values()) / len(scores)
    ports = getattr(stopped, "listening", ())
    if ports and not all(s == 1.0 for s in scores.values()):  # a 0 that would otherwise not say why
        reasons.append(service_stopped_note(ports))
        causes.add("service_stopped")
    return Reward(
        value=value,
        success=all(s == 1.0 for s in scores.values()),
        breakdown={**scores, **parts},
        reason=bounded("; ".join(reasons), MAX_TASK_REASON_CHARS),
        zero_causes=sorted(causes),
    )

