"""A Harbor task's ``task.toml``, read as Harbor (0.25, schema_version 1.0 to 1.4) reads it: what sandforge honours,
and a warning naming what it does not (never ignored silently). The file is typed by phase with pydantic, as Harbor's
own model types it (``TaskToml``: ``[agent]``, ``[verifier]``, ``[solution]``, ``[environment]``); a value of the
wrong kind names the file and the key.

Honoured: ``[agent] timeout_sec`` (the episode's time limit) and ``user``; ``[environment] healthcheck`` (run before
the agent starts: healthcheck.py); ``[verifier] environment_mode = "separate"``, ``[verifier.environment]
docker_image``, ``artifacts`` and ``[[verifier.collect]]`` (a separate verifier: separate.py); ``[verifier]
timeout_sec`` (Harbor's default 600 s), ``user`` and ``env`` (test.sh's environment); ``[solution] env`` (solve.sh's);
``[environment] env`` (every exec's: the agent's commands, solve.sh and test.sh, under their own tables, which win, as
in Harbor), ``cpus``, ``memory_mb``, ``storage_mb`` (the cap of the WORKDIR, a tmpfs filled from the image; the
deprecated ``memory`` and ``storage`` sizes too), ``workdir`` and ``docker_image``; ``[metadata] category`` (the
family) and sandforge's ``split``. Accepted as descriptions: ``schema_version`` (or the deprecated ``version``),
``[task]``, ``source``, ``[metadata]``, ``build_timeout_sec``, and settings that ask for what sandforge does anyway
(``os = "linux"``, ``network_mode = "no-network"``, an empty ``mcp_servers`` or ``artifacts``). An env value
``${VAR:-default}`` takes its default: the host's own variables never reach a sandbox. Job settings win over the
task's where the job gives them explicitly (``sandbox.cpus``, ``sandbox.memory``, ``rollout.episode_timeout``).
Everything else is named in ``not_honoured``, one entry per key, saying why.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sandforge.environments.harbor.healthcheck import Healthcheck

VERIFIER_TIMEOUT = 600.0  # Harbor's default
AGENT_TIMEOUT = None  # none: the job's rollout limits apply

KNOWN = {  # section -> its keys sandforge reads (None: any; these only describe the task)
    "version": None, "schema_version": None, "source": None, "task": None, "metadata": None, "artifacts": None,
    "steps": None, "multi_step_reward_strategy": None,  # a multi-step task's: read by ``read_steps``
    "agent": {"timeout_sec", "user", "network_mode", "allowed_hosts"},
    "verifier": {"timeout_sec", "user", "env", "network_mode", "allowed_hosts", "environment_mode", "environment",
                 "collect"},
    "solution": {"env"},
    "environment": {"cpus", "memory_mb", "storage_mb", "memory", "storage", "allow_internet", "workdir",
                    "build_timeout_sec", "docker_image", "gpus", "env", "os", "mcp_servers", "network_mode",
                    "allowed_hosts", "gpu_types", "tpu", "skills_dir", "healthcheck"},
}
# keys that are fine absent, empty or at the value given, and otherwise ask for what sandforge cannot do
NOT_SUPPORTED = {
    ("environment", "gpus"): (0, "sandboxes get no GPU"),
    ("environment", "gpu_types"): (None, "sandboxes get no GPU"),
    ("environment", "tpu"): (None, "sandboxes get no TPU"),
    ("environment", "mcp_servers"): (None, "no MCP servers are started for the agent"),
    ("environment", "skills_dir"): (None, "no skills are copied for the agent"),
}
# [verifier.environment] keys a separate verifier's sandbox honours or accepts as they are; others are named
VERIFIER_ENVIRONMENT = {"docker_image", "build_timeout_sec", "os", "network_mode", "allow_internet", "gpus"}
MAIN = "main"  # the agent's container, the only one a task runs in here (Harbor's compose service name)
NO_NETWORK = "sandboxes have no network"
TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")  # Harbor's ${VAR} / ${VAR:-default}


def shell_exports(env: dict[str, str]) -> str:
    """``env`` as one bash ``export`` line (names checked by ``read_settings``), or "" when empty."""
    return f"export {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())}\n" if env else ""


@dataclass(frozen=True)
class Artifact:
    """One of task.toml's ``artifacts``: a path in the agent's sandbox that a separate verifier receives at the same
    path, less what matches ``exclude`` (tar patterns, Harbor's). Harbor's ``destination`` (where its host keeps the
    file) has no meaning here."""

    source: str
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class CollectHook:
    """A ``[[verifier.collect]]`` command: run in the agent's sandbox after the episode, before the artifacts are
    taken (it snapshots state into files an artifact names, ``git diff > /logs/artifacts/model.patch``)."""

    command: str
    timeout: float = 60.0
    user: str | None = None  # None: the agent's user


@dataclass(frozen=True)
class SeparateVerifier:
    """``[verifier] environment_mode = "separate"`` (or a ``[verifier.environment]``): test.sh runs in a fresh sandbox
    of its own image that receives only the ``artifacts`` (and Harbor's ``/logs/artifacts``) from the agent's.
    ``docker_image``: ``[verifier.environment] docker_image`` (else tests/Dockerfile, else the task's own image).
    The grader's sandbox has the agent's limits."""

    artifacts: tuple[Artifact, ...] = ()
    collect: tuple[CollectHook, ...] = ()
    docker_image: str | None = None


class HarborSettingsError(ValueError):
    """A task.toml value sandforge cannot use; the message names the file and the key."""


@dataclass
class StepSettings:
    """One step of a multi-step task as it runs: the task's settings under the step's own."""

    name: str
    min_reward: float | None
    agent_timeout: float | None
    verifier_timeout: float
    verifier_user: str
    verifier_env: dict[str, str]


@dataclass
class HarborSettings:
    agent_timeout: float | None = AGENT_TIMEOUT
    agent_user: str = "root"
    verifier_timeout: float = VERIFIER_TIMEOUT
    verifier_user: str = "root"
    env: dict[str, str] = field(default_factory=dict)  # [environment] env: every exec's
    verifier_env: dict[str, str] = field(default_factory=dict)  # test.sh's: [environment] env under [verifier] env
    solution_env: dict[str, str] = field(default_factory=dict)  # solve.sh's: [environment] env under [solution] env
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    workdir: str | None = None
    docker_image: str | None = None
    not_honoured: list[str] = field(default_factory=list)  # "[environment] allow_internet = true (...)", unknown keys
    separate: SeparateVerifier | None = None  # [verifier] environment_mode = "separate": test.sh in its own sandbox
    steps: list[StepSettings] = field(default_factory=list)  # [[steps]]: a multi-step task's, in order
    step_reward: str = "mean"  # multi_step_reward_strategy
    healthcheck: Healthcheck | None = None  # [environment] healthcheck: run before the agent starts

    def sandbox(self) -> dict:
        """The task's part of its sandbox's spec (``Task.sandbox``'s fields)."""
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


def _env(value, where: str, key: str, s: HarborSettings) -> dict[str, str]:
    """A table of NAME = value; a ``${VAR:-default}`` value takes its default, a ``${VAR}`` one is left out (and
    named in ``s.not_honoured``): the host's variables do not reach sandboxes."""
    if not isinstance(value, dict):
        raise HarborSettingsError(f"{where}: {key} must be a table of NAME = value")
    out = {}
    for name, v in value.items():
        if not (name.isidentifier() and name.isascii()):  # bash cannot export it
            s.not_honoured.append(f"{key} {name} (not a shell variable name)")
            continue
        template = TEMPLATE.fullmatch(str(v))
        if template and template.group(2) is None:
            s.not_honoured.append(f"{key} {name} = {v} (the host's variables do not reach sandboxes)")
            continue
        out[name] = template.group(2) if template else str(v)
    return out


def _size_mb(value, where: str, key: str) -> int:
    """Harbor's deprecated ``memory`` / ``storage``: "512M", "2G"."""
    text = str(value).strip().upper()
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    try:
        return int(float(text[:-1]) * units[text[-1]])
    except (KeyError, ValueError, IndexError):
        raise HarborSettingsError(f"{where}: {key} must be a size like '512M' or '2G', got {value!r}") from None


def _not_honoured(meta: dict, s: HarborSettings) -> None:
    """What the task asks for that sandforge cannot do, one entry per key, in the file's order."""
    if meta.get("artifacts") and s.separate is None:
        s.not_honoured.append("artifacts (sandforge keeps no artifacts of an episode; a separate verifier receives "
                              "them)")
    for section in ("environment", "agent", "verifier"):
        table = meta.get(section, {})
        for key, value in table.items() if isinstance(table, dict) else ():
            where = f"[{section}] {key}"
            if (section, key) in NOT_SUPPORTED:
                fine, why = NOT_SUPPORTED[(section, key)]
                if value not in (None, fine, [], {}, ""):
                    s.not_honoured.append(f"{where} ({why})")
            elif key == "os" and str(value).lower() != "linux":
                s.not_honoured.append(f"{where} = {value!r} (sandboxes are Linux containers)")
            elif key == "network_mode" and value != "no-network":
                s.not_honoured.append(f"{where} = {value!r} ({NO_NETWORK})")
            elif key == "allowed_hosts" and value:
                s.not_honoured.append(f"{where} ({NO_NETWORK})")
            elif key == "allow_internet" and value:
                s.not_honoured.append(f"{where} = true ({NO_NETWORK})")
            elif section == "verifier" and key == "environment" and isinstance(value, dict):
                for inner, v in value.items():
                    if inner in ("cpus", "memory_mb", "memory", "storage_mb", "storage"):
                        s.not_honoured.append(f"[verifier.environment] {inner} (the grader's sandbox has the "
                                              "agent's limits)")
                    elif inner not in VERIFIER_ENVIRONMENT:
                        s.not_honoured.append(f"[verifier.environment] {inner}")
                    elif inner == "network_mode" and v != "no-network" or inner == "allow_internet" and v:
                        s.not_honoured.append(f"[verifier.environment] {inner} = {v!r} ({NO_NETWORK})")
                    elif inner == "gpus" and v:
                        s.not_honoured.append("[verifier.environment] gpus (sandboxes get no GPU)")
    for section, value in meta.items():
        if section not in KNOWN:
            s.not_honoured.append(f"[{section}]" if isinstance(value, dict) else section)
        elif isinstance(value, dict) and KNOWN[section] is not None:
            s.not_honoured += [f"[{section}] {k}" for k in sorted(value) if k not in KNOWN[section]]


class _Phase(BaseModel):
    """One table of task.toml, typed as Harbor's own model types it; a key sandforge does not read stays (it is named
    in ``not_honoured``), and a value it reads of the wrong kind names the file and the key."""

    model_config = ConfigDict(extra="allow")

    @field_validator("timeout_sec", "cpus", "memory_mb", "storage_mb", mode="before", check_fields=False)
    @classmethod
    def _positive(cls, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"must be a positive number, got {value!r}")
        return value

    @field_validator("user", "workdir", "docker_image", mode="before", check_fields=False)
    @classmethod
    def _text(cls, value):
        return None if value is None else str(value)


class AgentPhase(_Phase):
    timeout_sec: float | None = AGENT_TIMEOUT
    user: str = "root"


class CollectPhase(_Phase):
    command: str
    timeout_sec: float = 60.0
    user: str | None = None
    service: str = MAIN


class ArtifactEntry(BaseModel):
    """An ``artifacts`` table: ``{source = "/app", exclude = [".git"]}`` (``destination`` and ``service`` kept)."""

    model_config = ConfigDict(extra="allow")
    source: str
    destination: str | None = None
    exclude: list[str] = Field(default_factory=list)
    service: str | None = None


class SolutionPhase(_Phase):
    env: Any = None


class HealthcheckPhase(_Phase):
    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3

    @field_validator("interval_sec", "start_period_sec", "start_interval_sec", "retries", mode="before")
    @classmethod
    def _not_negative(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"must be a number of at least 0, got {value!r}")
        return value


class EnvironmentPhase(_Phase):
    cpus: float | None = None
    memory_mb: float | None = None
    storage_mb: float | None = None
    memory: Any = None  # Harbor's deprecated sizes, "512M"
    storage: Any = None
    workdir: str | None = None
    docker_image: str | None = None
    env: Any = None
    healthcheck: HealthcheckPhase | None = None


class VerifierPhase(_Phase):
    timeout_sec: float = VERIFIER_TIMEOUT
    user: str = "root"
    env: Any = None  # a table of NAME = value, read by ``_env`` (host templates, names bash can export)
    environment_mode: Literal["shared", "separate"] | None = None  # None: separate when there is an environment
    environment: EnvironmentPhase | None = None
    collect: list[CollectPhase] = Field(default_factory=list)


class StepAgentPhase(_Phase):
    timeout_sec: float | None = None  # None: the task's [agent]
    user: str | None = None


class StepVerifierPhase(_Phase):
    timeout_sec: float | None = None  # None: the task's [verifier]
    user: str | None = None
    env: Any = None


class StepPhase(_Phase):
    """One ``[[steps]]`` entry: its folder's name, its reward gate and its agent's and verifier's overrides."""

    name: str
    min_reward: float | dict[str, float] | None = None
    agent: StepAgentPhase = Field(default_factory=StepAgentPhase)
    verifier: StepVerifierPhase = Field(default_factory=StepVerifierPhase)

    @field_validator("name", mode="before")
    @classmethod
    def _folder_name(cls, value):
        if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise ValueError(f"must be a folder name (letters, digits, '.', '_' and '-'), got {value!r}")
        return value


class TaskToml(BaseModel):
    """task.toml by phase: the agent's, the verifier's, the solution's and the environment's tables; the rest (``[task]``,
    ``[metadata]``, ``schema_version``, ...) describes the task."""

    model_config = ConfigDict(extra="allow")
    agent: AgentPhase = Field(default_factory=AgentPhase)
    verifier: VerifierPhase = Field(default_factory=VerifierPhase)
    solution: SolutionPhase = Field(default_factory=SolutionPhase)
    environment: EnvironmentPhase = Field(default_factory=EnvironmentPhase)
    artifacts: list[str | ArtifactEntry] = Field(default_factory=list)
    steps: list[StepPhase] = Field(default_factory=list)
    multi_step_reward_strategy: Literal["mean", "final"] | None = None


def _toml(meta: dict, where: Path | str) -> TaskToml:
    try:
        return TaskToml.model_validate(meta)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        key = f"[{loc[0]}] {' '.join(loc[1:])}".strip()
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
            message = f"must be a table, got {first.get('input')!r}"
        elif first["type"] == "literal_error":
            message = f"must be one of {first['ctx']['expected']}, got {first.get('input')!r}"
        elif first["type"] == "missing":
            key, message = f"[{loc[0]}] {' '.join(loc[1:-1])}".strip(), f"needs {loc[-1]}"
        elif first["type"].startswith(("float_", "string_", "int_")):
            message = f"must be a {'number' if not first['type'].startswith('string') else 'string'}, got " \
                      f"{first.get('input')!r}"
        raise HarborSettingsError(f"{where}: {key} {message}") from None


def read_settings(meta: dict, where: Path | str) -> HarborSettings:
    """``meta``: task.toml parsed; ``where``: the file, for messages."""
    toml = _toml(meta, where)
    agent, verifier, solution, env = toml.agent, toml.verifier, toml.solution, toml.environment
    s = HarborSettings(agent_timeout=agent.timeout_sec, agent_user=agent.user, verifier_timeout=verifier.timeout_sec,
                       verifier_user=verifier.user, cpus=env.cpus, workdir=env.workdir, docker_image=env.docker_image)
    if env.env is not None:
        s.env = _env(env.env, where, "[environment] env", s)
    s.verifier_env = {**s.env, **_env({} if verifier.env is None else verifier.env, where, "[verifier] env", s)}
    s.solution_env = {**s.env, **_env({} if solution.env is None else solution.env, where, "[solution] env", s)}
    if env.memory is not None:
        s.memory_mb = _size_mb(env.memory, where, "[environment] memory")
    if env.memory_mb is not None:
        s.memory_mb = int(env.memory_mb)
    if env.storage is not None:
        s.storage_mb = _size_mb(env.storage, where, "[environment] storage")
    if env.storage_mb is not None:
        s.storage_mb = int(env.storage_mb)
    s.separate = _separate(toml, where, s)
    s.steps, s.step_reward = _steps(toml, where, s), toml.multi_step_reward_strategy or "mean"
    if (check := env.healthcheck) is not None:
        s.healthcheck = Healthcheck(check.command, float(check.interval_sec), float(check.timeout_sec),
                                    float(check.start_period_sec), float(check.start_interval_sec),
                                    max(1, int(check.retries)))
    _not_honoured(meta, s)
    return s


def _steps(toml: TaskToml, where: Path | str, s: HarborSettings) -> list[StepSettings]:
    """The task's ``[[steps]]``, each over the task's own agent and verifier settings (Harbor's fallback). A step's
    own agent user, a per-key ``min_reward`` and a separate verifier are not run here: said in ``not_honoured``."""
    out, names = [], set()
    for i, step in enumerate(toml.steps):
        if step.name in names:
            raise HarborSettingsError(f"{where}: [[steps]] {i}: a second step named {step.name!r}")
        names.add(step.name)
        gate = step.min_reward
        if isinstance(gate, dict):
            s.not_honoured.append(f"[[steps]] {step.name}: min_reward per reward key (the step's one reward is gated "
                                  "by the smallest of them)")
            gate = min(gate.values()) if gate else None
        if step.agent.user is not None and step.agent.user != s.agent_user:
            s.not_honoured.append(f"[[steps]] {step.name}: agent user {step.agent.user!r} (every step acts as the "
                                  "task's agent user)")
        env = {**s.verifier_env, **_env({} if step.verifier.env is None else step.verifier.env, where,
                                        f"[[steps]] {step.name} verifier env", s)}
        out.append(StepSettings(step.name, None if gate is None else float(gate), step.agent.timeout_sec or
                                s.agent_timeout, step.verifier.timeout_sec or s.verifier_timeout,
                                step.verifier.user or s.verifier_user, env))
    if out and s.separate is not None:
        raise HarborSettingsError(f"{where}: a multi-step task with a separate verifier is not supported yet (each "
                                  "step is graded in the agent's sandbox)")
    return out


GRADER_OWN = ("/tests", "/logs/verifier")  # made afresh in the grader's sandbox: no artifact is, holds or is in one


def _overlap(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/") or folder.startswith(path + "/")


def _separate(toml: TaskToml, where: Path | str, s: HarborSettings) -> SeparateVerifier | None:
    """The separate verifier a task asks for (Harbor 0.25's rule: ``environment_mode = "separate"``, or a
    ``[verifier.environment]`` without a mode), None for test.sh in the agent's sandbox."""
    verifier = toml.verifier
    if verifier.environment_mode == "shared" and verifier.environment is not None:
        raise HarborSettingsError(f"{where}: [verifier] environment_mode = 'shared' cannot have a "
                                  "[verifier.environment] (that is for environment_mode = 'separate')")
    if verifier.environment_mode != "separate" and verifier.environment is None:
        if verifier.collect:
            s.not_honoured.append("[[verifier.collect]] (its hooks feed a separate verifier's artifacts; test.sh "
                                  "runs in the agent's sandbox)")
        return None
    artifacts = []
    for entry in toml.artifacts:
        a = ArtifactEntry(source=entry) if isinstance(entry, str) else entry
        source = a.source.rstrip("/") or "/"
        if not source.startswith("/") or source == "/" or ".." in source.split("/"):
            raise HarborSettingsError(f"{where}: artifacts: {a.source!r} must be an absolute path below / "
                                      "without '..' (a file or folder of the agent's sandbox)")
        if any(_overlap(source, own) for own in GRADER_OWN):
            raise HarborSettingsError(f"{where}: artifacts: {a.source!r} would carry the agent's files into the "
                                      f"grader's own {' or '.join(GRADER_OWN)}")
        if a.service not in (None, MAIN):
            s.not_honoured.append(f"artifacts {a.source} from service {a.service!r} (only the agent's "
                                  "container runs here)")
            continue
        artifacts.append(Artifact(source, tuple(str(x) for x in a.exclude)))
    hooks = []
    for hook in verifier.collect:
        if hook.service != MAIN:
            s.not_honoured.append(f"[[verifier.collect]] in service {hook.service!r} (only the agent's container "
                                  "runs here)")
            continue
        hooks.append(CollectHook(hook.command, float(hook.timeout_sec), hook.user))
    env = verifier.environment or EnvironmentPhase()
    return SeparateVerifier(tuple(artifacts), tuple(hooks), env.docker_image)
