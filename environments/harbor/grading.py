"""Harbor grading: after the episode, the task's tests/ go in as root and test.sh writes the reward.

Harbor semantics, with what the policy could have planted taken away first: ``/tests`` and ``/logs`` are removed and
made again, root-owned, before anything is copied or run, so a reward file or a doctored test.sh the policy left
there (an image may even let it write those paths) is gone. The tests are never in the sandbox during the episode:
they travel inside the task's check. test.sh runs in a fresh shell (not the policy's session) with a timeout, as
the task's verifier user (root by default) in the image's WORKDIR (terminal-bench's test.sh refuses to run from /),
with the task's ``[verifier] env`` over its ``[environment] env``, and with root's own HOME and no Python user site
(one-off root commands: sandbox/clean_context.py). Modules the policy planted in the WORKDIR under names
test.sh's Python would import (``pytest.py``) are set aside first (sandforge/grading/shadows.py), and test.sh starts with
sandforge's grader start-up (sandforge/grading/startup.py): its Pythons import root's modules before the policy's and load plugins
only from root's files, and its ``uv`` is an offline stand-in whose ``uv venv`` makes the venv afresh.

Rewards, read as Harbor reads them: ``reward.json`` first (a JSON object of named numbers), else ``reward.txt`` (one
number, the reward named "reward"). ``combine`` makes the training reward of them by the check's ``reward`` rule;
each named reward is also kept in the episode's reward breakdown (``harbor_tests:0/<name>``). test.sh writes its
rewards from the policy's answer (a metric such as R² goes negative, ``nan`` or huge on an answer made for it), so a
reward file that is not a reward scores 0 with the cause ``malformed`` (``ZeroScore``), never fails the episode: a
task whose oracle writes one is flagged by ``sandforge harbor check``. No reward file at all also scores 0 (tests
that crash on what the policy left often write nothing).
"""

from __future__ import annotations

import base64
import functools
import json
import math
import shlex

from sandforge.grading import shadows, startup
from sandforge.environments.harbor import separate
from sandforge.environments.harbor.settings import shell_exports
from sandforge.types import Sandbox, ZeroScore

TESTS_DIR = "/tests"
LOGS_DIR = "/logs"
REWARD_DIR = "/logs/verifier"
PREPARE_TIMEOUT = 30.0


REWARD_FILES = ("reward.json", "reward.txt")  # Harbor's order: reward.json wins when test.sh wrote both
RULES = ("auto", "mean", "min")  # or the name of one reward


def read_rewards(text: str, name: str) -> dict[str, float]:
    """The rewards in ``name``, as Harbor reads them: reward.txt holds one number (the reward named "reward"),
    reward.json a JSON object whose every value is a finite number. ValueError names what is wrong."""
    if name == "reward.txt":
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"test.sh wrote reward.txt without a number: {text[:80]!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"test.sh wrote reward {value} to reward.txt, which is not finite")
        return {"reward": value}
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"test.sh wrote reward.json that is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"test.sh wrote reward.json that is not a JSON object of named rewards "
                         f"({{\"reward\": 1}} or {{\"correctness\": 1, \"performance\": 0.5}}): {text[:80]!r}")
    if not data:
        raise ValueError("test.sh wrote reward.json with no numeric reward in it: {}")
    rewards = {}
    for key, value in data.items():  # bool counts as a number, as in Harbor (Python's bool is an int)
        if not isinstance(value, (int, float)):
            raise ValueError(f"test.sh wrote reward.json whose {key} = {value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"test.sh wrote reward.json whose {key} = {value} is not finite")
        rewards[str(key)] = float(value)
    return rewards


def combine(rewards: dict[str, float], rule: str = "auto") -> tuple[float, str]:
    """The training reward from named ``rewards`` by ``rule``, and how it was made. ``auto``: the one named "reward"
    if there is one (Harbor's primary reward), else the only one, else the mean; ``mean``, ``min``; or a reward's
    name. Every reward the rule uses must be in [0, 1]; the others are only logged."""
    if rule not in RULES and rule not in rewards:
        raise ValueError(f"reward rule {rule!r} (the job's reward_rule, or the check's reward): reward.json has no key "
                         f"{rule!r} (it has {', '.join(rewards)})")
    pick = rule if rule not in RULES else "reward" if "reward" in rewards else None
    if rule == "auto" and pick is None and len(rewards) == 1:
        pick = next(iter(rewards))
    used = {pick: rewards[pick]} if pick is not None else rewards
    for key, value in used.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"test.sh wrote reward {value!r} as {key!r}; sandforge rewards are in [0, 1]")
    if pick is not None:
        return rewards[pick], f"reward {rewards[pick]:g}" + (f" ({pick})" if len(rewards) > 1 else "")
    value = min(used.values()) if rule == "min" else sum(used.values()) / len(used)
    shown = ", ".join(f"{k} {v:g}" for k, v in used.items())
    return value, f"reward {value:g} ({'min' if rule == 'min' else 'mean'} of {shown})"


def harbor_tests(sandbox: Sandbox, files: dict, timeout: float, user: str = "root", workdir: str | None = None,
                 env: dict[str, str] | None = None, rule: str = "auto", answers: tuple[str, ...] = (),
                 artifacts: tuple[bytes, ...] = ()) -> tuple[float, str] | tuple[float, str, dict]:
    """Copy ``files`` (tests/ as plain data) to a fresh root-owned /tests, run test.sh as ``user`` in ``workdir``
    (default: the sandbox's) with ``env``, read the rewards and combine them by ``rule`` (``combine``). Named rewards
    (more than one) come back as the check's parts, so each is in the episode's reward breakdown. ``answers``: the
    Python files the instruction names (``shadows.answer_paths``), which the shadow set-aside keeps. ``artifacts``:
    tar archives a separate verifier's sandbox receives (``separate.received``), extracted after /tests and /logs are
    made afresh (no artifact may be or hold either: environments/harbor/settings.py)."""
    dirs = " ".join((TESTS_DIR, LOGS_DIR))
    root = user in ("root", "0", "0:0")
    owner = "" if root else f" -o {shlex.quote(user)}"
    prepare = (f"rm -rf {dirs} && install -d -m {'0700' if root else '0755'} {TESTS_DIR} && "
               f"install -d -m 0755 {LOGS_DIR} && install -d -m 0755{owner} {REWARD_DIR}")
    result = sandbox.exec(prepare, timeout=PREPARE_TIMEOUT, user="root", session=False)
    if result.exit_code != 0:
        raise RuntimeError(f"could not prepare {dirs} as root ({result.output.strip()[-200:]}); Harbor grading needs "
                           "a writable root filesystem (the harbor env sets read_only: false)")
    for rel, content in files.items():
        data = base64.b64decode(content["base64"]) if isinstance(content, dict) else content.encode()
        mode = 0o755 if rel.endswith(".sh") else 0o644
        sandbox.put_file(f"{TESTS_DIR}/{rel}", data, user="root", mode=mode)
    for archive in artifacts:
        sandbox.put_tree(archive)
    moved = shadows.SetAside()
    if workdir in (None, sandbox.workdir):  # the policy's new shadow modules go first (sandforge/grading/shadows.py)
        try:
            keep = shadows.answer_names(answers, sandbox.workdir)
            moved = shadows.set_aside(sandbox, workdir, timeout=PREPARE_TIMEOUT, keep=keep)
        except OSError as e:  # what the policy left stops a sound test.sh: its 0, not a failed episode
            return 0.0, f"test.sh not run: {e}"
    start = startup.prepare(sandbox, user, answers)  # root's imports first, plugins from root's files, an offline uv
    run = sandbox.exec(f"{shell_exports(env or {})}{start}bash {shlex.quote(TESTS_DIR + '/test.sh')}", timeout=timeout,
                       user=user, workdir=workdir, session=False)
    tail = run.output.strip()[-300:]
    for name in REWARD_FILES:
        text = sandbox.read_file(f"{REWARD_DIR}/{name}", user="root")
        if text is not None:
            try:  # test.sh wrote it from the policy's answer: what is not a reward scores 0, never fails the episode
                rewards = read_rewards(text, name)
                reward, how = combine(rewards, rule)
            except ValueError as e:
                raise ZeroScore("malformed", f"{e} (exit {run.exit_code})" + shadows.note(moved)) from None
            reason = f"test.sh: {how} (exit {run.exit_code})"
            if run.exit_code != 0 or reward < 1.0:  # why it fell short: the end of what test.sh printed
                reason += f": {tail}" if tail else ""
            reason += shadows.note(moved)
            return (reward, reason, rewards) if len(rewards) > 1 else (reward, reason)
    # test.sh wrote nothing: a 0, not a failed episode (tests that crash on what the policy left often write nothing)
    if run.timed_out:
        return 0.0, f"test.sh timed out after {timeout:g}s without a reward" + shadows.note(moved)
    return 0.0, f"test.sh wrote no reward to {REWARD_DIR} (exit {run.exit_code}): {tail}" + shadows.note(moved)


def harbor_tests_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str] | tuple[float, str, dict]:
    """The ``harbor_tests`` check: ``{"verifier": "harbor_tests", "files": {path: text}, "timeout": seconds}``, and
    optionally ``user``, ``workdir`` and ``env`` (a task.toml's ``[verifier]``) and ``reward`` (how named rewards
    become one: ``auto``, ``mean``, ``min`` or a reward's name; ``combine``)."""
    unknown = set(args) - {"files", "timeout", "user", "workdir", "env", "reward", "answers", "separate"}
    rule, answers = args.get("reward", "auto"), args.get("answers", [])
    if (unknown or not isinstance(args.get("files"), dict) or "test.sh" not in args["files"]
            or not isinstance(rule, str) or not isinstance(answers, list)):
        raise ValueError("harbor_tests takes files (with test.sh), timeout, user, workdir, env, reward (a rule "
                         f"name), answers (a list of paths) and separate; got {sorted(args)}")
    run = functools.partial(harbor_tests, files=args["files"], user=str(args.get("user", "root")),
                            workdir=args.get("workdir"), env=args.get("env"), rule=rule,
                            answers=tuple(str(a) for a in answers))
    if args.get("separate") is None:
        return run(sandbox, timeout=float(args.get("timeout", 600.0)))
    return separate.graded_apart(sandbox, separate.SeparateArgs.of(args["separate"]), run)


harbor_tests_verifier.reward_rule = True  # its checks take "reward": auto | mean | min | a reward's name
