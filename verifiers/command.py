"""The ``command`` check: run a command in the sandbox after the episode and judge its exit code and output.

``{"verifier": "command", "command": "python3 -m answer --selftest", "exit_code": 0, "pattern": "^ok$"}``

The command runs as root (by default) in a fresh one-off shell, never in the policy's session: it sees the files the
policy left, not its shell variables, functions or aliases. It gets the check's remaining time as its timeout; a
command that runs out of it (a program the policy wrote loops forever) is killed inside the container and scores 0 -
the policy's doing, so it is a verdict, not a failed episode.
"""

from __future__ import annotations

import re

from sandforge.grading import shadows, startup
from sandforge.types import Sandbox
from sandforge.verifiers.checks import VerifierError, ZeroScore, time_left, without_timeout

_TRUNCATED = re.compile(r"\n\[\.\.\. truncated \d+ bytes\]\n")  # the sandbox's marker where it cut long output


def _tail(text: str, limit: int = 200) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else "..." + text[-limit:])


def run_command_check(sandbox: Sandbox, command: str, exit_code: int | None = 0, pattern: str | None = None,
                      absent: bool = False, user: str = "root", workdir: str | None = None,
                      answers: list[str] | tuple[str, ...] = ()) -> tuple[float, str]:
    """1.0 if ``command`` exits with ``exit_code`` (None: any) and its output (stdout and stderr merged) matches
    ``pattern`` (a Python regex, multiline) - or, with ``absent``, does not match it. Both must hold.

    Output longer than the sandbox's ``max_output_bytes`` keeps only its head and tail, so a pattern's absence cannot
    be proven from it: such a check scores 0 and says so (pipe the output through ``tail`` or ``grep -c``). Modules
    the policy planted to shadow what the command's Python imports are set aside first (sandforge/grading/shadows.py), but
    not ``answers``: the Python files the task asks for (a ``statistics.py`` the command imports is the answer).
    A root command starts with sandforge's grader start-up (sandforge/grading/startup.py): its Pythons import root's modules before
    the policy's (but the answers in Python's own order) and load plugins only from root's files.
    """
    moved = shadows.SetAside()
    if workdir in (None, sandbox.workdir):
        try:
            moved = shadows.set_aside(sandbox, workdir, timeout=min(30.0, time_left()),
                                      keep=shadows.answer_names(answers, sandbox.workdir))
        except OSError as e:  # what the policy left in its workdir stops a sound check: its 0, not a failed episode
            raise ZeroScore("state", f"command: {e}") from None
    start = startup.prepare(sandbox, user, answers)  # root's imports first, plugins from root's files only
    score, reason = _judge(sandbox, command, start, exit_code, pattern, absent, user, workdir)
    return score, reason + shadows.note(moved)


def run_as_grader(sandbox: Sandbox, command: str, timeout: float):
    """``command`` run as root among the files the policy left, as a check's command runs: behind the graders'
    start-up (sandforge/grading/startup.py). A multi-step task's set-up script between steps (rollout/steps.py)."""
    return sandbox.exec(startup.prepare(sandbox, "root") + command, timeout=timeout, user="root", session=False)


def _judge(sandbox: Sandbox, command: str, start: str, exit_code: int | None, pattern: str | None, absent: bool,
           user: str, workdir: str | None) -> tuple[float, str]:
    result = sandbox.exec(start + command, timeout=time_left(), user=user, workdir=workdir, session=False)
    shown = f"`{command if len(command) <= 60 else command[:57] + '...'}`"
    if result.timed_out:
        raise ZeroScore("timeout", f"{shown} timed out after {result.seconds:.0f} s (killed)")
    if exit_code is not None and result.exit_code != exit_code:
        return 0.0, f"{shown} exited {result.exit_code}, expected {exit_code}; output {_tail(result.output)}"
    if pattern is None:
        return 1.0, f"{shown} exited {result.exit_code}"
    found = re.search(pattern, result.output, re.MULTILINE) is not None
    truncated = _TRUNCATED.search(result.output) is not None
    if absent and truncated:
        return 0.0, f"{shown}: output was truncated, so the absence of {pattern!r} cannot be checked"
    if found != absent:
        return 1.0, f"{shown} exited {result.exit_code}, output {'lacks' if absent else 'matches'} {pattern!r}"
    note = " (output truncated: it may be in the cut middle)" if truncated and not absent else ""
    verdict = "matches" if absent else "does not match"
    return 0.0, f"{shown}: output {verdict} {pattern!r}{note}; output {_tail(result.output)}"


def command_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    args = without_timeout(args)
    allowed = {"command", "exit_code", "pattern", "absent", "user", "workdir", "answers"}
    if "command" not in args or set(args) - allowed:
        raise VerifierError(f"command takes command[, exit_code, pattern, absent, user, workdir, answers, timeout]; "
                            f"got {sorted(args)}")
    answers = args.get("answers", [])
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise VerifierError(f"command: answers must be a list of file paths (the code under test), got {answers!r}")
    if not isinstance(args["command"], str) or not args["command"].strip():
        raise VerifierError(f"command: command must be a non-empty string, got {args['command']!r}")
    code = args.get("exit_code", 0)
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        raise VerifierError(f"command: exit_code must be an integer or null (any), got {code!r}")
    if "pattern" in args:
        try:
            re.compile(args["pattern"])
        except (re.error, TypeError) as e:
            raise VerifierError(f"command: pattern {args['pattern']!r} is not a valid regex: {e}") from None
    elif args.get("absent"):
        raise VerifierError("command: absent needs a pattern (the text that must not appear)")
    return run_command_check(sandbox, **args)
