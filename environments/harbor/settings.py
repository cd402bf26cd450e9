"""A Harbor task's ``task.toml``, read as Harbor reads it: what sandforge honours, and a warning naming what it does
not (never ignored silently).

Honoured: ``[agent] timeout_sec`` (the episode's time limit) and ``user``; ``[verifier] timeout_sec`` (Harbor's
default 600 s) and ``env`` (test.sh's environment); ``[solution] env`` (solve.sh's); ``[environment] cpus``,
``memory_mb``, ``storage_mb`` (the cap of the WORKDIR, a tmpfs filled from the image) and ``workdir``; ``[metadata]
category`` (the family) and sandforge's ``split``. Job settings win over the task's where the job gives them
explicitly (``sandbox.cpus``, ``sandbox.memory``, ``rollout.episode_timeout``). Not honoured, and so warned about:
``allow_internet = true`` (sandboxes have no network), and any key sandforge does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

VERIFIER_TIMEOUT = 600.0  # Harbor's default
AGENT_TIMEOUT = None  # none: the job's rollout limits apply

KNOWN = {  # section -> its keys sandforge knows (None: any; [metadata] only describes the task)
    "version": None,
    "metadata": None,
    "agent": {"timeout_sec", "user"},
    "verifier": {"timeout_sec", "user", "env"},
    "solution": {"env"},
    "environment": {"cpus", "memory_mb", "storage_mb", "allow_internet", "workdir", "build_timeout_sec",
                    "docker_image", "gpus"},
}


class HarborSettingsError(ValueError):
    """A task.toml value sandforge cannot use; the message names the file and the key."""


@dataclass
class HarborSettings:
    agent_timeout: float | None = AGENT_TIMEOUT
    agent_user: str = "root"
    verifier_timeout: float = VERIFIER_TIMEOUT
    verifier_user: str = "root"
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    workdir: str | None = None
    docker_image: str | None = None
    not_honoured: list[str] = field(default_factory=list)  # "[environment] allow_internet = true (...)", unknown keys

    def sandbox(self) -> dict:
        """The task's part of its sandbox's spec (``task.setup["sandbox"]``)."""
        out: dict = {"user": self.agent_user}
        if self.workdir:
            out["workdir"] = self.workdir
        if self.cpus:
            out["cpus"] = float(self.cpus)
        if self.memory_mb:
            out["memory"] = f"{int(self.memory_mb)}m"
        if self.storage_mb:  # the workspace's cap (a tmpfs: it counts towards memory too)
            out["workspace_size"] = f"{int(self.storage_mb)}m"
        return out


def _number(value, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise HarborSettingsError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _env(value, where: str, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise HarborSettingsError(f"{where}: {key} must be a table of NAME = value")
    return {k: str(v) for k, v in value.items()}


def read_settings(meta: dict, where: Path | str) -> HarborSettings:
    """``meta``: task.toml parsed; ``where``: the file, for messages."""
    s = HarborSettings()
    agent, verifier = meta.get("agent", {}), meta.get("verifier", {})
    solution, env = meta.get("solution", {}), meta.get("environment", {})
    if "timeout_sec" in agent:
        s.agent_timeout = _number(agent["timeout_sec"], where, "[agent] timeout_sec")
    if "user" in agent:
        s.agent_user = str(agent["user"])
    if "timeout_sec" in verifier:
        s.verifier_timeout = _number(verifier["timeout_sec"], where, "[verifier] timeout_sec")
    if "user" in verifier:
        s.verifier_user = str(verifier["user"])
    if "env" in verifier:
        s.verifier_env = _env(verifier["env"], where, "[verifier] env")
    if "env" in solution:
        s.solution_env = _env(solution["env"], where, "[solution] env")
    if "cpus" in env:
        s.cpus = _number(env["cpus"], where, "[environment] cpus")
    if "memory_mb" in env:
        s.memory_mb = int(_number(env["memory_mb"], where, "[environment] memory_mb"))
    if "workdir" in env:
        s.workdir = str(env["workdir"])
    if "docker_image" in env:
        s.docker_image = str(env["docker_image"])
    if env.get("allow_internet"):
        s.not_honoured.append("[environment] allow_internet = true (sandboxes have no network)")
    if "storage_mb" in env:
        s.storage_mb = int(_number(env["storage_mb"], where, "[environment] storage_mb"))
    if env.get("gpus"):
        s.not_honoured.append("[environment] gpus (sandboxes get no GPU)")
    for section, value in meta.items():
        if section not in KNOWN:
            s.not_honoured.append(f"[{section}]" if isinstance(value, dict) else section)
        elif isinstance(value, dict) and KNOWN[section] is not None:
            s.not_honoured += [f"[{section}] {k}" for k in sorted(value) if k not in KNOWN[section]]
    return s
