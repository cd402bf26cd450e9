"""Async RL (``trainer.mode: async``): rollouts go on while the trainer steps.

Batch b (``rollout.tasks_per_step`` tasks x ``group_size`` episodes, as in sync mode) is trained at policy version
v0 + b, v0 being the version RL starts from. The rollout workers produce episodes continuously, up to their capacity
(``rollout.workers`` x ``rollout.concurrency``) in flight, under admission control: an episode of batch b may start
only while the engine serves a version >= v0 + b - ``max_staleness``. Versions only grow, so when batch b is trained
none of its tokens is more than ``max_staleness`` versions old, and nothing finished is ever dropped for staleness.
``max_staleness: 0`` is on-policy: batch b starts only on the weights that will train on it.

The trainer (a thread of the driver, with the same ``RLJob`` helpers as sync mode) takes batch b once every group of it
is complete (advantages only ever see whole groups; failed episodes are counted and left out, as in sync mode), steps,
and pushes the new weights with an interrupting load: the engine swaps them between two decode steps and the episodes
mid-generation continue on them (K3-style partial rollouts, each token tagged with the version that sampled it: see
engine/core.py). The next batch is taken when the generator is resumed, so a checkpoint written between steps
holds exactly the version it is named for.

Per step, besides the sync metrics: ``async/staleness_mean`` and ``async/staleness_max`` (an episode's staleness is how
many versions old its oldest policy token is when trained), ``async/staleness_count_<k>`` (the histogram: episodes of
staleness k), ``async/token_staleness_mean``, ``async/partial_episodes`` (episodes sampled by more than one version),
``async/in_flight``, ``time/trainer_idle_frac`` (the trainer waiting for a complete batch) and
``time/engine_idle_frac`` (the engine thread with nothing to run), both over the wall time since the last step.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict
from typing import Iterator

from sandforge.job.console import JobError
from sandforge.job.rollout_metrics import rollout_metrics
from sandforge.job.fleet.rollout_workers import lost_episodes
from sandforge.types import Task, Trajectory


def admits(consumed_at: int, version: int, max_staleness: int) -> bool:
    """Admission control: may an episode of the batch trained at version ``consumed_at`` start while the engine serves
    ``version``? Only if its oldest token will be at most ``max_staleness`` versions old when it is consumed."""
    return version >= consumed_at - max_staleness


def episode_staleness(consumed_at: int, token_versions: list[int]) -> int:
    """How many versions old an episode's oldest policy token is when trained at ``consumed_at`` (-1 marks prompt and
    tool tokens; an episode without policy tokens is 0)."""
    policy = [v for v in token_versions if v >= 0]
    return consumed_at - min(policy) if policy else 0


def staleness_metrics(consumed_at: int, trajs: list[Trajectory]) -> dict[str, float]:
    ages = [episode_staleness(consumed_at, t.token_versions) for t in trajs]
    tokens = [consumed_at - v for t in trajs for v in t.token_versions if v >= 0]
    metrics = {
        "async/staleness_mean": sum(ages) / max(len(ages), 1),
        "async/staleness_max": max(ages, default=0),
        "async/token_staleness_mean": sum(tokens) / max(len(tokens), 1),
        "async/partial_episodes": sum(len({v for v in t.token_versions if v >= 0}) > 1 for t in trajs),
    }
    metrics |= {f"async/staleness_count_{k}": n for k, n in sorted(Counter(ages).items())}
    return metrics


class AsyncDriver:
    """Keeps episodes in flight on the rollout workers and trains on each batch as soon as it is complete."""

    def __init__(self, job, start: int = 0) -> None:
        r, t = job.cfg.rollout, job.cfg.trainer
        self.job = job
        self.start, self.steps = start, t.steps  # steps start .. steps-1 (start > 0: a resumed run)
        self.batch_size = r.tasks_per_step * r.group_size
        self.max_staleness = t.max_staleness
        self.capacity = r.workers * r.concurrency
        self.v0 = job.version
        self.served = job.version  # the version the engine serves; the trainer thread raises it after each push
        self.queue: deque[tuple[int, Task, str]] = deque()  # episodes not started yet, in batch order
        self.planned = start  # batches whose episodes have been sampled
        self.in_flight: dict = {}  # ObjectRef -> (batch, worker, task, group)
        self.load = [0] * len(job.workers)
        self.batches: dict[int, list[Trajectory]] = defaultdict(list)
        self.trainer = ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.training: Future | None = None

    def consumed_at(self, batch: int) -> int:
        """The version batch ``batch`` is trained at."""
        return self.v0 + batch - self.start

    def run(self) -> Iterator[tuple[int, dict[str, float]]]:
        import ray

        job = self.job
        if getattr(job, "settings", None) is not None and job.settings.dynamic_sampling:
            raise JobError("trainer.mode async does not resample groups (dynamic sampling): set "
                           "trainer.dynamic_sampling=false or trainer.mode=sync")
        ray.get(job.engine.set_interrupt_loads.remote(True))
        bar = job.bar.add_task("async rollouts", total=(self.steps - self.start) * self.batch_size)
        clock, engine_busy = time.perf_counter(), self._engine_busy()
        next_train = self.start
        try:
            while next_train < self.steps or self.training is not None:
                self._admit()
                if self.training is not None and self.training.done():
                    metrics, trajs, busy = self.training.result()
                    self.training = None
                    now, busy_engine = time.perf_counter(), self._engine_busy()
                    wall = max(now - clock, 1e-9)
                    metrics |= {"time/step": wall, "time/trainer_idle_frac": max(0.0, 1 - busy / wall),
                                "time/engine_idle_frac": min(1.0, max(0.0, 1 - (busy_engine - engine_busy) / wall)),
                                "async/in_flight": len(self.in_flight)}
                    clock, engine_busy = now, busy_engine
                    job.logger.log_trajectories(int(metrics["step"]), "rl", trajs)
                    yield int(metrics["step"]), metrics
                elif self.training is None and len(self.batches.get(next_train, ())) == self.batch_size:
                    self.training = self.trainer.submit(self._train, next_train, self.batches.pop(next_train))
                    next_train += 1
                else:
                    self._wait(bar)
        finally:
            job.bar.remove_task(bar)
            self.trainer.shutdown(wait=self.training is None, cancel_futures=True)

    def _admit(self) -> None:
        """Start queued episodes while there is room and admission control lets the next one in."""
        while len(self.in_flight) < self.capacity:
            if not self.queue:
                if self.planned == self.steps:
                    return
                tasks = self.job.sampler.sample(self.job.cfg.rollout.tasks_per_step)
                self.queue += [(self.planned, task, f"{self.planned}/{task.id}") for task in tasks
                               for _ in range(self.job.cfg.rollout.group_size)]
                self.planned += 1
            b, task, group = self.queue[0]
            if not admits(self.consumed_at(b), self.served, self.max_staleness):
                return
            self.queue.popleft()
            w = min(range(len(self.load)), key=self.load.__getitem__)
            ref = self.job.workers[w].run_episodes.remote([asdict(task)], [group], self.served)
            self.in_flight[ref] = (b, w, task, group)
            self.load[w] += 1

    def _wait(self, bar) -> None:
        """Collect finished episodes (or wait a moment for the trainer)."""
        import ray

        if not self.in_flight:
            if self.training is not None:
                wait_futures([self.training], timeout=0.05)
            return
        done, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=0.05)
        if done:
            done, _ = ray.wait(list(self.in_flight), num_returns=len(self.in_flight), timeout=0)
        for ref in done:
            b, w, task, group = self.in_flight.pop(ref)
            self.load[w] -= 1
            try:
                self.batches[b] += [Trajectory.from_dict(d) for d in ray.get(ref)]
            except ray.exceptions.RayActorError as e:  # the worker died; Ray restarts it: this episode failed
                self.batches[b] += lost_episodes([asdict(task)], [group], self.served, w, e)
            self.job.bar.advance(bar)

    def _train(self, step: int, trajs: list[Trajectory]) -> tuple[dict, list[Trajectory], float]:
        """The trainer thread: one step on a complete batch, then the new weights to the engine (interrupting)."""
        job = self.job
        t0 = time.perf_counter()
        consumed_at = job.version
        ok = [t for t in trajs if not t.failed]  # failed episodes never reach the gradient
        metrics = rollout_metrics(trajs) | job.sandbox_metrics() | staleness_metrics(consumed_at, trajs)
        if ok:
            rows, shaping = job.rl_rows(ok)
            metrics |= shaping | job.update(rows)
        t1 = time.perf_counter()
        job.version += 1
        job.push_weights()
        self.served = job.version
        t2 = time.perf_counter()
        metrics |= {"step": step, "policy/version": job.version, "time/train": t1 - t0, "time/weight_sync": t2 - t1}
        return metrics, trajs, t2 - t0

    def _engine_busy(self) -> float:
        import ray

        return float(ray.get(self.job.engine.stats.remote()).get("busy_seconds", 0.0))


def async_steps(job, start: int = 0) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, metrics) as each async step ends, from step ``start``; see the module docstring."""
    return AsyncDriver(job, start).run()
