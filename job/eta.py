"""How long a whole run has left: its plan (episodes, SFT steps, evaluations, RL steps) times what each kind of work
has cost so far in this run.

Six kinds of work: ``pretrain`` (one synthetic pretraining step), ``scripted`` (a reference-solution episode of the warm
start), ``sft`` (one supervised step), ``base`` (an episode of the pretrained policy's evaluation: one that cannot
call the tools yet runs every episode to its limits, several times a trained policy's cost, so it is priced apart),
``episode`` (a policy episode: RL rollouts and held-out evaluation) and ``update`` (one RL trainer step with its weight
push). Until a kind has been measured its cost is a prior for a small policy on two cores, except an RL update once
the warm start's SFT steps have been timed: it is priced from them (the same trainer on episodes of the same tasks),
so the line after the warm start counts RL's training (on the quickstart, 12 updates of 23-52 s against a prior of
4 s). The estimate sharpens as the run goes: after the first RL step every kind has been measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sandforge.config import JobConfig

# seconds per unit on 2 CPU cores with a k3-nano policy: only used until the run has measured the kind itself
PRIORS = {"pretrain": 0.4, "scripted": 1.5, "sft": 1.2, "base": 4.0, "episode": 1.6, "update": 4.0}
# an RL update's training over the same episodes with the frozen reference's forward as well, against without it:
# step 0 of the quickstart, about the same 24 episodes, 23.0 s with it and 14.5 s without (docs/quickstart.md)
REFERENCE_FORWARD = 1.6


@dataclass
class RunPlan:
    units: dict[str, int]  # kind -> units the whole run does
    # one RL update's trainer work in warm-start SFT steps (episodes per update over SFT's batch, times PPO epochs and
    # the reference forward): an update is priced from the SFT steps measured until one has been measured itself
    # (0: by its prior)
    update_in_sft_steps: float = 0.0

    @classmethod
    def of(cls, cfg: JobConfig, start: int = 0, warm: bool = True, sft_only: bool = False,
           sampler: Any = None) -> RunPlan:
        """The work of ``cfg`` from RL step ``start`` on (``warm``: the warm start still to do; ``sampler``: the job's
        opened task sources, a ``TaskSampler``, to count held-out tasks in)."""
        sources = sampler.sources if sampler is not None else None
        w, r, e, t = cfg.warmup, cfg.rollout, cfg.eval, cfg.trainer
        units = {"pretrain": 0, "scripted": 0, "sft": 0, "base": 0, "episode": 0, "update": 0}
        if warm:
            units["pretrain"] = cfg.pretrain.steps
        if warm and w.steps:
            units["scripted"], units["sft"] = w.episodes, w.steps
        if sft_only:
            return cls(units)
        steps = max(t.steps - start, 0)
        units["episode"] = steps * r.tasks_per_step * r.group_size
        update_in_sft = 0.0
        if units["sft"]:
            reference = t.log_kl or t.kl_coef > 0
            update_in_sft = r.tasks_per_step * r.group_size / w.batch_size * t.epochs * (
                REFERENCE_FORWARD if reference else 1.0)
        units["update"] = steps
        if e.tasks_per_family:
            evals = 1 + (len([s for s in range(start + 1, t.steps) if e.every and s % e.every == 0]))
            evals += 1 if t.steps > start else 0
            units["episode"] += evals * eval_episodes(cfg, sources=sources)
            if warm and e.base:
                units["base"] = eval_episodes(cfg, e.base_tasks_per_family, e.base_samples, sources)
        return cls(units, update_in_sft)


def eval_episodes(cfg: JobConfig, per_family: int | None = None, samples: int | None = None,
                  sources: list | None = None) -> int:
    """Episodes of one held-out evaluation (generated families; a task file's count is known only once read);
    ``per_family``: that many tasks of every family, ``samples``: that many sampled episodes of each (the base
    evaluation's); ``sources``: the environments' opened task sources, in order."""
    from sandforge.environments.task_sources import FiniteSource
    from sandforge.job.task_sampler import env_source

    n = 0
    for i, env in enumerate(cfg.environments):
        try:
            source = sources[i] if sources is not None else env_source(env)
            families = env.families or source.families()
            tasks = per_family if per_family is not None else env.eval_tasks(cfg.eval.tasks_per_family)
            if isinstance(source, FiniteSource):
                n += sum(min(tasks, sum(t.family == f and t.split == "heldout"
                                                                for t in source.tasks)) for f in families)
            else:
                n += len(families) * tasks
        except Exception:  # noqa: BLE001 - an estimate: an env that cannot be opened here counts as nothing
            continue
    return n * ((samples or cfg.eval.samples) + cfg.eval.greedy)  # greedy: one more episode per task


@dataclass
class RunClock:
    plan: RunPlan
    spent: dict[str, float] = field(default_factory=dict)  # kind -> seconds measured
    done: dict[str, int] = field(default_factory=dict)  # kind -> units measured
    started: float = field(default_factory=time.monotonic)

    def add(self, kind: str, units: int, seconds: float) -> None:
        self.done[kind] = self.done.get(kind, 0) + units
        self.spent[kind] = self.spent.get(kind, 0.0) + seconds

    def cost(self, kind: str) -> float:
        """Seconds per unit of ``kind``: measured in this run; an update not yet measured, from the SFT steps that
        were (``RunPlan.update_in_sft_steps``); else the prior."""
        if self.done.get(kind):
            return self.spent[kind] / self.done[kind]
        if kind == "update" and self.plan.update_in_sft_steps and self.done.get("sft"):
            return self.cost("sft") * self.plan.update_in_sft_steps
        return PRIORS[kind]

    def remaining(self) -> float:
        return sum(max(n - self.done.get(kind, 0), 0) * self.cost(kind) for kind, n in self.plan.units.items())

    def line(self) -> str:
        """``run: 6m12s so far, about 14 min left`` (rounded up to whole minutes)."""
        spent = int(time.monotonic() - self.started)
        left = self.remaining()
        return f"run: {spent // 60}m{spent % 60:02d}s so far, about {max(1, round(left / 60 + 0.49))} min left"
