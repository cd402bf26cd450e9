"""gymnasium ids for every sandforge environment, registered when ``sandforge.environments`` is imported::

    import gymnasium
    import sandforge.environments  # registers sandforge/Terminal-v0, sandforge/Repo-v0, ...
    from sandforge.types import ToolCall

    env = gymnasium.make("sandforge/Terminal-v0", family="count_words", seed=3)  # or task=<Task>
    instruction, info = env.reset()
    observation, reward, terminated, truncated, info = env.step(ToolCall("bash", {"command": "ls"}))
    env.close()  # removes the episode's container

Built-ins have the ids in ``GYM_IDS``; an installed plugin's environment (entry-point group ``sandforge.environments``)
gets ``sandforge/<Name>-v0`` from its entry-point name (``notes`` -> ``sandforge/Notes-v0``). Registering imports
neither Docker nor any environment's module: the entry point is this module's ``make_env``, named by a string, and only
``gymnasium.make`` calls it.

Each ``step`` is one tool call. The step that ends the episode (``submit``, or ``max_steps`` reached: ``truncated``)
returns the verifiers' reward: ``score_task``, the grading the agent loop (``rollout/agent.py``) runs after its
episodes, on the same sandbox. Environments never import a grader (ARCHITECTURE.md), so it is named by a string and
resolved when an env is made, as ``sandforge/registry.py`` names the built-in verifiers. Pass ``max_steps`` rather
than gymnasium's ``max_episode_steps``: its TimeLimit wrapper truncates without asking the env, so nothing is graded.
"""

from __future__ import annotations

import re
import uuid
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import gymnasium

from sandforge.registry import BUILTIN_ENVIRONMENTS, ENVIRONMENT_GROUP, EnvironmentEntry, environment, resolve
from sandforge.types import Task

GYM_IDS = {
    "terminal": "sandforge/Terminal-v0",
    "repo": "sandforge/Repo-v0",
    "harbor": "sandforge/Harbor-v0",
    "slack": "sandforge/Slack-v0",
    "notion": "sandforge/Notion-v0",
    "browser": "sandforge/Browser-v0",
}
ENTRY_POINT = "sandforge.environments.gym_registry:make_env"
GRADER = "sandforge.verifiers.checks:score_task"  # what rollout/agent.py's run_episode grades with
DEFAULT_MAX_STEPS = 64  # tool calls per episode
DEFAULT_MAX_OBSERVATION = 4096  # characters: rollout.max_tool_output's default, what a policy sees in training


def gym_id(name: str) -> str:
    """The gymnasium id of environment ``name``: a built-in's from ``GYM_IDS``, else ``sandforge/<CamelName>-v0``."""
    if name in GYM_IDS:
        return GYM_IDS[name]
    return "sandforge/" + "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", name) if w) + "-v0"


def register_environments() -> dict[str, str]:
    """Register every built-in and every installed plugin environment with gymnasium (again after a plugin is
    installed: ids already registered are kept). Returns environment name -> gymnasium id."""
    names = list(BUILTIN_ENVIRONMENTS) + [ep.name for ep in entry_points(group=ENVIRONMENT_GROUP)]
    ids = {}
    for name in dict.fromkeys(names):
        env_id = gym_id(name)
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point=ENTRY_POINT, kwargs={"env": name})
        ids[name] = env_id
    return ids


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

    ``task``: a ``Task`` (or its dict), a Harbor task directory (``sandforge/Harbor-v0``), or None for the env's
    seeded task ``family`` (default: its first), ``seed`` and ``split``. ``image``: the sandbox image's tag (default:
    the env's image, or the Harbor task's, built now unless it is up to date). ``sandbox``: the job's ``sandbox``
    section (a dict is validated as one); the env's own needs (``sandbox_defaults``) go on top, as in a job.
    ``max_steps``: tool calls before the episode is truncated (and graded). ``max_observation``: characters of each
    step's observation kept (default: ``rollout.max_tool_output``'s). ``run_id`` labels the containers (default:
    ``gym-<random>``); ``close()`` removes them, and a crashed process's are reaped by the next sandforge command.
    """
    from sandforge.config import SandboxConfig  # pydantic: only when an env is made
    from sandforge.environments.sandbox.daemon import docker_client
    from sandforge.environments.sandbox.job_spec import sandbox_spec

    entry = environment(env)
    task, contexts = _task(entry, task, family, seed, split)
    config = sandbox if isinstance(sandbox, SandboxConfig) else SandboxConfig.model_validate(sandbox or {})
    env_class = entry.env_class()
    spec = sandbox_spec(config, image or _image(entry, task, contexts, config), env_class, task.setup.get("sandbox"),
                        docker_client())
    return env_class(task, spec, run_id or f"gym-{uuid.uuid4().hex[:12]}", exec_timeout=config.exec_timeout,
                     score=resolve(GRADER), max_steps=max_steps, max_observation=max_observation)


def _task(entry: EnvironmentEntry, task: Any, family: str | None, seed: int,
          split: str) -> tuple[Task, dict[str, Path]]:
    """The Task to run and the images it brings (image name -> the folder of its Dockerfile; a Harbor task's)."""
    contexts: dict[str, Path] = {}
    if isinstance(task, (str, Path)):
        if entry.name != "harbor":
            raise ValueError(f"{gym_id(entry.name)}: task={str(task)!r} is a path, which only {gym_id('harbor')} "
                             "takes (a Harbor task directory); give a Task, or family= and seed=")
        from sandforge.environments.harbor.tasks import load_tasks

        tasks, contexts = load_tasks(Path(task))
        if len(tasks) != 1:
            raise ValueError(f"{task}: holds {len(tasks)} Harbor tasks; make one env per task directory")
        task = tasks[0]
    elif isinstance(task, dict):
        task = Task.from_dict(task)
    elif task is None:
        families = entry.families()
        if not families:
            raise ValueError(f"{gym_id(entry.name)} has no seeded tasks: pass task= (for Harbor, a task directory)")
        task = entry.make_task()(family or families[0], seed, split)
    elif not isinstance(task, Task):
        raise TypeError(f"task must be a Task, its dict or a Harbor task directory; got {type(task).__name__}")
    if task.env != entry.name:
        raise ValueError(f"task {task.id} is a {task.env!r} task: make {gym_id(task.env)} for it, not "
                         f"{gym_id(entry.name)}")
    return task, contexts


def _image(entry: EnvironmentEntry, task: Task, contexts: dict[str, Path], config: Any) -> str:
    """The tag of the image ``task`` runs in: found if up to date, else built (with progress on stderr)."""
    import docker.errors

    from sandforge.environments.sandbox.daemon import docker_client
    from sandforge.environments.sandbox.images import (
        BASE_TAG,
        BuildContext,
        ImageError,
        build_images,
        context_image_tag,
    )

    name = task.setup.get("image") or entry.image_name
    context = contexts.get(name) or (entry.image_context() if name == entry.image_name else None)
    if context is None:
        raise ValueError(f"task {task.id} runs in image {name!r}, which {gym_id(entry.name)} cannot build: pass "
                         "image=<tag>, or for a Harbor task its directory as task=")
    client = docker_client()
    if isinstance(context, BuildContext):  # a Harbor task's: its Dockerfile is rewritten for this host first
        return build_images([], base_image=config.base_image, client=client, mirror=config.mirror,
                            contexts={name: context}, show_progress=False)[name]
    try:
        tag = context_image_tag(context, name, config.base_image or BASE_TAG, client)
        client.images.get(tag)
        return tag
    except (ImageError, docker.errors.ImageNotFound):
        pass
    return build_images([], base_image=config.base_image, client=client, mirror=config.mirror,
                        contexts={name: context})[name]
