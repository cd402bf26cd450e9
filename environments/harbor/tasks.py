"""Harbor task directories (the format of Harbor and terminal-bench 2.0) read as sandforge Tasks.

A task is a folder a person can read::

    <task>/instruction.md          what the policy is told
    <task>/task.toml               limits, timeouts, users (environments/harbor/settings.py says what is honoured)
    <task>/environment/Dockerfile  the task's image, built unmodified or on the local base (environments/harbor/dockerfile.py)
    <task>/tests/test.sh           run as root in the WORKDIR after the episode; writes /logs/verifier/reward.txt or .json
    <task>/solution/solve.sh       the reference solution (optional): `sandforge harbor check` runs it as Harbor does

The agent runs as the task's user (root unless ``[agent] user``) in the image's WORKDIR, or, in ``hardened`` mode, as
a non-root ``sandbox`` user the image build adds. ``tests/`` travels inside the task's check (plain data), so it
reaches the sandbox only at grading time and the grader never needs the host's copy; logged trajectories keep only its
files' hashes (``compact_checks``). Splits: ``[metadata] split = "heldout"`` (a sandforge extension), else a stable
hash of the task's folder name puts the ``heldout`` fraction of tasks the job asks for in the held-out split. The warm
start replays the reference through the bash tool as one command (what a policy can learn to type): solve.sh's text,
or, where solve.sh runs files beside it or has a [solution] env, the folder written into /solution and solve.sh run
there as Harbor runs it (``replay_solution``). A multi-step task (``[[steps]]`` in task.toml, ``steps/<name>/``
folders with their instruction.md, tests/ over the task's, solution/ and workdir/) becomes a Task with ``steps``
(rollout/steps.py runs them).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import tomllib
from pathlib import Path

from sandforge.environments.harbor.dockerfile import AGENT_USER, MODES, HarborBuild
from sandforge.sandbox.images import BuildContext
from sandforge.environments.harbor.separate import CONVENTION as ARTIFACTS_DIR, SeparateArgs
from sandforge.environments.harbor.settings import VERIFIER_TIMEOUT, HarborSettingsError, read_settings, shell_exports
from sandforge.environments.task_sources import TaskSourceError, heldout_by_hash
from sandforge.grading import shadows
from sandforge.types import Task, TaskSandbox, TaskStep, ToolCall
from sandforge.environments.seeding import SPLITS

FAMILIES: dict = {}  # no seeded generator: tasks come from directories (`environments[i].tasks` in the job)
DEFAULT_TEST_TIMEOUT = VERIFIER_TIMEOUT  # Harbor's 600 s
REQUIRED = ("instruction.md", "environment/Dockerfile", "tests/test.sh")
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


class HarborTaskError(ValueError):
    """A folder that is not a valid Harbor task; the message names the file and what it needs."""


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def image_name(task_dir: Path) -> str:
    """The image repository of a task: ``harbor/<folder name>`` made a valid Docker name."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", task_dir.name.lower()).strip("-._") or "task"
    return f"harbor/{slug}"


def compose_note(path: Path, shown: str) -> str | None:
    """The not-honoured line for a Harbor multi-container task's compose file: the services beside ``main`` (the
    agent's container, built from environment/Dockerfile) that are not started, by name; None for a file that only
    restates ``main``."""
    import yaml

    try:
        services = (yaml.safe_load(path.read_text(errors="replace")) or {}).get("services") or {}
    except (yaml.YAMLError, AttributeError) as e:
        return f"{shown} (not read: {type(e).__name__}; no service of it is started)"
    others = sorted(str(name) for name in services if name != "main") if isinstance(services, dict) else []
    if not others:
        return None
    return (f"{shown} (its other services are not started: {', '.join(others)}; the task runs in "
            "environment/Dockerfile's container alone)")


def _test_files(tests: Path) -> dict[str, str | dict]:
    """tests/ as plain data: relative path -> text, or {"base64": ...} for a file that is not UTF-8."""
    files: dict[str, str | dict] = {}
    for f in sorted(p for p in tests.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        data = f.read_bytes()
        try:
            files[f.relative_to(tests).as_posix()] = data.decode()
        except UnicodeDecodeError:
            files[f.relative_to(tests).as_posix()] = {"base64": base64.b64encode(data).decode()}
    return files


SHELLS = ("bash", "sh", "dash")
HEREDOC_END = "SANDFORGE_SOLVE_EOF"


def replay_command(text: str) -> str:
    """solve.sh as the warm start types it through the bash tool: its text, or, for a script whose shebang names
    another interpreter (``#!/usr/bin/perl``, ``#!/usr/bin/env python3``), that interpreter reading the script from a
    here-document, as Harbor's exec of the file would run it."""
    first = text.split("\n", 1)[0]
    interpreter = first[2:].strip() if first.startswith("#!") else ""
    words = interpreter.split()
    if words and words[0].endswith("/env"):  # `env [-S] [OPTION...] PROGRAM [ARG...]`
        words = [w for w in words[1:] if not w.startswith("-")]
    program = words[0].rsplit("/", 1)[-1] if words else ""
    if not interpreter or program in SHELLS or HEREDOC_END in text:
        return text
    return f"{interpreter} <<'{HEREDOC_END}'\n{text.rstrip(chr(10))}\n{HEREDOC_END}"


SOLUTION_DIR = "/solution"  # where Harbor puts solution/ for its oracle
ORACLE_ENV = {"DEBIAN_FRONTEND": "noninteractive"}  # Harbor's, under the task's [solution] env
FILE_END = "SANDFORGE_FILE_EOF"


def solution_mode(path: Path) -> int:
    """The mode a file of solution/ gets in /solution, as Harbor's oracle upload gives it: scripts executable."""
    return 0o755 if path.suffix == ".sh" or path.stat().st_mode & 0o111 else 0o644


def replays_as_oracle(folder: Path, env: dict[str, str]) -> bool:
    """Whether the warm start must replay ``folder`` (a task's solution/) as Harbor runs its oracle: solve.sh has
    files beside it, or a [solution] env."""
    return bool(env) or any(p.is_file() and p.name != "solve.sh" or p.is_dir() for p in folder.iterdir())


def replay_solution(folder: Path, env: dict[str, str]) -> str:
    """solution/ as the warm start types it through the bash tool. ``env``: what of solve.sh's environment the
    agent's shell lacks (its [solution] env beyond [environment] env, which HarborEnv exports before every command).
    solve.sh alone, with no such env: its text (``replay_command``). Otherwise as Harbor runs its oracle, the only
    way such a solve.sh works (it runs the files beside it, from its own folder, with its env): every file of
    solution/ written into /solution (text through a here-document, other bytes as base64), then solve.sh executed
    as a file, in a subshell that exports DEBIAN_FRONTEND=noninteractive and ``env``, so nothing it sets outlives it."""
    solve = folder / "solve.sh"
    if not replays_as_oracle(folder, env):
        return replay_command(solve.read_text())
    lines = written(folder, SOLUTION_DIR)
    lines.append(f"({shell_exports({**ORACLE_ENV, **env})}{SOLUTION_DIR}/solve.sh)")
    return "\n".join(lines)


def written(folder: Path, dest: str, leave: tuple[str, ...] = ()) -> list[str]:
    """The bash lines that write every file of ``folder`` (but the top-level ones named in ``leave``) under ``dest``,
    folders made first: text through a here-document, other bytes as base64, the executable bit kept."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in leave)
    inner = {p.parent.relative_to(folder).as_posix() for p in files} - {"."}
    folders = [dest, *(f"{dest}/{d}" for d in sorted(inner))]
    lines = [f"mkdir -p {' '.join(map(shlex.quote, folders))}"]
    for f in files:
        target = shlex.quote(f"{dest}/{f.relative_to(folder).as_posix()}")
        data = f.read_bytes()
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if text is not None and text.endswith("\n") and FILE_END not in text and "\0" not in text:
            lines.append(f"cat > {target} <<'{FILE_END}'\n{text}{FILE_END}")
        else:
            lines.append(f"base64 -d > {target} <<'{FILE_END}'\n{base64.encodebytes(data).decode()}{FILE_END}")
        if solution_mode(f) & 0o111:
            lines.append(f"chmod +x {target}")
    return lines


STEP_SETUP = "setup.sh"  # in a step's workdir/: run as root from the working directory before the step's agent


def step_place(folder: Path) -> str:
    """The bash that merges a step's ``workdir/`` (but its ``setup.sh``) into the working directory, run as the agent's
    own user (``TaskStep.place``); "" without one."""
    workdir = folder / "workdir"
    if not workdir.is_dir() or not [p for p in workdir.rglob("*") if p.is_file() and p != workdir / STEP_SETUP]:
        return ""
    return "\n".join(["set -e", *written(workdir, ".", leave=(STEP_SETUP,))])


def step_setup(folder: Path) -> str:
    """A step's ``workdir/setup.sh``, as bash reads it from a here-document, run as root from the working directory
    before the step's agent (``TaskStep.setup``); "" without one."""
    setup = folder / "workdir" / STEP_SETUP
    if not setup.is_file():
        return ""
    text = setup.read_text()
    return f"bash <<'{FILE_END}'\n{text if text.endswith(chr(10)) else text + chr(10)}{FILE_END}"


def load_task(task_dir: Path, mode: str = "root", heldout: float = 0.0) -> Task:
    """One Harbor task directory as a Task; HarborTaskError names the file that is missing or malformed. ``mode``:
    ``root`` (Harbor's: the agent as the task's user) or ``hardened`` (a non-root agent); ``heldout``: the fraction of
    tasks without a ``[metadata] split`` that go to the held-out split, by ``heldout_by_hash``."""
    task_dir = Path(task_dir).resolve()
    meta: dict = {}
    toml = task_dir / "task.toml"
    if toml.is_file():
        try:
            meta = tomllib.loads(toml.read_text())
        except tomllib.TOMLDecodeError as e:
            raise HarborTaskError(f"{toml}: not valid TOML: {e}") from None
    try:
        settings = read_settings(meta, toml)
    except HarborSettingsError as e:
        raise HarborTaskError(str(e)) from None
    required = [n for n in REQUIRED if not (settings.docker_image and n == "environment/Dockerfile")]
    if settings.steps:  # Harbor's multi-step layout: steps/<name>/ with its instruction and tests, not the root's
        required = [n for n in required if n not in ("instruction.md", "tests/test.sh")]
        for step in settings.steps:
            required.append(f"steps/{step.name}/instruction.md")
            if not (task_dir / "tests" / "test.sh").is_file():
                required.append(f"steps/{step.name}/tests/test.sh")
    missing = [name for name in required if not (task_dir / name).is_file()]
    kind = meta.get("environment", {}).get("type") if isinstance(meta.get("environment"), dict) else None
    if missing and kind not in (None, "docker"):
        raise HarborTaskError(f"{task_dir}: its environment is [environment] type = {kind!r}, which sandforge cannot "
                              "start: tasks run in local Docker containers, built from environment/Dockerfile")
    if missing:
        raise HarborTaskError(f"{task_dir}: not a Harbor task, missing {', '.join(missing)} "
                              f"(a task needs {', '.join(REQUIRED)}, or [environment] docker_image in task.toml "
                              "instead of the Dockerfile; solution/solve.sh is optional)")
    metadata = meta.get("metadata", {})
    split = metadata.get("split") or ("heldout" if heldout_by_hash(task_dir.name, heldout) else "train")
    if split not in SPLITS:
        raise HarborTaskError(f"{toml}: [metadata] split = {split!r}; use one of {', '.join(SPLITS)}")
    if mode not in MODES:
        raise HarborTaskError(f"harbor mode {mode!r}: expected one of {', '.join(MODES)}")
    # the folders that hold the instructions, tests and solutions: the task's, or each step's
    parts = [task_dir / "steps" / step.name for step in settings.steps] or [task_dir]
    # what of solve.sh's env the agent's commands lack: HarborEnv exports [environment] env before each of them
    own_env = {k: v for k, v in settings.solution_env.items() if settings.env.get(k) != v}
    solved = [(part / "solution" / "solve.sh").is_file() for part in parts]
    has_solution = all(solved)  # the warm start replays every step's, or none
    solution = [call for part in parts for call in (ToolCall("bash", {"command": replay_solution(
        part / "solution", own_env)}), ToolCall("submit"))] if has_solution else []
    sandbox = settings.sandbox() | ({"user": AGENT_USER} if mode == "hardened" else {})
    # Harbor's /logs/artifacts, where the agent and the collect hooks leave files for a separate verifier: a capped
    # folder every user may write (shared grading makes /logs afresh, so it is there only for a separate verifier)
    logs = (ARTIFACTS_DIR,) if settings.separate is not None else ()
    if logs:
        sandbox["scratch"] = logs
    if sandbox["user"] not in ("root", "0"):  # where else a non-root agent can write on the root filesystem: capped
        home = f"/home/{sandbox['user'].split(':')[0]}"
        # /solution: where a non-root agent's replay of an oracle that runs its sibling files puts them
        oracle = (SOLUTION_DIR,) if any(ok and replays_as_oracle(part / "solution", own_env)
                                        for part, ok in zip(parts, solved)) else ()
        sandbox["scratch"] = ("/var/tmp", "/run/lock", home, *oracle, *logs)
        sandbox["home"] = home  # as in Harbor, where HOME is the user's own: ~/.ssh is not the WORKDIR's
    instruction = (parts[0] / "instruction.md").read_text().strip()
    check = grading_check(_test_files(task_dir / "tests"), instruction, settings.verifier_timeout,
                          settings.verifier_user, settings.verifier_env, settings.workdir)
    steps = []
    for step, part in zip(settings.steps, parts):
        said = (part / "instruction.md").read_text().strip()
        files = {**_test_files(task_dir / "tests"), **_test_files(part / "tests")}  # the step's own files win
        steps.append(TaskStep(step.name, said, [grading_check(files, said, step.verifier_timeout, step.verifier_user,
                                                              step.verifier_env, settings.workdir)],
                              step_place(part), step_setup(part), step.min_reward, step.agent_timeout))
    if steps:
        check = steps[-1].checks[0]  # what generic code reads of the task's checks: its last step's
    grading_image = None
    if settings.separate is not None:  # test.sh in a fresh sandbox of its own that receives only the artifacts
        check["separate"] = separate_check(settings.separate, sandbox["user"], mode, settings.verifier_timeout)
        check["timeout"] = SeparateArgs.of(check["separate"]).budget()  # test.sh's, the hooks' and the transfers'
        own = verifier_build(task_dir, settings.separate.docker_image)
        grading_image = verifier_image_name(task_dir) if own else image_name(task_dir)
    setup = {"harbor_dir": str(task_dir)}
    compose = [f"environment/{n}" for n in COMPOSE_FILES if (task_dir / "environment" / n).is_file()]
    if compose and (note := compose_note(task_dir / compose[0], compose[0])):
        settings.not_honoured.insert(0, note)
    if settings.not_honoured:
        setup["not_honoured"] = settings.not_honoured
    if settings.solution_env:
        setup["solution_env"] = settings.solution_env
    if settings.env:  # [environment] env: HarborEnv exports it before each of the agent's commands
        setup["env"] = settings.env
    if settings.docker_image and not (task_dir / "environment" / "Dockerfile").is_file():
        setup["docker_image"] = settings.docker_image
    if settings.separate is not None and settings.separate.docker_image:
        setup["verifier_docker_image"] = settings.separate.docker_image
    if settings.healthcheck is not None:  # HarborEnv runs it before the agent starts
        setup["healthcheck"] = settings.healthcheck.to_dict()
    return Task(
        id=f"harbor/{task_dir.name}",
        env="harbor",
        family=str(metadata.get("category") or "default"),
        seed=0,
        instruction=instruction,
        setup=setup,
        checks=[check],
        solution=solution,
        split=split,
        image=image_name(task_dir),
        sandbox=TaskSandbox.from_dict(sandbox),
        agent_timeout=settings.agent_timeout or None,
        grading_image=grading_image,
        steps=steps,
        step_reward=settings.step_reward,
    )


def grading_check(files: dict, instruction: str, timeout: float, user: str, env: dict[str, str],
                  workdir: str | None) -> dict:
    """The ``harbor_tests`` check that runs ``files`` (tests/, as plain data) after the agent acted on
    ``instruction``."""
    check = {"verifier": "harbor_tests", "files": files, "timeout": timeout, "user": user}
    answers = shadows.answer_paths(instruction)
    if answers:  # Python files the instruction asks for: the code under test, never set aside (sandforge/grading/shadows.py)
        check["answers"] = list(answers)
    if env:
        check["env"] = env
    if workdir:
        check["workdir"] = workdir
    return check


def verifier_image_name(task_dir: Path) -> str:
    """The image of a task's separate verifier, where it has one of its own (``verifier_build``)."""
    return f"{image_name(task_dir)}-verifier"


def verifier_build(task_dir: Path, docker_image: str | None) -> HarborBuild | None:
    """How a separate verifier's own image is built: from ``tests/Dockerfile`` (tests/ its context), or FROM
    ``[verifier.environment] docker_image``; None when the verifier runs in a fresh sandbox of the task's own image.
    Built as root's: the grader is root, whatever the agent is."""
    dockerfile = task_dir / "tests" / "Dockerfile"
    if dockerfile.is_file():
        return HarborBuild(f"{task_dir.name} (verifier)", str(dockerfile), "root")
    if docker_image:
        return HarborBuild(f"{task_dir.name} (verifier)", None, "root", image=docker_image)
    return None


def separate_check(separate, agent_user: str, mode: str, test_timeout: float) -> dict:
    """The ``separate`` argument of a task's harbor_tests check: its artifacts and collect hooks. A hook runs as its
    own ``user`` only where the agent is root anyway (root mode); in hardened mode as the agent, so no root process
    ever runs over what the policy left (a hook's output is the policy's to shape either way)."""
    return {"artifacts": [{"source": a.source, "exclude": list(a.exclude)} for a in separate.artifacts],
            "collect": [{"command": h.command, "timeout": h.timeout,
                         "user": (h.user or agent_user) if mode == "root" else agent_user} for h in separate.collect],
            "test_timeout": test_timeout}


def load_tasks(path: Path, mode: str = "root", heldout: float = 0.0) -> tuple[list[Task], dict[str, BuildContext]]:
    """The tasks at ``path`` (one task directory, or a folder whose subfolders are tasks) and the images they need:
    image name -> how to build it (its folder, the Dockerfile rewritten for this host and ``mode``)."""
    path = Path(path)
    if not path.is_dir():
        raise HarborTaskError(f"{path}: no such directory (expected a Harbor task directory or a folder of them)")
    dirs = [path] if is_task_dir(path) else sorted(p for p in path.iterdir() if p.is_dir() and is_task_dir(p))
    if not dirs:
        raise HarborTaskError(f"{path}: no Harbor tasks here (a task folder holds instruction.md and task.toml)")
    tasks, images = [], {}
    for d in dirs:
        task = load_task(d, mode, heldout)
        tasks.append(task)
        env_dir = d.resolve() / "environment"
        dockerfile = env_dir / "Dockerfile"
        build = HarborBuild(task.id, str(dockerfile) if dockerfile.is_file() else None, mode,
                            image=task.setup.get("docker_image"))
        images[task.image] = BuildContext(env_dir if env_dir.is_dir() else d.resolve(), build,
                                                   user=AGENT_USER if mode == "hardened" else None)
        if task.grading_image not in (None, task.image):  # a separate verifier's own image
            images[task.grading_image] = BuildContext(
                d.resolve() / "tests", verifier_build(d.resolve(), task.setup.get("verifier_docker_image")), user=None)
    return tasks, images


def load_folder(path: Path, mode: str = "root", heldout: float = 0.0) -> tuple[list[Task], dict[str, BuildContext]]:
    """The harbor environment's folder loader (sandforge/registry.py ``FOLDER_LOADERS``): ``load_tasks``, for the
    path a job's ``tasks:`` names, which must be a directory."""
    if Path(path).is_file():
        raise TaskSourceError(f"{path}: the harbor environment reads Harbor task directories (instruction.md, "
                              "task.toml, environment/, tests/), not a file")
    return load_tasks(path, mode, heldout)


def compact_checks(task: dict) -> dict:
    """A task as a trajectory row keeps it: the Harbor tests' files by hash and size, not their contents (a
    terminal-bench task's tests/ runs to hundreds of KB, every row), each step's too."""
    def compact(checks: list) -> list:
        out = []
        for check in checks or []:
            if check.get("verifier") == "harbor_tests" and isinstance(check.get("files"), dict):
                files = {}
                for rel, content in check["files"].items():
                    data = base64.b64decode(content["base64"]) if isinstance(content, dict) else str(content).encode()
                    files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                check = {**check, "files": files}
            out.append(check)
        return out

    steps = [{**step, "checks": compact(step.get("checks"))} for step in task.get("steps") or []]
    return {**task, "checks": compact(task.get("checks")), **({"steps": steps} if steps else {})}


def with_base_map(ctx, base_map: dict[str, str] | None):
    """``ctx`` (an image's build context) with the job's ``sandbox.base_map`` when it is a Harbor task's; others as
    they are."""
    import dataclasses

    if not isinstance(getattr(ctx, "prepare", None), HarborBuild):
        return ctx
    return dataclasses.replace(ctx, prepare=dataclasses.replace(ctx.prepare, base_map=base_map))

