"""Which tasks a step runs: environments chosen by weight, families uniformly, seeds from the run's RNG.

Each configured environment has one task source (``environments/task_sources.py``): its seeded generator, or the
JSONL file / Harbor folder named by ``tasks``. Sources are opened once, here, so a malformed task file fails the job
before anything starts.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from sandforge.config import DrawPhase, EnvironmentConfig
from sandforge.environments.task_sources import TaskSourceError, open_source
from sandforge.registry import environment
from sandforge.types import Task
from sandforge.verifiers.checks import gives_partial_credit, takes_reward_rule


class TaskSampler:
    def __init__(self, envs: list[EnvironmentConfig], seed: int):
        self.rng = random.Random(seed)
        self.envs = envs
        self.families: list[list[str]] = []  # per configured environment (one env name may appear twice)
        self.sources = []
        for i, env in enumerate(envs):
            try:
                source = env_source(env)
            except TaskSourceError as e:
                raise ValueError(f"environments[{i}].tasks: {e}") from None
            known = source.families()
            unknown = [f for f in env.families if f not in known]
            if unknown:
                raise ValueError(f"environments[{i}].families: unknown {unknown} for {env.name!r}; known: {known}")
            self.families.append(env.families or known)
            self.sources.append(source)
        distinct(self.sources)

    def sample(self, n: int, split: str = "train", phase: DrawPhase = "rl") -> list[Task]:
        """``n`` tasks of ``split``, environments drawn by ``weight`` (``phase`` "warmup") or by ``rl_weight`` where
        an environment sets it (``phase`` "rl")."""
        weights = [e.draw_weight(phase) for e in self.envs]
        tasks = []
        for _ in range(n):
            i = self.rng.choices(range(len(self.envs)), weights=weights)[0]
            family = self.rng.choice(self.families[i])
            task = self.sources[i].task(family, self.rng.randrange(2**31), split)
            task = with_success_at(with_reward_rule(task, self.envs[i].reward_rule), self.envs[i].success_at)
            tasks.append(with_partial_credit(task) if self.envs[i].partial_credit else task)
        return tasks

    def without_references(self, phase: DrawPhase = "warmup", seeds: int = 8) -> list[int]:
        """The configured environments (indices) drawn in ``phase`` whose tasks bring no reference solution for the
        warm start to replay: none of ``seeds`` training tasks of any of their families has one (a verifiers
        environment has only its rubric; a Harbor folder may have no ``solution/``)."""
        def has_reference(source, families: list[str]) -> bool:
            listed = getattr(source, "tasks", None)
            if isinstance(listed, list):  # a file, a folder, a library environment: every task is there to look at
                return any(t.solution for t in listed if t.family in families and t.split == "train")
            return any(source.task(family, seed, "train").solution for family in families for seed in range(seeds))

        return [i for i, (env, source, families) in enumerate(zip(self.envs, self.sources, self.families))
                if env.draw_weight(phase) > 0 and not has_reference(source, families)]

    def images(self, base_map: dict[str, str] | None = None) -> dict[str, Any]:
        """Images the tasks it can draw need beyond their environments' own: image name -> its build context (a
        Harbor task's folder and Dockerfile, its FROM images mapped by the job's ``base_map``; tasks of families the
        job leaves out are not built)."""
        found = {}
        for env, source, families in zip(self.envs, self.sources, self.families):
            drawn = {name for t in getattr(source, "tasks", []) if t.family in families
                     for name in (t.image, t.grading_image)}  # a separate grader's image too
            entry = environment(env.name)
            found |= {name: entry.job_image_context(ctx, base_map) for name, ctx in source.images.items()
                      if name in drawn}
        return found


def distinct(sources: list) -> None:
    """ValueError where two configured environments' task files or folders bring different tasks under one id, or
    different images under one name (two Harbor folders named alike in two task sets): one would silently run in the
    other's image, and held-out splits, logs and evaluations could not tell them apart. The same task listed twice is
    fine."""
    tasks: dict[str, tuple[int, Task]] = {}
    images: dict[str, tuple[int, Any]] = {}
    for i, source in enumerate(sources):
        for task in getattr(source, "tasks", None) or []:
            j, other = tasks.setdefault(task.id, (i, task))
            if other != task:
                raise ValueError(f"environments[{i}].tasks: task id {task.id!r} is also a different task of "
                                 f"environments[{j}] ({getattr(sources[j], 'origin', '?')}): rename one (a Harbor "
                                 "task's id is its folder's name)")
        for name, context in (getattr(source, "images", None) or {}).items():
            j, other = images.setdefault(name, (i, context))
            if other != context:
                raise ValueError(f"environments[{i}].tasks: image {name!r} is also built, from another folder, for "
                                 f"environments[{j}]: rename one of the task folders")


def env_source(env: EnvironmentConfig):
    """The task source of one ``environments`` entry (``open_source`` with its keys); KeyError for an unknown name."""
    entry = environment(env.name)  # KeyError names the known environments
    return open_source(entry, env.tasks, env.harbor_mode, env.heldout, env.id, env.args)


def with_reward_rule(task: Task, rule: str) -> Task:
    """``task`` with ``"reward": rule`` on every check that makes one reward of several named ones (``auto``, the
    verifiers' default, changes nothing; a check that sets ``reward`` itself keeps its choice)."""
    if rule == "auto":
        return task
    return with_checks(task, lambda c: {"reward": rule, **c} if takes_reward_rule(c.get("verifier")) else c)


def with_checks(task: Task, change) -> Task:
    """``task`` with ``change`` applied to each of its checks, a multi-step task's steps' too."""
    steps = [replace(step, checks=[change(c) for c in step.checks]) for step in task.steps]
    return replace(task, checks=[change(c) for c in task.checks], steps=steps)


def with_success_at(task: Task, success_at: float | None) -> Task:
    """``task`` whose episodes succeed at a reward of ``success_at`` or more (an environment's ``success_at``); None
    leaves the verifiers' own verdict."""
    return task if success_at is None else replace(task, success_at=float(success_at))


def with_partial_credit(task: Task) -> Task:
    """``task`` with ``"partial": true`` on every check whose verifier can give a near miss credit (a check that sets
    ``partial`` itself keeps its choice)."""
    return with_checks(task, lambda c: {"partial": True, **c} if gives_partial_credit(c.get("verifier")) else c)
