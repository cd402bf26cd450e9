"""Where environments are found: built-ins by import path, plugins by entry point.

Core code must not import the parts, so built-ins are named by ``module:attribute`` strings and resolved lazily. An
environment entry resolves to a dict with ``env`` (the gymnasium env class) and ``make_task``/``families`` (its task source).
Plugins register the same shape under the ``sandforge.environments`` entry-point group.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

BUILTIN_ENVIRONMENTS = {
    "terminal": ("sandforge.environments.terminal.env:TerminalEnv", "sandforge.environments.terminal.tasks"),
    "browser": ("sandforge.environments.browser.env:BrowserEnv", "sandforge.environments.browser.tasks"),
}


@dataclass(frozen=True)
class EnvironmentEntry:
    name: str
    env_path: str  # "module:Class"
    tasks_module: str  # module with FAMILIES and make_task(family, seed, split)

    def env_class(self) -> type:
        return resolve(self.env_path)

    def families(self) -> list[str]:
        return list(importlib.import_module(self.tasks_module).FAMILIES)

    def make_task(self) -> Callable[..., Any]:
        return importlib.import_module(self.tasks_module).make_task


def resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def environments() -> dict[str, EnvironmentEntry]:
    found = {name: EnvironmentEntry(name, *paths) for name, paths in BUILTIN_ENVIRONMENTS.items()}
    for ep in entry_points(group="sandforge.environments"):
        spec = ep.load()  # a dict {"env": "module:Class", "tasks": "module"}
        found[ep.name] = EnvironmentEntry(ep.name, spec["env"], spec["tasks"])
    return found


def environment(name: str) -> EnvironmentEntry:
    envs = environments()
    if name not in envs:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(sorted(envs))}")
    return envs[name]
