"""Which tasks a step runs: environments chosen by weight, families uniformly, seeds from the run's RNG."""

from __future__ import annotations

import random

from sandforge.config import EnvironmentConfig
from sandforge.registry import environment
from sandforge.types import Task


class TaskSampler:
    def __init__(self, envs: list[EnvironmentConfig], seed: int):
        self.rng = random.Random(seed)
        self.envs = envs
        self.families: dict[str, list[str]] = {}
        self.makers = {}
        for i, env in enumerate(envs):
            entry = environment(env.name)  # KeyError names the known environments
            known = entry.families()
            unknown = [f for f in env.families if f not in known]
            if unknown:
                raise ValueError(f"environments[{i}].families: unknown {unknown} for {env.name!r}; known: {known}")
            self.families[env.name] = env.families or known
            self.makers[env.name] = entry.make_task()

    def sample(self, n: int, split: str = "train") -> list[Task]:
        tasks = []
        for _ in range(n):
            env = self.rng.choices(self.envs, weights=[e.weight for e in self.envs])[0]
            family = self.rng.choice(self.families[env.name])
            tasks.append(self.makers[env.name](family, self.rng.randrange(2**31), split))
        return tasks
