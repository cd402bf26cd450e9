"""The env ``gymnasium.make("sandforge/<Name>-v0", ...)`` builds: one environment on one task, graded when its episode
ends (the ids are registered by ``sandforge.environments``, environments/gym_registry.py)::

    import gymnasium
    import sandforge.environments  # registers the ids
    from sandforge.types import ToolCall

    env = gymnasium.make("sandforge/Terminal-v0", family="count_words", seed=3)  # or task=<Task>
    instruction, info = env.reset()
    observation, reward, terminated, truncated, info = env.step(ToolCall("bash", {"command": "ls"}))
    env.close()  # removes the episode's container

Each ``step`` is one tool call. The step that ends the episode (``submit``, or ``max_steps`` reached: ``truncated``)
returns the verifiers' reward: ``score_task``, the grading the agent loop (``rollout/agent.py``) runs after its
episodes, on the same sandbox. Pass ``max_steps`` rather than gymnasium's ``max_episode_steps``: its TimeLimit wrapper
truncates without asking the env, so nothing is graded.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandforge.environments.gym_registry import gym_id
from sandforge.registry import EnvironmentEntry, environment, environments
from sandforge.types import Task
from sandforge.verifiers.checks import score_task  # what rollout/agent.py's run_episode grades with

DEFAULT_MAX_STEPS = 64  # tool calls per episode
DEFAULT_MAX_OBSERVATION = 4096  # characters: rollout.max_tool_output's default, what a policy sees in training


def make_env(
    env: str,
    task: Task | dict | str | Path | None = None,
    *,
    family: str | None = None,
    seed: int = 0,
    split: str = "train",
    image: str | None = None,
    sandbox: Any = None,
    max_steps: int | None = DEFAULT_MAX_STEPS,
    max_observation: int | None = DEFAULT_MAX_OBSERVATION,
    run_id: str | None = None,
) -> Any:
    """The environment ``env`` on one task, graded when its episode ends: what ``gymnasium.make`` builds.

    ``task``: a ``Task`` (or its dict), a task directory for an env that reads folders (a Harbor task directory for
    ``sandforge/Harbor-v0``), or None for the env's seeded task ``family`` (default: its first), ``seed`` and
    ``split``. ``image``: the sandbox image's tag (default: the env's image, or the task folder's, built now unless it
    is up to date). ``sandbox``: the job's ``sandbox`` section (a dict is validated as one); the env's own needs
    (``sandbox_defaults``) go on top, as in a job. ``max_steps``: tool calls before the episode is truncated (and
    graded). ``max_observation``: characters of each step's observation kept (default: ``rollout.max_tool_output``'s).
    ``run_id`` labels the containers (default: ``gym-<random>``); ``close()`` removes them, and a crashed process's
    are reaped by the next sandforge command.
    """
    from sandforge.config import SandboxConfig  # pydantic: only when an env is made
    from sandforge.sandbox.daemon import docker_client
    from sandforge.sandbox.job_spec import grading_spec, sandbox_spec

    entry = environment(env)
    task, contexts = _task(entry, task, family, seed, split)
    config = sandbox if isinstance(sandbox, SandboxConfig) else SandboxConfig.model_validate(sandbox or {})
    env_class = entry.env_class()
    client = docker_client()
    tag = image or _image(entry, task, contexts, config)
    spec = sandbox_spec(config, tag, env_class, task.sandbox, client)
    if task.grading_image is not None:  # a separate grader's sandbox (a Harbor task's separate verifier)
        graded = tag if task.grading_image == task.image else _image(entry, task, contexts, config, task.grading_image)
        spec = replace(spec, grading=grading_spec(config, graded, env_class, task.sandbox, client))
    return env_class(task, spec, run_id or f"gym-{uuid.uuid4().hex[:12]}", exec_timeout=config.exec_timeout,
                     score=score_task, max_steps=max_steps, max_observation=max_observation)


def _task(entry: EnvironmentEntry, task: Any, family: str | None, seed: int,
          split: str) -> tuple[Task, dict[str, Any]]:
    """The Task to run and the images it brings (image name -> how to build it; a task folder's)."""
    contexts: dict[str, Any] = {}
    if isinstance(task, (str, Path)):
        if entry.folder_loader is None:
            readers = " or ".join(gym_id(name) for name, e in environments().items() if e.folder_loader is not None)
            raise ValueError(f"{gym_id(entry.name)}: task={str(task)!r} is a path, which only {readers} takes (a "
                             "task directory); give a Task, or family= and seed=")
        tasks, contexts = entry.load_folder(Path(task))
        if len(tasks) != 1:
            raise ValueError(f"{task}: holds {len(tasks)} tasks; make one env per task directory")
        task = tasks[0]
    elif isinstance(task, dict):
        task = Task.from_dict(task)
    elif task is None:
        families = entry.families()
        if not families:
            raise ValueError(f"{gym_id(entry.name)} has no seeded tasks: pass task= (for Harbor, a task directory)")
        task = entry.make_task()(family or families[0], seed, split)
    elif not isinstance(task, Task):
        raise TypeError(f"task must be a Task, its dict or a task directory; got {type(task).__name__}")
    if task.env != entry.name:
        raise ValueError(f"task {task.id} is a {task.env!r} task: make {gym_id(task.env)} for it, not "
                         f"{gym_id(entry.name)}")
    if task.steps:  # one reset, one instruction, one grading: a gymnasium episode cannot hold its steps
        raise ValueError(f"task {task.id} has {len(task.steps)} steps ({', '.join(s.name for s in task.steps)}): "
                         "a gymnasium env runs one instruction; run multi-step tasks with sandforge's agent loop "
                         "(sandforge train, sandforge harbor check)")
    return task, contexts


def _image(entry: EnvironmentEntry, task: Task, contexts: dict[str, Any], config: Any, name: str | None = None) -> str:
    """The tag of the image ``task`` runs in (or image ``name`` it brings): found if up to date, else built (with
    progress on stderr)."""
    from sandforge.sandbox.images import context_image

    name = name or task.image or entry.image_name
    context = contexts.get(name) or (entry.image_context() if name == entry.image_name else None)
    if context is None:
        raise ValueError(f"task {task.id} runs in image {name!r}, which {gym_id(entry.name)} cannot build: pass "
                         "image=<tag>, or for a Harbor task its directory as task=")
    return context_image(name, context, config.base_image, config.mirror)
