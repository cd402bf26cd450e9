"""A ``verifiers`` environment's tasks as sandforge tasks.

``environments: [{name: verifiers, id: MODULE, args: {...}}]`` names an installed verifiers v1 taskset package
(``MODULE`` exports a ``Taskset`` subclass, and maybe an ``Env``); ``args`` are its taskset config's fields. Each of
its tasks becomes a sandforge ``Task`` that points back at it by position (``setup["verifiers"]``): the rollout worker
loads the same environment and runs that task (rollout/vf_episode.py), so the verifiers task itself never crosses a
process boundary. Family: the module; held-out split: the job's ``heldout`` fraction, by a stable hash of the task's
key without its system prompt (``split_key``). An endless taskset is read up to ``MAX_TASKS``.

The episode is verifiers' own: its ``null`` harness's chat loop (which runs no code), so nothing the policy writes
executes on the host. sandforge runs that loop in the rollout worker (chat_harness.py, one process for every
episode); ``null`` itself, a process per episode in verifiers' ``subprocess`` runtime, is the reference. A taskset whose tasks need a container, or that declares tool servers
(they would run the policy's calls on the host), is refused here with the reason.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from sandforge.environments.task_sources import TaskSourceError, heldout_by_hash
from sandforge.environments.vf import chat_harness
from sandforge.environments.vf.library import vf
from sandforge.types import Task

FAMILIES: dict = {}  # no seeded tasks: each job's `id` names the environment (one family per module)
MAX_TASKS = 10_000
HARNESS = "in_process"  # verifiers' tool-less chat loop, run in the worker (chat_harness.py)
REFERENCE_HARNESS = "null"  # the same loop as a process per episode: verifiers' own harness
RUNTIME = "subprocess"  # the chat loop runs as a local process of the rollout worker


@dataclass(frozen=True)
class AgentLimits:
    """What verifiers itself stops the agent at, so that it scores the episode (the proxy's budgets, which refuse a
    request, stay behind them): ``agent.max_requests``, ``agent.max_tokens``, ``rollout.episode_timeout``."""

    max_turns: int | None = None
    max_output_tokens: int | None = None
    timeout: float | None = None


def env_config(module: str, args: dict[str, Any], limits: AgentLimits = AgentLimits(),
               harness: str = HARNESS) -> Any:
    """The verifiers ``EnvConfig`` sandforge runs ``module`` with: its taskset with ``args``, the chat loop
    (``harness``: ``in_process`` or verifiers' ``null``) in the subprocess runtime, stopped (then scored as it
    stands) at ``limits``."""
    api = vf()
    harness_id = chat_harness.register() if harness == HARNESS else harness
    agent: dict[str, Any] = {"harness": {"id": harness_id}, "runtime": {"type": RUNTIME},
                             "max_turns": limits.max_turns, "max_output_tokens": limits.max_output_tokens}
    if limits.timeout is not None:
        agent["timeout"] = {"rollout": limits.timeout}
    return api.resolve_env_config({"taskset": {**args, "id": module}, "agent": agent})


def load_env(module: str, args: dict[str, Any], limits: AgentLimits = AgentLimits(), harness: str = HARNESS) -> Any:
    """The verifiers ``Env`` for ``module`` and ``args`` (``harness``: see ``env_config``); TaskSourceError saying
    what is wrong otherwise."""
    try:
        env = vf().load_environment(env_config(module, args, limits, harness))
    except TaskSourceError:
        raise
    except Exception as e:  # the library's own errors name the field or module; keep them whole
        raise TaskSourceError(f"verifiers environment {module!r}: {type(e).__name__}: {e}") from e
    task_cls = type(env.taskset).task_type()
    if getattr(task_cls, "NEEDS_CONTAINER", False):
        raise TaskSourceError(f"verifiers environment {module!r}: its tasks need a container runtime, which sandforge "
                              "does not run for verifiers environments yet (only tasks that need no container)")
    _refuse_tool_servers(env, task_cls, f"verifiers environment {module!r}")
    return env


def _refuse_tool_servers(env: Any, task_cls: type, where: str) -> None:
    """TaskSourceError where the taskset or tasks of class ``task_cls`` declare tool servers: with no sandbox they
    would run the policy's calls on the host."""
    tools = [*env.taskset.toolsets(env.taskset.config), *task_cls.toolsets(env.taskset.config.task)]
    if tools:
        raise TaskSourceError(f"{where} declares tool servers ({', '.join(type(t).__name__ for t in tools)}): with "
                              "no sandbox they would run the policy's calls on the host, so sandforge does not run "
                              "them yet")


def task_list(env: Any) -> list[Any]:
    """The environment's tasks in ``load()`` order (an endless taskset's first ``MAX_TASKS``). Each task's own class
    is checked for tool servers, not only the type the taskset declares: a subclass may declare them (#56)."""
    tasks = list(itertools.islice(iter(env.taskset), MAX_TASKS))
    for cls in {type(t) for t in tasks}:
        _refuse_tool_servers(env, cls, f"verifiers task class {cls.__name__!r}")
    return tasks


def load_tasks(module: str, args: dict[str, Any], heldout: float = 0.0) -> list[Task]:
    """Every task of verifiers environment ``module`` (with ``args``), as sandforge tasks."""
    tasks = task_list(load_env(module, args))
    if not tasks:
        raise TaskSourceError(f"verifiers environment {module!r} has no tasks (args: {args})")
    out = []
    for position, t in enumerate(tasks):
        d = t.data
        name = d.name or d.id or str(position)
        key = t.key
        out.append(Task(id=f"{module}/{position}-{name}", env="verifiers", family=module, seed=position,
                        instruction=d.prompt_text or "(the environment's user opens the conversation)",
                        setup={"verifiers": {"id": module, "args": dict(args), "position": position, "key": key}},
                        split="heldout" if heldout_by_hash(split_key(t), heldout) else "train"))
    return out


def split_key(task: Any) -> str:
    """What the held-out split hashes: the key a task class defines for itself (a dataset's durable id), else the
    hash verifiers' default key takes of the task's data, without its system prompt: editing an environment's prompt
    must not move tasks between training and held-out (verifiers' own key changes with it)."""
    api = vf()
    if type(task).key is not api.Task.key:  # a durable key of the task class's own
        return task.key
    from verifiers.v1.task import task_key

    return task_key(task.data.model_dump(mode="json", exclude_none=True, exclude={"system_prompt", "idx"}))
