"""The RL loop: the one place that drives both the rollout and the trainer.

Each step: sample tasks → rollout workers run G episodes per task in fresh sandboxes → verifiers score them → the
algorithm's advantages (``trainer.algorithm``, see trainer/algorithms) → one DeepSpeed step over all ranks → new weights
to the engine. An optional cold start (synthetic pretraining, then a supervised warm start on verified
reference-solution episodes) comes first, so RL starts from a policy that already calls tools. trainer/run.py drives a
whole job with it.
"""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from sandforge.config import JobConfig
from sandforge.rollout.metrics import rollout_metrics
from sandforge.rollout.tasks import TaskSampler
from sandforge.runlog import RunLogger
from sandforge.trainer.weight_sync import WeightSync
from sandforge.trainer.workers import collect_episodes, start_workers, worker_gone
from sandforge.trainer.eta import RunClock
from sandforge.trainer.algorithms import informative_groups, overlong_penalty, resolve, token_advantages
from sandforge.types import Task, Trajectory

console = Console(stderr=True)


class JobError(RuntimeError):
    """The job cannot go on for a reason the user can act on (no verified demonstrations, ...): one line, no traceback."""


def make_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)


def training_rows(trajs: list[Trajectory]) -> list[dict]:
    return [{"token_ids": t.token_ids, "loss_mask": t.loss_mask, "logprobs": t.logprobs,
             "routed_experts": t.routed_experts} for t in trajs]


def eval_line(summary: dict) -> str:
    envs = "  ".join(f"{env} {s['success']:.2f}" for env, s in summary["per_env"].items())
    return (f"held-out eval after step {summary['step']}: success {summary['success']:.2f}  "
            f"pass@{summary['k']} {summary['pass@k']:.2f}  ({envs})")


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    return (f"step {step + 1}/{total}  reward {m['reward/mean']:.3f}  success {m['success/rate']:.2f}  "
            f"turns {m.get('turns/mean', 0):.1f}  failed {int(m['episodes/failed'])}  "
            f"timeouts {int(m.get('episodes/timeouts', 0))}  tool errors/ep {m.get('tools/errors_per_episode', 0):.1f}  "
            f"loss {m.get('loss', 0):.4f}  kl {m.get('kl', 0):.4f}  {m['time/step']:.1f}s")


class RLJob:
    """Owns the actors of one run: trainer ranks, the inference engine and the rollout workers."""

    def __init__(self, cfg: JobConfig, run_id: str, images: dict[str, str], logger: RunLogger, bar: Progress,
                 sandbox_labels: dict[str, str]):
        import ray

        from sandforge.rollout.engine import InferenceEngine
        from sandforge.rollout.worker import RolloutWorker
        from sandforge.trainer.actor import TrainerRank

        self.cfg, self.run_id, self.logger, self.bar = cfg, run_id, logger, bar
        self.clock: RunClock | None = None  # the whole run's ETA (trainer/eta.py), fed with what each kind of work costs
        self.rng = random.Random(cfg.run.seed)
        self.sampler = TaskSampler(cfg.environments, cfg.run.seed)
        self.output_dir = Path(cfg.run.output_dir).resolve()
        threads = max(1, (os.cpu_count() or 1) // cfg.trainer.world_size)
        model_cfg = cfg.model.model_dump(mode="json", exclude={"init_from", "tokenizer"})
        init_from = str(cfg.model.init_from) if cfg.model.init_from else None
        # the trainer scores tokens under the same temperature the engine sampled them with, or the ratio is off
        trainer_cfg = cfg.trainer.model_dump() | {"temperature": cfg.rollout.temperature}
        # the most policy tokens an episode can have: Dr.GRPO's constant and DAPO's L_max
        budget = cfg.rollout.max_new_tokens * cfg.rollout.max_turns
        trainer_cfg["response_budget"] = min(budget, cfg.rollout.max_context)
        self.settings = resolve(trainer_cfg)
        port = free_port()
        rank_actor = ray.remote(num_cpus=0)(TrainerRank)
        self.ranks = [
            rank_actor.remote(r, cfg.trainer.world_size, "127.0.0.1", port, model_cfg, trainer_cfg, init_from,
                              cfg.model.tokenizer_source(), cfg.run.seed, threads)
            for r in range(cfg.trainer.world_size)
        ]
        policy_cfg = ray.get(self.ranks[0].model_config_dict.remote())
        self.engine = ray.remote(num_cpus=0)(InferenceEngine).options(name=f"engine-{run_id}").remote(
            policy_cfg, cfg.engine.max_batch_size, cfg.engine.session_memory_mb, cfg.run.seed, os.cpu_count() or 1
        )
        # one worker per node in turn (trainer/workers.py), so on a cluster every node's Docker daemon runs sandboxes; a
        # worker that dies (killed, OOM, its node lost) is restarted by Ray for the next episodes, and the episodes it
        # had in flight come back failed (``lost_episodes``)
        # the engine goes by name: a handle among an actor's arguments is kept in the object store, which Ray warns
        # may break restarts (ray-project/ray#53727)
        self.workers = start_workers(RolloutWorker, cfg.rollout.workers, cfg.model_dump(mode="json"), run_id,
                                     f"engine-{run_id}", images, sandbox_labels)
        self.version = 0
        # with expert parallelism (experts) or ZeRO-3 (every parameter) the model is spread over the ranks: all of them
        # take part in gathering the whole model, and rank 0's copy goes to the engine
        gather_all = cfg.trainer.expert_parallel > 1 or cfg.trainer.zero_stage == 3
        self.sync = WeightSync(cfg.trainer.weight_sync, self.ranks, self.engine, gather_all)
        self.push_weights()

    def push_weights(self) -> None:
        self.sync.push(self.version)

    def collect(self, tasks: list[Task], groups: list[str], scripted: bool, label: str) -> list[Trajectory]:
        """Spread episodes over the workers and gather them all, failed ones included."""
        t0 = time.monotonic()
        trajs = collect_episodes(self.workers, tasks, groups, self.cfg.run.seed, self.version, scripted, self.bar,
                                 label)
        self.tick("scripted" if scripted else "episode", len(tasks), time.monotonic() - t0)
        return trajs

    def tick(self, kind: str, units: int, seconds: float) -> None:
        if self.clock is not None:
            self.clock.add(kind, units, seconds)

    def evaluate(self, step: int) -> dict:
        """Held-out success of the current policy (``eval`` config): logged as an ``eval`` row; returns the summary."""
        from sandforge.rollout.evaluate import heldout_tasks, metric_row, summarize

        e = self.cfg.eval
        tasks = heldout_tasks(self.cfg.environments, e.tasks_per_family)
        episodes = [(task, f"eval{step}/{task.id}") for task in tasks for _ in range(e.samples)]
        trajs = self.collect([x[0] for x in episodes], [x[1] for x in episodes], scripted=False,
                             label=f"held-out eval: {len(tasks)} tasks x {e.samples}")
        self.logger.log_trajectories(step, "eval", trajs)
        summary = {"step": step, "policy_version": self.version, **summarize(trajs, e.samples)}
        self.logger.log("eval", {"step": step, **metric_row(summary)})
        self.bar.console.print(eval_line(summary), soft_wrap=True)
        return summary

    def sandbox_metrics(self) -> dict[str, float]:
        """Acquire/exec latency percentiles over every worker's samples, live sandboxes, failures by kind."""
        import ray

        from sandforge.environments.sandbox.stats import SandboxStats

        stats = SandboxStats()
        for ref in [w.sandbox_stats.remote() for w in self.workers]:
            try:
                stats.absorb(ray.get(ref))
            except worker_gone():  # a worker gone for good: its samples went with it
                pass
        return stats.snapshot()

    def close(self) -> None:
        """Ask the workers to remove their warm sandboxes (best effort: the run's label sweep follows anyway)."""
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception as e:
            console.print(f"[yellow]workers did not close cleanly: {e}[/]")

    def train(self, rows: list[dict], mode: str) -> dict[str, float]:
        import ray

        total = sum(sum(r["loss_mask"]) for r in rows)
        world = len(self.ranks)
        results = ray.get([rank.train_step.remote(rows[i::world], total, mode, len(rows))
                           for i, rank in enumerate(self.ranks)])
        return results[0]

    def update(self, rows: list[dict]) -> dict[str, float]:
        """One RL step's optimizer steps: ``trainer.mini_batches`` of them over a shuffled split of ``rows``, each
        against the log-probs the trainer had before the first. Metrics are averaged over them (``ratio/min|max``:
        the extremes), so ``ratio/*`` and ``clip_frac`` show how far the later mini-batches moved."""
        n = min(self.cfg.trainer.mini_batches, len(rows))
        if n == 1:
            return self.train(rows, mode="rl")
        order = list(range(len(rows)))
        self.rng.shuffle(order)
        parts = [self.train([rows[i] for i in order[k::n]], mode="rl") for k in range(n)]
        out = {}
        for key in parts[0]:
            values = [p[key] for p in parts if key in p]
            pick = {"ratio/min": min, "ratio/max": max}.get(key, lambda v: sum(v) / len(v))
            out[key] = pick(values)
        return out

    def score(self, rows: list[dict]) -> list[dict]:
        """Each row's per-token KL penalty and value estimates from the trainer (``TrainerRank.score``), in row order."""
        import ray

        world = len(self.ranks)
        shards = ray.get([rank.score.remote(rows[i::world]) for i, rank in enumerate(self.ranks)])
        out: list[dict] = [{}] * len(rows)
        for i, shard in enumerate(shards):
            out[i::world] = shard
        return out

    def pretrain(self) -> None:
        """Synthetic pretraining (trainer/pretrain.py): the policy learns to copy values into tool calls."""
        import ray

        p = self.cfg.pretrain
        copies = self.copy_source("pretrain")
        ray.get([rank.set_lr.remote(p.lr) for rank in self.ranks])
        job = self.bar.add_task("pretraining: copying into tool calls", total=p.steps)
        losses = []
        for step in range(p.steps):
            t0 = time.monotonic()
            m = self.train(copies(p.batch_size), mode="sft")
            self.tick("pretrain", 1, time.monotonic() - t0)
            losses.append(m["loss"])
            self.logger.log("pretrain", {"pretrain/step": step, "pretrain/loss": m["loss"]})
            self.bar.update(job, advance=1, description=f"pretraining: loss {m['loss']:.3f}")
        self.bar.console.print(f"pretraining: {p.steps} steps of generated tool calls; loss {losses[0]:.3f} -> "
                               f"{losses[-1]:.3f}", soft_wrap=True)

    def copy_source(self, stream: str):
        """``n -> rows`` of generated copy exchanges over the job's tools (trainer/pretrain.py), from a seeded stream."""
        from sandforge.models.policy import load_chat
        from sandforge.trainer.pretrain import copy_rows, env_tools

        chat = load_chat(self.cfg.model.model_dump(mode="json"))
        tools = env_tools(sorted({e.name for e in self.cfg.environments}))
        rng = random.Random(f"{stream}/{self.cfg.run.seed}")
        return lambda n: copy_rows(chat, tools, rng, n, listed=self.cfg.pretrain.listed)

    def warmup(self) -> None:
        w = self.cfg.warmup
        tasks = self.sampler.sample(w.episodes)
        trajs = self.collect(tasks, [t.id for t in tasks], scripted=True, label="warm start: reference episodes")
        self.logger.log_trajectories(0, "warmup", trajs)
        demos = [t for t in trajs if not t.failed and t.reward and t.reward.success]
        if not demos:
            reasons = {t.failure or (t.reward.reason if t.reward else "") for t in trajs}
            raise JobError(f"warm start: no reference episode passed its verifier ({'; '.join(sorted(reasons))})")
        for family in sorted({f"{t.task.env}/{t.task.family}" for t in trajs}
                             - {f"{t.task.env}/{t.task.family}" for t in demos}):
            failed = [t for t in trajs if f"{t.task.env}/{t.task.family}" == family]
            why = failed[0].failure or (failed[0].reward.reason if failed[0].reward else "") or failed[0].finish_reason
            self.bar.console.print(f"[yellow]warm start: no verified demonstration of {family} ({len(failed)} tried; "
                                   f"first: {why}); is rollout.max_turns ({self.cfg.rollout.max_turns}) shorter than "
                                   f"its reference solution?[/]", soft_wrap=True)
        import ray

        ray.get([rank.set_lr.remote(w.lr) for rank in self.ranks])
        job = self.bar.add_task(f"warm start: SFT on {len(demos)} verified episodes", total=w.steps)
        losses = []
        copies = self.copy_source("warmup") if w.copy_rows else None
        for step in range(w.steps):
            batch = self.rng.sample(demos, min(w.batch_size, len(demos)))
            t0 = time.monotonic()
            m = self.train(training_rows(batch) + (copies(w.copy_rows) if copies else []), mode="sft")
            self.tick("sft", 1, time.monotonic() - t0)
            losses.append(m["loss"])
            self.logger.log("warmup", {"warmup/step": step, "warmup/loss": m["loss"], "warmup/grad_norm": m["grad_norm"]})
            self.bar.update(job, advance=1, description=f"warm start: SFT loss {m['loss']:.3f}")
        self.bar.console.print(f"warm start: {len(demos)}/{len(trajs)} reference episodes verified; "
                               f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} in {w.steps} steps", soft_wrap=True)
        ray.get([rank.set_lr.remote(self.cfg.trainer.lr) for rank in self.ranks])
        ray.get([rank.reset_reference.remote() for rank in self.ranks])
        self.version += 1
        self.push_weights()

    def sample_groups(self, step: int) -> tuple[list[Trajectory], list[Trajectory], dict[str, float]]:
        """G episodes for each of ``rollout.tasks_per_step`` tasks: (every episode, the ones to train on, metrics).

        With dynamic sampling (DAPO), groups whose verifier rewards all match (nothing to learn from) are dropped and
        the missing tasks sampled again, up to ``trainer.dynamic_sampling_max_rounds`` rounds in all."""
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
            useful = informative_groups([t.reward.value for t in ok], [t.group for t in ok])
            filtered += len({t.group for t in got} - useful)
            keep += [t for t in ok if t.group in useful]
            need -= len(useful)
            if need <= 0:
                break
        return trajs, keep, {"dapo/filtered_groups": filtered, "dapo/rounds": n + 1}

    def rl_rows(self, ok: list[Trajectory]) -> tuple[list[dict], dict[str, float]]:
        """Training rows with per-token advantages (and PPO's value targets) from the algorithm."""
        s = self.settings
        rows = training_rows(ok)
        penalties = [overlong_penalty(t.response_tokens, s.response_budget, s.overlong_buffer, s.overlong_penalty)
                     for t in ok]
        mini = self.cfg.trainer.mini_batches > 1
        scores = self.score(rows) if s.needs_scores or mini else None
        adv, returns = token_advantages(
            s.algorithm.advantages,
            [t.reward.value + p for t, p in zip(ok, penalties)],
            [t.group for t in ok],
            [t.loss_mask for t in ok],
            kl_penalty=[x["kl_penalty"] for x in scores] if scores else None,
            values=[x["values"] for x in scores] if scores and s.algorithm.value_head else None,
            gamma=s.gamma,
            lam=s.gae_lambda,
        )
        for i, row in enumerate(rows):
            row["advantages"] = adv[i]
            if returns is not None:
                row["returns"] = returns[i]
            if mini:
                row["old_logprobs"] = scores[i]["old_logprobs"]
        metrics = {"dapo/overlong_penalty": sum(penalties) / len(penalties)} if s.overlong_buffer else {}
        return rows, metrics

    def rl_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        trajs, ok, sampling = self.sample_groups(step)
        t1 = time.perf_counter()
        metrics = rollout_metrics(trajs) | self.sandbox_metrics() | sampling
        if ok:
            rows, shaping = self.rl_rows(ok)
            metrics |= shaping | self.update(rows)
        else:
            console.print(f"[yellow]step {step + 1}: no episode to learn from (all failed, or no group with differing "
                          "rewards); no update this step[/]")
        t2 = time.perf_counter()
        self.version += 1
        self.push_weights()
        t3 = time.perf_counter()
        self.tick("update", 1, t3 - t1)
        self.logger.log_trajectories(step, "rl", trajs)
        metrics |= {"step": step, "policy/version": self.version, "time/rollout": t1 - t0, "time/train": t2 - t1,
                    "time/weight_sync": t3 - t2, "time/step": t3 - t0}
        return metrics

    def checkpoint(self, step: int) -> str:
        """Everything a resumed run needs after ``step`` RL steps (trainer/checkpoint.py); ``complete`` goes last."""
        import ray
        import torch

        from sandforge.trainer.checkpoint import checkpoint_dir, config_hash, mark_complete, save_driver_state

        directory = str(self.output_dir / "checkpoints")
        state = {"step": step, "policy_version": self.version, "run_id": self.run_id}
        paths = ray.get([rank.save_checkpoint.remote(directory, f"step_{step}", state) for rank in self.ranks])
        where = checkpoint_dir(self.output_dir, step)
        save_driver_state(where, {
            **state,
            "sampler_rng": self.sampler.rng.getstate(),  # the data cursor: which tasks come next
            "driver_rng": self.rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "engine_rng": ray.get(self.engine.rng_state.remote()),
            "config_hash": config_hash(self.cfg.model_dump(mode="json")),
        })
        mark_complete(where)
        (self.output_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")
        return paths[0]

    def restore(self, step: int) -> None:
        """Continue from checkpoint ``step``: ranks reload (DeepSpeed), RNGs, data cursor and version come back, and the
        engine gets the restored weights."""
        import ray
        import torch

        from sandforge.trainer.checkpoint import checkpoint_dir, config_hash, load_driver_state

        where = checkpoint_dir(self.output_dir, step)
        driver = load_driver_state(where)
        if driver["config_hash"] != config_hash(self.cfg.model_dump(mode="json")):
            console.print(f"[yellow]resume: the config differs from the one {where} was written with (beyond "
                          "run.output_dir, trainer.steps, trainer.checkpoint_every, logging); continuing anyway[/]")
        reference = checkpoint_dir(self.output_dir, 0) / "policy"  # the policy RL started from: the KL reference
        ray.get([rank.load_checkpoint.remote(str(self.output_dir / "checkpoints"), where.name,
                                             str(reference) if reference.is_dir() else None)
                 for rank in self.ranks])
        self.sampler.rng.setstate(driver["sampler_rng"])
        self.rng.setstate(driver["driver_rng"])
        torch.set_rng_state(driver["torch_rng"])
        self.version = driver["policy_version"]
        self.push_weights()
        ray.get(self.engine.set_rng_state.remote(driver["engine_rng"]))


def rl_steps(job: RLJob, start: int = 0) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, metrics) as each RL step ends: one after the other (``trainer.mode: sync``), or from the async driver,
    whose rollouts go on while the trainer steps (``trainer.mode: async``, trainer/async_loop.py)."""
    if job.cfg.trainer.mode == "async":
        from sandforge.trainer.async_loop import async_steps

        return async_steps(job, start)
    return ((step, job.rl_step(step)) for step in range(start, job.cfg.trainer.steps))


def job_images(cfg: JobConfig) -> dict[str, Path]:
    """Every image the job's tasks run in (image name -> folder with its Dockerfile): each environment's own (a
    plugin's may live in its package, or reuse a built-in's), plus the ones tasks bring (a Harbor task's)."""
    from sandforge.registry import environment

    contexts = {}
    for env in cfg.environments:
        entry = environment(env.name)
        if entry.image_name is not None:
            contexts[entry.image_name] = entry.image_context()
    return contexts | TaskSampler(cfg.environments, cfg.run.seed).images()
