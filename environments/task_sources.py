"""Where an environment's tasks come from: a seeded generator, a JSONL file, or folders its entry's loader reads
(Harbor task directories).

Every source answers the same three questions, so the sampler and ``sandforge envs list`` treat them alike:
``families()``, ``task(family, seed, split)`` (same arguments -> same task) and ``count(split)`` (None for a seeded
generator, which never runs out). ``images`` names the extra images its tasks need (Harbor tasks bring their own).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sandforge.registry import environments
from sandforge.types import STEP_REWARDS, Task
from sandforge.environments.seeding import SPLITS

_NUMBER_OR_NULL = (int, float, type(None))
_TASK_FIELDS = {"id": str, "env": str, "family": str, "seed": int, "instruction": str, "setup": dict, "checks": list,
                "solution": list, "split": str, "success_at": _NUMBER_OR_NULL, "image": (str, type(None)),
                "sandbox": dict, "agent_timeout": _NUMBER_OR_NULL, "grading_image": (str, type(None)), "steps": list,
                "step_reward": str}
_STEP_FIELDS = {"name": str, "instruction": str, "checks": list, "place": str, "setup": str,
                "min_reward": _NUMBER_OR_NULL, "agent_timeout": _NUMBER_OR_NULL}
_REQUIRED = ("id", "env", "family", "instruction", "checks")


class TaskSourceError(ValueError):
    """Tasks that cannot be loaded; the message names the file (and line) and what was expected."""


@dataclass
class ProceduralSource:
    """A task module's seeded families (``FAMILIES``, through the entry's ``make_task``): endless tasks, train/heldout
    from disjoint pools."""

    family_names: list[str]
    make: Callable[[str, int, str], Task]
    origin: str = "seeded"
    images: dict[str, Any] = field(default_factory=dict)  # image name -> folder or images.BuildContext

    def families(self) -> list[str]:
        return list(self.family_names)

    def task(self, family: str, seed: int, split: str = "train") -> Task:
        return self.make(family, seed, split)

    def count(self, split: str) -> int | None:
        return None


@dataclass
class FiniteSource:
    """A fixed list of tasks (a JSONL file, Harbor directories). ``task`` picks by seed within family and split, so a
    seeded sampler draws uniformly and the same seed always gives the same task."""

    tasks: list[Task]
    origin: str  # the file or folder, for messages
    images: dict[str, Any] = field(default_factory=dict)  # image name -> folder or images.BuildContext

    def families(self) -> list[str]:
        return sorted({t.family for t in self.tasks})

    def task(self, family: str, seed: int, split: str = "train") -> Task:
        pool = [t for t in self.tasks if t.family == family and t.split == split]
        if not pool:
            raise TaskSourceError(f"{self.origin}: no {split} tasks of family {family!r} (families: "
                                  f"{', '.join(self.families())}; splits: {', '.join(self.splits())})")
        return pool[seed % len(pool)]

    def count(self, split: str) -> int:
        return sum(t.split == split for t in self.tasks)

    def splits(self) -> list[str]:
        return [s for s in SPLITS if self.count(s)]


def heldout_by_hash(name: str, fraction: float) -> bool:
    """A stable choice of the held-out ``fraction`` of tasks, by their names (the same on every machine)."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def task_from_dict(d: Any, where: str) -> Task:
    """A Task from its dict shape (``sandforge.types.Task``), checked field by field; errors start with ``where``."""
    if not isinstance(d, dict):
        raise TaskSourceError(f"{where}: expected a JSON object (a task), got {type(d).__name__}")
    unknown = sorted(set(d) - set(_TASK_FIELDS))
    if unknown:
        raise TaskSourceError(f"{where}: unknown task field(s) {', '.join(unknown)}; fields: {', '.join(_TASK_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise TaskSourceError(f"{where}: missing task field(s) {', '.join(missing)}")
    for key, kind in _TASK_FIELDS.items():
        if key in d and (not isinstance(d[key], kind) or (kind in (int, _NUMBER_OR_NULL) and isinstance(d[key], bool))):
            name = ("a number or null" if kind == _NUMBER_OR_NULL else "a string or null") if isinstance(kind, tuple) \
                else kind.__name__
            raise TaskSourceError(f"{where}: '{key}' must be {name}, got {json.dumps(d[key])[:60]}")
    if d.get("success_at") is not None and not 0 < d["success_at"] <= 1:
        raise TaskSourceError(f"{where}: 'success_at' must be in (0, 1], got {d['success_at']}")
    if d.get("split", "train") not in SPLITS:
        raise TaskSourceError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {d['split']!r}")
    if not d["checks"]:
        raise TaskSourceError(f"{where}: 'checks' is empty: nothing could score the task")
    for i, check in enumerate(d["checks"]):
        if not isinstance(check, dict) or not isinstance(check.get("verifier"), str):
            raise TaskSourceError(f"{where}: checks[{i}] must be an object with a 'verifier' name, got {check!r}")
    for i, call in enumerate(d.get("solution", [])):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
                not isinstance(call.get("arguments", {}), dict) or set(call) - {"name", "arguments", "id"}:
            raise TaskSourceError(f"{where}: solution[{i}] must be {{\"name\": str, \"arguments\": {{...}}}}, "
                                  f"got {call!r}")
    if d.get("step_reward", "mean") not in STEP_REWARDS:
        raise TaskSourceError(f"{where}: 'step_reward' must be one of {', '.join(STEP_REWARDS)}, got "
                              f"{d['step_reward']!r}")
    for i, step in enumerate(d.get("steps", [])):
        at = f"{where}: steps[{i}]"
        if not isinstance(step, dict) or set(step) - set(_STEP_FIELDS) or not {"name", "instruction", "checks"} <= \
                set(step):
            raise TaskSourceError(f"{at} must be an object with name, instruction and checks (and optionally "
                                  f"place, setup, min_reward, agent_timeout), got {json.dumps(step)[:80]}")
        for key, kind in _STEP_FIELDS.items():
            if key in step and (not isinstance(step[key], kind) or isinstance(step[key], bool)):
                raise TaskSourceError(f"{at}: '{key}' has the wrong type, got {json.dumps(step[key])[:60]}")
        if not step["checks"] or not all(isinstance(c, dict) and isinstance(c.get("verifier"), str)
                                         for c in step["checks"]):
            raise TaskSourceError(f"{at}: 'checks' must be a non-empty list of objects with a 'verifier' name")
    try:
        return Task.from_dict({"seed": 0, **d})
    except ValueError as e:  # the sandbox's settings: TaskSandbox names what it does not know
        raise TaskSourceError(f"{where}: {e}") from None


def load_jsonl(path: Path, env: str | None = None) -> list[Task]:
    """One Task per line (blank lines skipped). Every error names the file and line; ids must be unique; with ``env``,
    every task must belong to that environment."""
    path = Path(path)
    if not path.is_file():
        raise TaskSourceError(f"{path}: no such file (expected JSON lines, one task per line)")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskSourceError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        task = task_from_dict(d, where)
        if env is not None and task.env != env:
            raise TaskSourceError(f"{where}: task {task.id!r} is for env {task.env!r}, but this file is used by "
                                  f"the {env!r} environment")
        if task.id in seen:
            raise TaskSourceError(f"{where}: task id {task.id!r} repeats line {seen[task.id]}")
        seen[task.id] = n
        tasks.append(task)
    if not tasks:
        raise TaskSourceError(f"{path}: no tasks (expected one JSON task per line)")
    return tasks


def open_source(entry: Any, tasks: Path | None = None, harbor_mode: str = "root", heldout: float = 0.0,
                ident: str | None = None, args: dict | None = None) -> ProceduralSource | FiniteSource:
    """The task source of a registry entry: its seeded families, or the path ``tasks``, read by the entry's folder
    loader when it has one (Harbor's, with ``harbor_mode`` and the ``heldout`` fraction: environments/harbor/tasks.py),
    else as a JSONL file; for a library environment (verifiers), the tasks of its ``ident`` made with ``args``."""
    if entry.library_loader is not None:
        if not ident:
            raise TaskSourceError(f"the {entry.name!r} environment needs `id`: the installed environment module to "
                                  "run (e.g. id: reverse_words)")
        return FiniteSource(entry.load_library(ident, args or {}, heldout), f"{entry.name} environment {ident!r}")
    if ident or args:
        raise TaskSourceError(f"the {entry.name!r} environment takes no `id` or `args` (they name a verifiers "
                              "environment: name: verifiers)")
    if tasks is None:
        if not entry.families():
            raise TaskSourceError(f"the {entry.name!r} environment has no seeded tasks: give it `tasks:` (a JSONL "
                                  "file or a Harbor task directory)")
        return ProceduralSource(entry.families(), entry.make_task())
    tasks = Path(tasks)
    if entry.folder_loader is not None:
        found, images = entry.load_folder(tasks, harbor_mode, heldout)
        return FiniteSource(found, str(tasks), images)
    if tasks.is_dir():
        readers = " or ".join(repr(name) for name, e in environments().items() if e.folder_loader is not None)
        raise TaskSourceError(f"{tasks}: a directory of tasks runs in the {readers} environment, not {entry.name!r} "
                              "(which reads a JSONL file)")
    return FiniteSource(load_jsonl(tasks, env=entry.name), str(tasks))
