"""Harbor grading: after the episode, the task's tests/ go in as root and test.sh writes the reward.

Harbor semantics, with what the policy could have planted taken away first: ``/tests`` and ``/logs`` are removed and
made again, root-owned, before anything is copied or run, so a reward file or a doctored test.sh the policy left
there (an image may even let it write those paths) is gone. The tests are never in the sandbox during the episode:
they travel inside the task's check. test.sh runs in a fresh shell (not the policy's session) with a timeout, as
the task's verifier user (root by default) in the image's WORKDIR (terminal-bench's test.sh refuses to run from /),
with the task's ``[verifier] env``, and with root's own HOME and no Python user site (one-off root commands:
environments/sandbox/clean_context.py). Modules the policy planted in the WORKDIR under names test.sh's Python would
import (``pytest.py``) are set aside first (sandforge/shadows.py).
"""

from __future__ import annotations

import base64
import json
import shlex

from sandforge import shadows
from sandforge.types import Sandbox

TESTS_DIR = "/tests"
LOGS_DIR = "/logs"
REWARD_DIR = "/logs/verifier"
PREPARE_TIMEOUT = 30.0


def _reward_from(text: str, where: str) -> float:
    """The number in reward.txt, or in reward.json (a number, or {"reward": number})."""
    if where.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"test.sh wrote {where} that is not JSON: {e}") from None
        value = data.get("reward") if isinstance(data, dict) else data
    else:
        value = text.strip()
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"test.sh wrote {where} without a number (a number, or {{\"reward\": number}} in "
                         f"reward.json): {text[:80]!r}") from None
    if not 0.0 <= reward <= 1.0:
        raise ValueError(f"test.sh wrote reward {reward} to {where}; sandforge rewards are in [0, 1]")
    return reward


def harbor_tests(sandbox: Sandbox, files: dict, timeout: float, user: str = "root", workdir: str | None = None,
                 env: dict[str, str] | None = None) -> tuple[float, str]:
    """Copy ``files`` (tests/ as plain data) to a fresh root-owned /tests, run test.sh as ``user`` in ``workdir``
    (default: the sandbox's) with ``env``, read the reward."""
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
    moved = []
    if workdir in (None, sandbox.workdir):  # the policy's new shadow modules go first (sandforge/shadows.py)
        moved = shadows.set_aside(sandbox, workdir, timeout=PREPARE_TIMEOUT)
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items() if k.isidentifier())
    run = sandbox.exec(f"{exports}bash {shlex.quote(TESTS_DIR + '/test.sh')}", timeout=timeout, user=user,
                       workdir=workdir, session=False)
    tail = run.output.strip()[-300:]
    for name in ("reward.txt", "reward.json"):
        text = sandbox.read_file(f"{REWARD_DIR}/{name}", user="root")
        if text is not None:
            reward = _reward_from(text, f"{REWARD_DIR}/{name}")
            return reward, f"test.sh: reward {reward:g} (exit {run.exit_code})" + shadows.note(moved)
    if run.timed_out:
        return 0.0, f"test.sh timed out after {timeout:g}s without a reward" + shadows.note(moved)
    return 0.0, f"test.sh wrote no reward to {REWARD_DIR} (exit {run.exit_code}): {tail}" + shadows.note(moved)


def harbor_tests_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str]:
    """The ``harbor_tests`` check: ``{"verifier": "harbor_tests", "files": {path: text}, "timeout": seconds}``, and
    optionally ``user``, ``workdir`` and ``env`` (a task.toml's ``[verifier]``)."""
    unknown = set(args) - {"files", "timeout", "user", "workdir", "env"}
    if unknown or not isinstance(args.get("files"), dict) or "test.sh" not in args["files"]:
        raise ValueError(f"harbor_tests takes files (with test.sh), timeout, user, workdir and env; got {sorted(args)}")
    return harbor_tests(sandbox, args["files"], float(args.get("timeout", 600.0)), str(args.get("user", "root")),
                        args.get("workdir"), args.get("env"))
