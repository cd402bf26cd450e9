"""Harbor task directories (the format of Harbor and terminal-bench 2.0) read as sandforge Tasks.

A task is a folder a person can read::

    <task>/instruction.md          what the policy is told
    <task>/task.toml               metadata ([metadata] category -> family; [verifier] timeout_sec)
    <task>/environment/Dockerfile  the task's image (ARG BASE=sandforge/base:bookworm / FROM ${BASE}: nothing is pulled)
    <task>/tests/test.sh           run as root after the episode; writes /logs/verifier/reward.txt (or reward.json)
    <task>/solution/solve.sh       the reference solution (optional), run through the policy's bash tool

The image must have a non-root ``sandbox`` user (the policy runs as it) and a /workspace folder, as sandforge's own
images do. ``tests/`` travels inside the task's check (plain data), so it reaches the sandbox only at grading time
and the grader never needs the host's copy. sandforge extension: ``[metadata] split = "heldout"`` puts a task in the
held-out split (default: train).
"""

from __future__ import annotations

import base64
import re
import tomllib
from pathlib import Path

from sandforge.types import Task, ToolCall

FAMILIES: dict = {}  # no seeded generator: tasks come from directories (`environments[i].tasks` in the job)
SPLITS = ("train", "heldout")
DEFAULT_TEST_TIMEOUT = 120.0
REQUIRED = ("instruction.md", "environment/Dockerfile", "tests/test.sh")


class HarborTaskError(ValueError):
    """A folder that is not a valid Harbor task; the message names the file and what it needs."""


def make_task(family: str, seed: int, split: str = "train") -> Task:
    raise ValueError("the harbor environment has no seeded tasks: point `tasks:` in its `environments` entry at a "
                     "Harbor task directory or a folder of them")


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "instruction.md").is_file()


def image_name(task_dir: Path) -> str:
    """The image repository of a task: ``harbor/<folder name>`` made a valid Docker name."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", task_dir.name.lower()).strip("-._") or "task"
    return f"harbor/{slug}"


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


def load_task(task_dir: Path) -> Task:
    """One Harbor task directory as a Task; HarborTaskError names the file that is missing or malformed."""
    task_dir = Path(task_dir).resolve()
    missing = [name for name in REQUIRED if not (task_dir / name).is_file()]
    if missing:
        raise HarborTaskError(f"{task_dir}: not a Harbor task, missing {', '.join(missing)} "
                              f"(a task needs {', '.join(REQUIRED)}; task.toml and solution/solve.sh are optional)")
    meta: dict = {}
    if (task_dir / "task.toml").is_file():
        try:
            meta = tomllib.loads((task_dir / "task.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise HarborTaskError(f"{task_dir / 'task.toml'}: not valid TOML: {e}") from None
    metadata, verifier = meta.get("metadata", {}), meta.get("verifier", {})
    split = metadata.get("split", "train")
    if split not in SPLITS:
        raise HarborTaskError(f"{task_dir / 'task.toml'}: [metadata] split = {split!r}; use one of {', '.join(SPLITS)}")
    timeout = verifier.get("timeout_sec", DEFAULT_TEST_TIMEOUT)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise HarborTaskError(f"{task_dir / 'task.toml'}: [verifier] timeout_sec must be a positive number, "
                              f"got {timeout!r}")
    solve = task_dir / "solution" / "solve.sh"
    solution = [ToolCall("bash", {"command": solve.read_text()}), ToolCall("submit")] if solve.is_file() else []
    return Task(
        id=f"harbor/{task_dir.name}",
        env="harbor",
        family=str(metadata.get("category") or "default"),
        seed=0,
        instruction=(task_dir / "instruction.md").read_text().strip(),
        setup={"image": image_name(task_dir)},
        checks=[{"verifier": "harbor_tests", "files": _test_files(task_dir / "tests"), "timeout": float(timeout)}],
        solution=solution,
        split=split,
    )


def load_tasks(path: Path) -> tuple[list[Task], dict[str, Path]]:
    """The tasks at ``path`` (one task directory, or a folder whose subfolders are tasks) and the images they need:
    image name -> the folder its Dockerfile is in."""
    path = Path(path)
    if not path.is_dir():
        raise HarborTaskError(f"{path}: no such directory (expected a Harbor task directory or a folder of them)")
    dirs = [path] if is_task_dir(path) else sorted(p for p in path.iterdir() if p.is_dir() and is_task_dir(p))
    if not dirs:
        raise HarborTaskError(f"{path}: no Harbor tasks here (a task folder holds instruction.md and task.toml)")
    tasks, images = [], {}
    for d in dirs:
        task = load_task(d)
        tasks.append(task)
        images[task.setup["image"]] = d.resolve() / "environment"
    return tasks, images
