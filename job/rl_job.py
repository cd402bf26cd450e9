"""One RL job in the driver: the state a run keeps between steps (policy version, task sampler, RNG) over its fleet.

Each step: sample tasks → rollout workers run G episodes per task in fresh sandboxes → verifiers score them → the
algorithm's advantages (``trainer.algorithm``, see trainer/algorithms) → one DeepSpeed step over all ranks → new weights
to the engine. Steps follow each other (``trainer.mode: sync``, ``sync_steps``) or overlap the rollouts
(``trainer.mode: async``, job/async_loop.py). The cold start before RL is job/cold_start.py; checkpoints and resume
are job/checkpoint.py; job/run.py drives a whole run.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from rich.progress import Progress

from sandforge.config import JobConfig
from sandforge.job.console import JobError, console
from sandforge.job.eta import RunClock
from sandforge.job.eval_summary import EvalSummary
from sandforge.job.evaluation import eval_line, evaluation, metric_row
from sandforge.job.fleet.lifecycle import Fleet
from sandforge.job.rollout_metrics import rollout_metrics
from sandforge.job.fleet.rollout_workers import collect_episodes, stop_if_all_failed, worker_gone
from sandforge.job.runlog import RunLogger
from sandforge.job.task_sampler import TaskSampler
from sandforge.job.no_signal import silent_in, silent_metrics, silent_note
from sandforge.trainer.algorithms import (TieBreak, informative_groups, overlong_penalty, resolve, signal_rewards,
                                          token_advantages, trained_successes)
from sandforge.trainer.rank import RolloutShape
from sandforge.types import Task, TrainingRow, Trajectory


def training_rows(trajs: list[Trajectory]) -> list[TrainingRow]:
    """Every episode's sequences, in order: one per episode, or several where a harness rewrote its history."""
    return [TrainingRow(token_ids=r.token_ids, loss_mask=r.loss_mask, logprobs=r.logprobs,
                        routed_experts=r.routed_experts, temperature=t.temperature) for t in trajs for r in t.rows()]


def per_episode(per_row: list[list], trajs: list[Trajectory]) -> list[list]:
    """Per-token lists of ``training_rows(trajs)``, each episode's rows joined in order: the algorithm sees one
    sequence of policy tokens per episode, however many rows it was recorded in."""
    out, i = [], 0
    for t in trajs:
        n = len(t.earlier_rows) + 1
        out.append([x for row in per_row[i : i + n] for x in row])
        i += n
    return out


def per_row(per_ep: list[list], trajs: list[Trajectory]) -> list[list]:
    """``per_episode`` undone: each episode's joined per-token list cut back into its rows."""
    out = []
    for seq, t in zip(per_ep, trajs):
        start = 0
        for row in t.rows():
            out.append(seq[start : start + len(row.token_ids)])
            start += len(row.token_ids)
    return out


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    """One RL step in a line; the environments it had nothing to learn from are named at its end (job/no_signal.py)."""
    return (f"step {step + 1}/{total}  reward {m['reward/mean']:.3f}  success {m['success/rate']:.2f}  "
            f"turns {m.get('turns/mean', 0):.1f}  failed {int(m['episodes/failed'])}  "
            f"timeouts {int(m.get('episodes/timeouts', 0))}  tool errors/ep {m.get('tools/errors_per_episode', 0):.1f}  "
            f"loss {m.get('loss', 0):.4f}  kl {m.get('kl', 0):.4f}  {m['time/step']:.1f}s"
            + silent_note(silent_in(m)[0]))


class RLJob:
    """A run's driver state over its fleet (job/fleet/lifecycle.py): what a step, the cold start and a checkpoint need."""

    def __init__(self, cfg: JobConfig, fleet: Fleet, logger: RunLogger, bar: Progress,
                 clock: RunClock | None = None, sampler: TaskSampler | None = None):
        self.cfg, self.fleet, self.logger, self.bar = cfg, fleet, logger, bar
        self.run_id = fleet.run_id
        self.clock = clock  # the whole run's ETA (job/eta.py), fed with what each kind of work costs
        self.rng = random.Random(cfg.run.seed)
        self.sampler = sampler or TaskSampler(cfg.environments, cfg.run.seed)  # the run's task sources, opened once
        self.output_dir = Path(cfg.run.output_dir).resolve()
        self.settings = resolve(cfg.trainer, RolloutShape.of(cfg.rollout).response_budget)
        self.version = 0
        self.push_weights()

    @property
    def ranks(self) -> list:
        return self.fleet.ranks

    @property
    def engine(self):
        return self.fleet.engine

    @property
    def workers(self) -> list:
        return self.fleet.workers

    def push_weights(self) -> None:
        self.fleet.push_weights(self.version)

    def collect(self, tasks: list[Task], groups: list[str], scripted: bool, label: str,
                temperature: float | list[float] | None = None, kind: str | None = None) -> list[Trajectory]:
        """Spread episodes over the workers and gather them all, failed ones included (``temperature``: instead of
        ``rollout.temperature``, for held-out evaluation; one per episode in a list). ``kind``: what the run's ETA
        prices their time as (job/eta.py; default "scripted" or "episode")."""
        t0 = time.monotonic()
        trajs = collect_episodes(self.workers, tasks, groups, self.cfg.run.seed, self.version, scripted, self.bar,
                                 label, temperature)
        self.tick(kind or ("scripted" if scripted else "episode"), len(tasks), time.monotonic() - t0)
        remote = self.cfg.engine.remote
        if remote is not None and not scripted and trajs and all(
                t.failed and (t.failure or "").startswith("engine:") for t in trajs):
            # the server is down (after the retries) or answers nothing usable: stop rather than train on nothing
            raise JobError(f"remote engine {remote.url}: all {len(trajs)} episodes of '{label}' failed on it; first: "
                           f"{trajs[0].failure.removeprefix('engine: ').removeprefix('RemoteEngineError: ')}")
        if not scripted:  # the warm start's replays report their own failures (job/cold_start.py)
            stop_if_all_failed(trajs, label)
        return trajs

    def tick(self, kind: str, units: int, seconds: float) -> None:
        if self.clock is not None:
            self.clock.add(kind, units, seconds)

    def evaluate(self, step: int, base: bool = False) -> EvalSummary:
        """Held-out success of the current policy after ``step`` RL steps (job/evaluation.py): logged as an ``eval``
        row and its episodes; returns the summary. ``base``: the pretrained policy before any training, logged as an
        ``eval_base`` row (its own phase: it is no point of the RL curve)."""
        collect = functools.partial(self.collect, kind="base") if base else self.collect
        e = self.cfg.eval
        per_family, samples = (e.base_tasks_per_family, e.base_samples) if base else (None, None)
        trajs, summary = evaluation(self.cfg, collect, "base" if base else f"eval{step}", per_family, samples,
                                    sources=self.sampler.sources)
        phase = "eval_base" if base else "eval"
        self.logger.log_trajectories(step, phase, trajs)
        summary = summary.at(step=step, policy_version=self.version, base=base)
        row = metric_row(summary)  # the base's keys are its own, so no RL curve in wandb gets its point
        self.logger.log(phase, {"step": step, **({f"eval_base/{k[5:]}": v for k, v in row.items()} if base else row)})
        self.bar.console.print(eval_line(summary), soft_wrap=True)
        return summary

    def sandbox_metrics(self) -> dict[str, float]:
        """Acquire/exec latency percentiles over every worker's samples, live sandboxes, failures by kind."""
        import ray

        from sandforge.sandbox.stats import SandboxStats

        stats = SandboxStats()
        for ref in [w.sandbox_stats.remote() for w in self.workers]:
            try:
                stats.absorb(ray.get(ref))
            except worker_gone():  # a worker gone for good: its samples went with it
                pass
        return stats.snapshot()

    def update(self, rows: list[TrainingRow]) -> dict[str, float]:
        t = self.cfg.trainer
        return self.ranks.update(rows, t.mini_batches, self.rng, t.epochs)

    def sample_groups(self, step: int) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
        """G episodes for each of ``rollout.tasks_per_step`` tasks: (every episode, the ones to train on, metrics).

        With dynamic sampling (DAPO), groups with nothing to learn from (every episode succeeded or every one failed;
        with ``trainer.dynamic_sampling_on: reward``, every reward equal) are dropped and the missing tasks sampled
        again, up to ``trainer.dynamic_sampling_max_rounds`` rounds in all; then the step trains on what it has."""
        r, s = self.cfg.rollout, self.settings
        rounds = s.dynamic_sampling_max_rounds if s.dynamic_sampling else 1
        trajs: list[Trajectory] = []
        keep: list[Trajectory] = []
        need, filtered = r.tasks_per_step, 0
        for n in range(rounds):
            tasks = self.sampler.sample(need)
            tag = f"{step}" if n == 0 else f"{step}.{n}"  # a task drawn again in a later round is a new group
            episodes = [(task, f"{tag}/{task.id}") for task in tasks for _ in range(r.group_size)]
            label = f"step {step + 1}: rollouts" + (f" (round {n + 1})" if n else "")
            got = self.collect([e[0] for e in episodes], [e[1] for e in episodes], scripted=False, label=label)
            trajs += got
            ok = [t for t in got if not t.failed]  # failed episodes never reach the gradient
            if not s.dynamic_sampling:
                return trajs, ok, {}
            useful = informative_groups([t.reward.value for t in ok], self.successes(ok),
                                        [t.group for t in ok], on=s.dynamic_sampling_on)
            filtered += len({t.group for t in got} - useful)
            keep += [t for t in ok if t.group in useful]
            need -= len(useful)
            if need <= 0:
                break
        return trajs, keep, {"dapo/filtered_groups": filtered, "dapo/rounds": n + 1}

    def flat_signal(self, ok: list[Trajectory]) -> list[float]:
        """What tells a group's episodes apart for the advantages: the verifier's value (``reward``, and
        ``tiebreak``'s partial-credit order), or success as RL trains on it (``success``)."""
        if self.settings.reward_signal == "success":
            return [float(x) for x in self.successes(ok)]
        return [t.reward.value for t in ok]

    def successes(self, ok: list[Trajectory]) -> list[bool]:
        """Each episode's success as RL trains on it (``trainer.unended_fails``)."""
        return trained_successes([t.reward.success for t in ok], [t.finish_reason for t in ok],
                                 self.settings.unended_fails)

    def rl_rows(self, ok: list[Trajectory]) -> tuple[list[TrainingRow], dict[str, float]]:
        """Training rows with per-token advantages (and PPO's value targets) from the algorithm, on the reward signal
        ``trainer.reward_signal`` picks (the verifier's value, or its success) plus the overlong penalty."""
        s = self.settings
        rows = training_rows(ok)
        penalties = [overlong_penalty(t.response_tokens, s.response_budget, s.overlong_buffer, s.overlong_penalty)
                     for t in ok]
        values, successes = [t.reward.value for t in ok], self.successes(ok)
        signal = signal_rewards(s.reward_signal, values, successes)
        mini = self.cfg.trainer.mini_batches > 1 or self.cfg.trainer.epochs > 1  # later steps: the start's log-probs
        scores = self.ranks.score(rows) if s.needs_scores or mini else None
        adv, returns = token_advantages(
            s.algorithm.advantages,
            [r + p for r, p in zip(signal, penalties)],
            [t.group for t in ok],
            per_episode([row.loss_mask for row in rows], ok),
            kl_penalty=per_episode([x.kl_penalty for x in scores], ok) if scores else None,
            values=per_episode([x.values for x in scores], ok) if scores and s.algorithm.value_head else None,
            gamma=s.gamma,
            lam=s.gae_lambda,
            tiebreak=TieBreak(successes, values, s.tiebreak_weight) if s.reward_signal == "tiebreak" else None,
        )
        adv, returns = per_row(adv, ok), None if returns is None else per_row(returns, ok)
        rows = [replace(row, advantages=adv[i], returns=None if returns is None else returns[i],
                        old_logprobs=scores[i].old_logprobs if mini else None) for i, row in enumerate(rows)]
        metrics = {"dapo/overlong_penalty": sum(penalties) / len(penalties)} if s.overlong_buffer else {}
        return rows, metrics

    def rl_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        trajs, ok, sampling = self.sample_groups(step)
        t1 = time.perf_counter()
        metrics = rollout_metrics(trajs) | self.sandbox_metrics() | sampling
        if ok:
            metrics |= silent_metrics(ok, self.flat_signal(ok))
            self.fleet.before_update()  # an engine sharing the trainer's GPU frees its caches
            rows, shaping = self.rl_rows(ok)
            metrics |= shaping | self.update(rows)
        else:
            console.print(f"[yellow]step {step + 1}: no episode to learn from (all failed, or no group that "
                          "dynamic sampling kept); no update this step[/]")
        t2 = time.perf_counter()
        self.version += 1
        self.push_weights()
        t3 = time.perf_counter()
        self.tick("update", 1, t3 - t1)
        self.logger.log_trajectories(step, "rl", trajs)
        metrics |= {"step": step, "policy/version": self.version, "time/rollout": t1 - t0, "time/train": t2 - t1,
                    "time/weight_sync": t3 - t2, "time/step": t3 - t0}
        return metrics


def rl_steps(job: RLJob, start: int = 0) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, metrics) as each RL step ends: one after the other (``trainer.mode: sync``), or from the async driver,
    whose rollouts go on while the trainer steps (``trainer.mode: async``, job/async_loop.py)."""
    if job.cfg.trainer.mode == "async":
        from sandforge.job.async_loop import async_steps

        return async_steps(job, start)
    return ((step, job.rl_step(step)) for step in range(start, job.cfg.trainer.steps))
