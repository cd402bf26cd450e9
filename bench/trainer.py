"""Trainer and RL loop benchmarks on CPU.

    python bench/trainer.py [--sections weight_sync deepspeed_vs_torch]
    python bench/trainer.py --sections async_vs_sync [--steps 6] [--delay 30] [--max-staleness 2] [--workers 2]
                            [--concurrency 6] [--tasks-per-step 2]

Sections (each returns a dict of JSON keys; ``main`` merges them):
- async_vs_sync: whole jobs of configs/terminal.yaml, shrunk, on real parts (Docker, Ray, DeepSpeed): the same job
  (same seed, steps, tasks and episodes: ``rollout.tasks_per_step`` x ``group_size`` per step, k3-nano, no warm
  start) in ``trainer.mode: sync`` and ``async``, with a slow environment: every terminal task gets a setup command
  ``sleep --delay`` (a service that takes seconds to come up), so episodes spend most of their time waiting, as
  agentic episodes do (model and trainer work are kept small: ``--turns``, ``--tokens``, one micro-batch per step,
  since on a shared 2-core machine CPU-bound work cannot overlap). Wall time = the sum of the RL steps' ``time/step``
  (actor start-up and the final checkpoint are the same in both and left out). async_vs_sync = sync wall / async
  wall (target >= 2), with the async run's measured staleness (mean, max, histogram) and the trainer's and engine's
  idle fractions. With max_staleness s, up to s + 1 batches are in flight, so a latency-bound job gains up to
  about (s + 1)x, plus the training time hidden behind rollouts.

- weight_sync: seconds per GB of weights pushed from a trainer actor into the serving engine actor (loaded, version
  reported back), ``trainer.weight_sync`` object_store vs collective (Gloo on CPU; NCCL on GPU). JSON
  ``weight_sync_s_per_gb`` {object_store, collective}.
- deepspeed_vs_torch: train tokens/s (CPU time) of ``TrainerRank.train_step`` (DeepSpeed ZeRO-2) over a plain torch
  loop (AdamW, the same micro-batches, gradient accumulation, clipping and bias upkeep) on the same k3-nano and batch;
  target >= 0.9. Both pad (packing is measured on its own).
- packing: train tokens/s of ``TrainerRank.train_step`` with ``trainer.pack_sequences`` on over off, on a batch of
  agentic episode lengths (lognormal: mostly short, a few long); JSON ``packed_vs_padded`` and the forward's slot use.
- lora_vs_full: train tokens/s (wall clock of the median step, ``--lora-threads`` torch threads) of the same RL step
  (``TrainerRank.train_step``: policy forward and backward, the KL reference's forward, the optimizer step) on
  SmolLM2-135M-Instruct (``--smollm2``: a pulled catalogue name or a directory), with ``model.lora`` at its defaults
  over full fine-tuning, same batch (``--lora-rows`` x ``--lora-len`` tokens); JSON ``lora_vs_full``, and
  ``lora_top_vs_full`` for adapters on the last ``--lora-top-layers`` layers only (``model.lora.top_layers``).

- precision: train tokens/s of the quickstart's RL step (SmolLM2, LoRA on the top layers) without the KL reference's
  forward (``trainer.log_kl: false``) over with it, and with DeepSpeed bf16 (``trainer.bf16``) over fp32; JSON
  ``no_kl_vs_kl``, ``bf16_vs_fp32``.
- shared_trunk: train tokens/s of the quickstart's RL step with KL 0.05 in the loss when the reference's forward
  resumes from the policy's frozen layers below the adapters (``trainer.reference_forward: shared_trunk``) over the
  full reference forward; JSON ``shared_trunk_vs_full``.
- padding_mask: train tokens/s of the same step when a right-padded micro-batch reaches the model without its
  padding mask (``HFPolicy.causal_right_padding``: SDPA's causal kernel) over with it; JSON ``causal_vs_mask``.
- loss_mask_scoring: train tokens/s of the same step when logits are computed only where a loss-mask token is
  predicted (the trainer's path) over scoring every token (the reference), on quickstart-shaped episodes
  (``--policy-share`` of the tokens the policy's); JSON ``loss_mask_vs_all_tokens``.

``--sections weight_sync deepspeed_vs_torch`` runs only those.

Prints a table, then as the last line a JSON object with the keys of every section.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sandforge.types import TrainingRow

ROOT = Path(__file__).resolve().parents[1]


def _slow_sampler(delay: float):
    """A TaskSampler whose tasks each run ``sleep delay`` in their sandbox before the episode starts (the tasks travel
    to the rollout workers as plain data, so patching the driver's sampler is enough)."""
    from sandforge.job.task_sampler import TaskSampler

    class SlowTasks(TaskSampler):
        def sample(self, n: int, split: str = "train"):
            tasks = super().sample(n, split)
            for task in tasks:
                task.setup = {**task.setup, "commands": [*task.setup.get("commands", []), f"sleep {delay}"]}
            return tasks

    return SlowTasks


def _job(mode: str, out: Path, args) -> list[dict]:
    """Run one job; returns its RL metric rows."""
    from sandforge.config import load_config
    from sandforge.job import rl_job
    from sandforge.job.run import run

    cfg = load_config(ROOT / "configs/terminal.yaml", [
        f"run.output_dir={out}", f"trainer.steps={args.steps}", f"trainer.mode={mode}",
        f"trainer.max_staleness={args.max_staleness}", "warmup.steps=0", "logging.wandb.mode=disabled",
        f"rollout.workers={args.workers}", f"rollout.concurrency={args.concurrency}",
        f"rollout.tasks_per_step={args.tasks_per_step}", "rollout.group_size=2", f"rollout.max_turns={args.turns}",
        f"rollout.max_new_tokens={args.tokens}",
        "trainer.grad_accum_steps=1",
        f"sandbox.exec_timeout={args.delay + 30:g}", f"sandbox.warm_pool={args.concurrency}",
    ])
    real = rl_job.TaskSampler
    rl_job.TaskSampler = _slow_sampler(args.delay)
    try:
        run(cfg)
    finally:
        rl_job.TaskSampler = real
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl"]


def async_vs_sync_section(args, table: Table) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        sync = _job("sync", Path(tmp) / "sync", args)
        async_ = _job("async", Path(tmp) / "async", args)
    wall_sync = sum(r["time/step"] for r in sync)
    wall_async = sum(r["time/step"] for r in async_)
    episodes = [sum(v for k, v in r.items() if k.startswith("async/staleness_count_")) for r in async_]
    histogram: dict[str, int] = {}
    for r in async_:
        for k, v in r.items():
            if k.startswith("async/staleness_count_"):
                histogram[k.rsplit("_", 1)[1]] = histogram.get(k.rsplit("_", 1)[1], 0) + int(v)
    staleness_mean = sum(r["async/staleness_mean"] * n for r, n in zip(async_, episodes)) / max(sum(episodes), 1)
    staleness_max = max(r["async/staleness_max"] for r in async_)
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    ratio = wall_sync / wall_async
    table.add_row("sync: wall time of the RL steps", f"{wall_sync:.1f} s",
                  f"{len(sync)} steps, {args.delay:g} s setup per episode")
    table.add_row("async: wall time of the same steps", f"{wall_async:.1f} s",
                  f"max_staleness {args.max_staleness}, {args.workers * args.concurrency} episodes in flight at most")
    table.add_row("async_vs_sync", f"{ratio:.2f}x", "target >= 2")
    table.add_row("async staleness (episodes)", f"mean {staleness_mean:.2f}, max {staleness_max}",
                  "histogram " + ", ".join(f"{k}: {v}" for k, v in sorted(histogram.items())))
    table.add_row("async trainer / engine idle", f"{mean(async_, 'time/trainer_idle_frac'):.2f} / "
                  f"{mean(async_, 'time/engine_idle_frac'):.2f}", "fraction of wall time, mean over steps")
    return {"async_vs_sync": round(ratio, 2), "async_wall_s": round(wall_async, 1), "sync_wall_s": round(wall_sync, 1),
            "async_staleness_mean": round(staleness_mean, 3), "async_staleness_max": staleness_max,
            "async_staleness_histogram": histogram,
            "async_partial_episodes": sum(int(r.get("async/partial_episodes", 0)) for r in async_),
            "async_trainer_idle_frac": round(mean(async_, "time/trainer_idle_frac"), 3),
            "async_engine_idle_frac": round(mean(async_, "time/engine_idle_frac"), 3)}


# ---- weight sync and the DeepSpeed step (job/fleet/weight_sync.py, trainer/rank.py) --- -------------------------------

class _WeightSender:
    """Trainer rank 0's side of a push, without DeepSpeed: a policy's state dict to send either way."""

    def __init__(self, policy_cfg: dict, seed: int):
        import torch

        from sandforge.models.build import policy_from_config

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.weights = {k: v.detach().clone() for k, v in policy_from_config(policy_cfg).state_dict().items()}

    def get_weights(self) -> dict:
        return self.weights

    def open_weight_channel(self, host: str, port: int) -> None:
        from sandforge.models.weight_channel import WeightChannel

        self.channel = WeightChannel(host, port, rank=0)

    def send_weights(self, version: int) -> int:
        return self.channel.send(self.weights, version)

    def share_weights(self) -> bytes:
        from sandforge.models.shared_weights import share

        return share(self.weights)


def weight_sync_section(args, table: Table) -> dict:
    """Seconds per GB of weights from a trainer actor into a serving EngineActor actor (received, loaded, version
    reported), through the Ray object store and through the collective channel (Gloo on CPU), same actors."""
    import statistics
    import time

    import ray

    from sandforge.config import EngineConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.job.fleet.weight_sync import WeightSync
    from sandforge.models.build import policy_config
    from sandforge.models.k3.model import PRESETS, K3Model
    from sandforge.engine import EngineActor

    policy_cfg = policy_config(K3Model(PRESETS[args.sync_preset]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=1024 * 1024**2)
    try:
        sender = ray.remote(num_cpus=0)(_WeightSender).remote(policy_cfg, 0)
        engine = ray.remote(num_cpus=0)(EngineActor).remote(policy_cfg, EngineConfig(max_batch_size=4, session_memory_mb=64),
                                                                0, 1)
        weights = ray.get(sender.get_weights.remote())
        gb = sum(v.numel() * v.element_size() for v in weights.values()) / 1e9
        del weights
        out, version = {}, 0
        for mode in ("object_store", "collective", "colocated"):
            sync = WeightSync(mode, [sender], engine, free_port(), gather_all=False)
            times = []
            for _ in range(args.sync_repeats + 1):  # the first push warms up (allocations, connections)
                version += 1
                t0 = time.perf_counter()
                assert sync.push(version) == version == ray.get(engine.version.remote())
                times.append(time.perf_counter() - t0)
            out[mode] = statistics.median(times[1:]) / gb
        ray.kill(engine)
        ray.kill(sender)
    finally:
        ray.shutdown()
    ratio = out["object_store"] / out["collective"]
    table.add_row(f"weight sync, object store ({args.sync_preset}, {gb * 1e3:.0f} MB fp32)",
                  f"{out['object_store']:.2f} s/GB", f"median of {args.sync_repeats} pushes, load + version included")
    table.add_row("weight sync, collective (gloo on CPU)", f"{out['collective']:.2f} s/GB",
                  f"object store / collective = {ratio:.2f}x; nccl on GPU")
    table.add_row("weight sync, colocated (shared memory on CPU)", f"{out['colocated']:.2f} s/GB",
                  f"object store / colocated = {out['object_store'] / out['colocated']:.2f}x; CUDA IPC on GPU")
    return {"weight_sync_s_per_gb": {k: round(v, 3) for k, v in out.items()},
            "weight_sync_object_store_vs_collective": round(ratio, 2), "weight_sync_gb": round(gb, 4)}


def _train_rows(vocab: int, n: int, length: int) -> list[TrainingRow]:
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        size = length - 7 * i  # uneven, as episodes are
        rows.append(TrainingRow(token_ids=torch.randint(1, vocab, (size,), generator=g).tolist(),
                                loss_mask=[0] * 16 + [1] * (size - 16)))
    return rows


def deepspeed_vs_torch_section(args, table: Table) -> dict:
    """Train tokens/s of TrainerRank.train_step (DeepSpeed, ZeRO-2, CPU) over a plain torch loop (AdamW, the same
    micro-batches and gradient accumulation, clipping, loss and bias upkeep) on the same model and batch."""
    import os
    import time

    import torch

    from sandforge.config import ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.build import after_optimizer_step, build_policy
    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import pad_right, split_micro_batches
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_cfg = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes")
    # both sides pad every sequence to its micro-batch's longest: this compares the step machinery, not packing
    trainer_cfg = TrainerConfig(grad_accum_steps=2, pack_sequences=False)
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), model_cfg, trainer_cfg, RolloutShape(1.0, 256), seed=0,
                       num_threads=1)
    torch.manual_seed(0)
    model = build_policy(model_cfg, len(rank.tokenizer))
    model.load_state_dict(rank.engine.module.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay)
    rows = _train_rows(len(rank.tokenizer), args.train_rows, args.train_len)
    total = sum(sum(r.loss_mask) for r in rows)
    tokens = sum(len(r.token_ids) for r in rows)

    def torch_step() -> float:
        model.train()
        step_loss = 0.0
        for micro in split_micro_batches(rows, trainer_cfg.grad_accum_steps):
            ids = pad_right([r.token_ids for r in micro], 0, torch.long)
            attn = pad_right([[1] * len(r.token_ids) for r in micro], 0, torch.long)
            mask = pad_right([r.loss_mask for r in micro], 0, torch.float32)
            logprobs, aux = token_logprobs(model, ids, attn)
            loss = -(logprobs * mask).sum() / total  # the SFT loss: token-mean over the whole step's assistant tokens
            (loss + aux).backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        after_optimizer_step(model)
        return step_loss

    def ds_step() -> float:
        return rank.train_step(rows, total, mode="sft")["loss"]

    timings = {"deepspeed": [], "torch": []}
    losses = {"deepspeed": [], "torch": []}
    for i in range(args.train_steps + 1):  # alternate, so machine noise hits both alike; step 0 warms up
        for name, step in (("deepspeed", ds_step), ("torch", torch_step)):
            t0 = time.process_time()
            losses[name].append(step())
            if i:
                timings[name].append(time.process_time() - t0)
    tps = {k: tokens * len(v) / sum(v) for k, v in timings.items()}
    ratio = tps["deepspeed"] / tps["torch"]
    table.add_row(f"train step, torch AdamW (k3-nano, {len(rows)} rows, {tokens} tokens, gas 2)",
                  f"{tps['torch']:.0f} tok/s", "CPU time, 1 thread")
    table.add_row("train step, DeepSpeed ZeRO-2 (TrainerRank.train_step)", f"{tps['deepspeed']:.0f} tok/s",
                  f"deepspeed_vs_torch = {ratio:.2f}x (target >= 0.9); first-step loss "
                  f"{losses['deepspeed'][0]:.4f} vs {losses['torch'][0]:.4f}")
    return {"deepspeed_vs_torch": round(ratio, 3), "train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


def episode_lengths(n: int, longest: int, seed: int = 0) -> list[int]:
    """Agentic episode lengths: most are short (one or two turns), a few run long (lognormal, capped at ``longest``)."""
    import random

    rng = random.Random(seed)
    return [max(32, min(longest, int(rng.lognormvariate(5.6, 0.7)))) for _ in range(n)]


def packing_section(args, table: Table) -> dict:
    """Train tokens/s of TrainerRank.train_step with ``trainer.pack_sequences`` on over off (every sequence padded to
    its micro-batch's longest): two ranks in this process, each built with its setting, from the same initial weights,
    on the same batch of agentic lengths, their steps alternated; plus the forward's slot use."""
    import os
    import time

    from sandforge.config import ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.packing import PackedLayout
    from sandforge.trainer.batches import split_micro_batches
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_cfg = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes")
    gas = 2
    # one rank per setting, built from its own typed config; the same seed gives both the same initial weights
    ranks = {pack: TrainerRank(0, 1, "127.0.0.1", free_port(), model_cfg,
                               TrainerConfig(grad_accum_steps=gas, pack_sequences=pack), RolloutShape(1.0, 256),
                               seed=0, num_threads=1)
             for pack in (True, False)}
    rank = ranks[True]
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = episode_lengths(args.pack_rows, args.pack_longest)
    rows = [TrainingRow(token_ids=torch.randint(1, len(rank.tokenizer), (n,), generator=g).tolist(),
                        loss_mask=[0] * 16 + [1] * (n - 16)) for n in lengths]
    total, tokens = sum(sum(r.loss_mask) for r in rows), sum(lengths)
    micro = split_micro_batches(rows, gas)
    slots = {pack: sum((PackedLayout.pack if pack else lambda n, a: PackedLayout.padded(n))(
        [len(r.token_ids) for r in m], rank.engine.module.pack_align).slots for m in micro) for pack in (True, False)}
    timings: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.train_steps + 1):  # alternate, so machine noise hits both alike; step 0 warms up
        for pack in (True, False):
            t0 = time.process_time()
            ranks[pack].train_step(rows, total, mode="sft")
            if i:
                timings[pack].append(time.process_time() - t0)
    tps = {pack: tokens * len(v) / sum(v) for pack, v in timings.items()}
    ratio = tps[True] / tps[False]
    table.add_row(f"train step, padded ({len(rows)} episodes of {min(lengths)}-{max(lengths)} tokens, gas {gas})",
                  f"{tps[False]:.0f} tok/s", f"forward slots {slots[False]} for {tokens} tokens")
    table.add_row("train step, packed (trainer.pack_sequences)", f"{tps[True]:.0f} tok/s",
                  f"packed_vs_padded = {ratio:.2f}x; forward slots {slots[True]}")
    return {"packed_vs_padded": round(ratio, 3),
            "packing_slot_use": {"packed": round(tokens / slots[True], 3), "padded": round(tokens / slots[False], 3)}}


def _rl_tokens_per_s(ranks: dict, rows: list[TrainingRow], steps: int) -> dict[str, float]:
    """Train tokens/s of each rank's RL step on the same on-policy rows (log-probs of the first rank, which all start
    from the same weights), their steps alternated so machine noise hits all alike; step 0 warms up; the median step
    (a busy neighbour's burst skews a mean)."""
    import statistics
    import time

    import torch

    from sandforge.models.sampling import token_logprobs
    from sandforge.trainer.batches import token_batch

    first = next(iter(ranks.values()))
    with torch.no_grad():
        logprobs, _ = token_logprobs(first.engine.module.eval(), *token_batch(rows))
    rows = [replace(r, logprobs=logprobs[i, : len(r.token_ids)].tolist(),
                    advantages=[1.0 if i % 2 else -1.0] * len(r.token_ids)) for i, r in enumerate(rows)]
    total, tokens = sum(sum(r.loss_mask) for r in rows), sum(len(r.token_ids) for r in rows)
    timings: dict[str, list[float]] = {name: [] for name in ranks}
    for i in range(steps + 1):
        for name, rank in ranks.items():
            t0 = time.perf_counter()
            rank.train_step(rows, total, mode="rl")
            if i:
                timings[name].append(time.perf_counter() - t0)
    return {name: tokens / statistics.median(v) for name, v in timings.items()}


def lora_vs_full_section(args, table: Table) -> dict:
    """Train tokens/s of one RL step on SmolLM2-135M with LoRA adapters over full fine-tuning: two TrainerRanks in this
    process (same weights, batch and step), their steps alternated so machine noise hits both alike."""
    import os

    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    path = str(local_model_dir(args.smollm2))
    trainer_cfg = TrainerConfig(grad_accum_steps=2, kl_coef=0.01)
    shape = RolloutShape(1.0, args.lora_len)
    loras = {"full": None, "lora": LoraConfig(), "lora_top": LoraConfig(top_layers=args.lora_top_layers)}
    ranks = {name: TrainerRank(0, 1, "127.0.0.1", free_port(), ModelConfig(path=path, lora=lora), trainer_cfg, shape,
                               seed=0, num_threads=args.lora_threads)
             for name, lora in loras.items()}
    rows = _train_rows(len(ranks["full"].tokenizer), args.lora_rows, args.lora_len)
    tokens = sum(len(r.token_ids) for r in rows)
    trainable = {name: sum(p.numel() for p in rank.engine.module.parameters() if p.requires_grad)
                 for name, rank in ranks.items()}
    tps = _rl_tokens_per_s(ranks, rows, args.train_steps)
    ratio, top_ratio = tps["lora"] / tps["full"], tps["lora_top"] / tps["full"]
    lora = LoraConfig()
    table.add_row(f"RL step, full fine-tuning (SmolLM2-135M, {len(rows)} rows, {tokens} tokens, gas 2)",
                  f"{tps['full']:.0f} tok/s", f"wall clock, median step, {args.lora_threads} threads; "
                  f"{trainable['full'] / 1e6:.1f}M trainable")
    table.add_row(f"RL step, LoRA r {lora.r} on {len(lora.target_modules)} projections", f"{tps['lora']:.0f} tok/s",
                  f"lora_vs_full = {ratio:.2f}x; {trainable['lora'] / 1e6:.2f}M trainable")
    table.add_row(f"RL step, the same adapters on the last {args.lora_top_layers} layers only",
                  f"{tps['lora_top']:.0f} tok/s",
                  f"lora_top_vs_full = {top_ratio:.2f}x; {trainable['lora_top'] / 1e6:.2f}M trainable")
    return {"lora_vs_full": round(ratio, 3), "lora_top_vs_full": round(top_ratio, 3),
            "lora_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "lora_trainable_params": trainable}


def precision_section(args, table: Table) -> dict:
    """Train tokens/s of the quickstart's RL step (SmolLM2-135M, LoRA on the top ``--lora-top-layers`` layers): as
    fp32 with the KL reference's forward (the baseline), without it (``trainer.log_kl: false``, kl_coef 0), and with
    DeepSpeed bf16 (``trainer.bf16``: fp32 master weights) on top; three TrainerRanks in this process, their steps
    alternated so machine noise hits all alike."""
    import os

    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = ModelConfig(path=str(local_model_dir(args.smollm2)), lora=LoraConfig(top_layers=args.lora_top_layers))
    shape = RolloutShape(1.0, args.lora_len)
    variants = {"fp32": dict(log_kl=True), "fp32_no_kl": dict(log_kl=False), "bf16_no_kl": dict(log_kl=False, bf16=True)}
    ranks = {name: TrainerRank(0, 1, "127.0.0.1", free_port(), model,
                               TrainerConfig(grad_accum_steps=2, kl_coef=0.0, **fields), shape, seed=0,
                               num_threads=args.lora_threads)
             for name, fields in variants.items()}
    tps = _rl_tokens_per_s(ranks, _train_rows(len(ranks["fp32"].tokenizer), args.lora_rows, args.lora_len),
                           args.train_steps)
    for name in ranks:
        table.add_row(f"RL step, SmolLM2 LoRA top {args.lora_top_layers}, {name}", f"{tps[name]:.0f} tok/s",
                      f"{tps[name] / tps['fp32']:.2f}x fp32 with the KL reference's forward")
    return {"no_kl_vs_kl": round(tps["fp32_no_kl"] / tps["fp32"], 3),
            "bf16_vs_fp32": round(tps["bf16_no_kl"] / tps["fp32_no_kl"], 3),
            "precision_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


def fused_lora_section(args, table: Table) -> dict:
    """Train tokens/s of the quickstart's RL step (SmolLM2-135M, LoRA on the top ``--lora-top-layers`` layers, bf16,
    no KL reference, micro-batches of 2 episodes) with the adapted layers fused (``model.lora.fused``,
    models/lora_fused.py) over peft's own forward (the reference), on quickstart-shaped episodes (``_agentic_rows``).
    Two TrainerRanks in this process, their steps alternated so machine noise hits both alike."""
    import os

    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    shape = RolloutShape(1.0, args.lora_len)
    ranks = {}
    for name, fused in (("peft", False), ("fused", True)):
        model = ModelConfig(path=str(local_model_dir(args.smollm2)),
                            lora=LoraConfig(top_layers=args.lora_top_layers, fused=fused))
        ranks[name] = TrainerRank(0, 1, "127.0.0.1", free_port(), model,
                                  TrainerConfig(grad_accum_steps=max(1, args.lora_rows // 2), kl_coef=0.0,
                                                log_kl=False, bf16=True), shape, seed=0, num_threads=args.lora_threads)
    rows = _agentic_rows(len(ranks["peft"].tokenizer), args.lora_rows, args.lora_len, args.policy_share)
    tps = _rl_tokens_per_s(ranks, rows, args.train_steps)
    for name in ranks:
        table.add_row(f"RL step, SmolLM2 LoRA top {args.lora_top_layers}, bf16, {name}", f"{tps[name]:.0f} tok/s",
                      f"{tps[name] / tps['peft']:.2f}x peft's forward")
    return {"fused_vs_peft": round(tps["fused"] / tps["peft"], 3),
            "fused_lora_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


def shared_trunk_section(args, table: Table) -> dict:
    """Train tokens/s of the quickstart's RL step (SmolLM2-135M, LoRA on the top ``--lora-top-layers`` layers, bf16,
    KL 0.05 to the reference in the loss, micro-batches of 2 episodes) with the reference's forward resumed from the
    policy's frozen trunk (``trainer.reference_forward: shared_trunk``, trainer/shared_trunk.py) over the full
    reference forward (``full``, the reference), on quickstart-shaped episodes. Two TrainerRanks in this process, their
    steps alternated so machine noise hits both alike."""
    import os

    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = ModelConfig(path=str(local_model_dir(args.smollm2)), lora=LoraConfig(top_layers=args.lora_top_layers))
    ranks = {mode: TrainerRank(0, 1, "127.0.0.1", free_port(), model,
                               TrainerConfig(grad_accum_steps=max(1, args.lora_rows // 2), kl_coef=0.05, bf16=True,
                                             reference_forward=mode), RolloutShape(1.0, args.lora_len), seed=0,
                               num_threads=args.lora_threads)
             for mode in ("full", "shared_trunk")}
    rows = _agentic_rows(len(ranks["full"].tokenizer), args.lora_rows, args.lora_len, args.policy_share)
    tps = _rl_tokens_per_s(ranks, rows, args.train_steps)
    for name in ranks:
        table.add_row(f"RL step, SmolLM2 LoRA top {args.lora_top_layers}, bf16, KL reference {name}",
                      f"{tps[name]:.0f} tok/s", f"{tps[name] / tps['full']:.2f}x the full reference forward")
    return {"shared_trunk_vs_full": round(tps["shared_trunk"] / tps["full"], 3),
            "shared_trunk_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


def padding_mask_section(args, table: Table) -> dict:
    """Train tokens/s of the quickstart's RL step (SmolLM2-135M, LoRA on the top ``--lora-top-layers`` layers, bf16,
    KL 0.05 in the loss, micro-batches of 2 episodes) when a right-padded micro-batch reaches the model without its
    padding mask (``HFPolicy.causal_right_padding``: SDPA's causal kernel) over with it (the reference), on
    quickstart-shaped episodes. One TrainerRank; its steps alternate between the two, so machine noise hits both
    alike."""
    import os
    import statistics
    import time

    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = ModelConfig(path=str(local_model_dir(args.smollm2)), lora=LoraConfig(top_layers=args.lora_top_layers))
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), model,
                       TrainerConfig(grad_accum_steps=max(1, args.lora_rows // 2), kl_coef=0.05, bf16=True),
                       RolloutShape(1.0, args.lora_len), seed=0, num_threads=args.lora_threads)
    rows = [replace(r, logprobs=[0.0] * len(r.token_ids), advantages=[1.0 if i % 2 else -1.0] * len(r.token_ids))
            for i, r in enumerate(_agentic_rows(len(rank.tokenizer), args.lora_rows, args.lora_len,
                                                args.policy_share))]
    total, tokens = sum(sum(r.loss_mask) for r in rows), sum(len(r.token_ids) for r in rows)
    policy = rank.engine.module
    timings: dict[str, list[float]] = {"mask": [], "causal": []}
    for i in range(args.train_steps + 1):  # step 0 warms up
        for name in timings:
            policy.causal_right_padding = name == "causal"
            t0 = time.perf_counter()
            rank.train_step(rows, total)
            if i:
                timings[name].append(time.perf_counter() - t0)
    tps = {name: tokens / statistics.median(v) for name, v in timings.items()}
    for name in tps:
        table.add_row(f"RL step, SmolLM2 LoRA top {args.lora_top_layers}, bf16, padding {name}",
                      f"{tps[name]:.0f} tok/s", f"{tps[name] / tps['mask']:.2f}x the masked forward")
    return {"causal_vs_mask": round(tps["causal"] / tps["mask"], 3),
            "padding_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


def _agentic_rows(vocab: int, n: int, length: int, policy_share: float) -> list[TrainingRow]:
    """Episodes shaped as the quickstart's: a system prompt with the tool declarations, then policy turns between tool
    outputs, ``policy_share`` of the tokens the policy's own (the loss mask)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        size = length - 7 * i  # uneven, as episodes are
        policy = round(size * policy_share) // 4  # per turn, 4 turns
        prompt = (size - 4 * policy) // 2
        tool = (size - 4 * policy - prompt) // 4
        mask = ([0] * prompt + ([1] * policy + [0] * tool) * 4 + [0] * size)[:size]
        rows.append(TrainingRow(token_ids=torch.randint(1, vocab, (size,), generator=g).tolist(), loss_mask=mask))
    return rows


def loss_mask_scoring_section(args, table: Table) -> dict:
    """Train tokens/s of the quickstart's RL step (SmolLM2-135M, LoRA on the top layers, bf16, no KL reference) when
    the forward computes logits only where a loss-mask token is predicted (what the trainer does) over scoring every
    token (``forward_scores(all_tokens=True)``, the reference), on episodes ``--policy-share`` of which the policy
    wrote. One TrainerRank; its steps alternate between the two, so machine noise hits both alike."""
    import functools
    import os
    import statistics
    import time

    import torch

    import sandforge.trainer.rank as rank_module
    from sandforge.config import LoraConfig, ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.models.sampling import token_logprobs
    from sandforge.models.sources import local_model_dir
    from sandforge.trainer.batches import forward_scores, token_batch
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = ModelConfig(path=str(local_model_dir(args.smollm2)), lora=LoraConfig(top_layers=args.lora_top_layers))
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), model,
                       TrainerConfig(grad_accum_steps=2, kl_coef=0.0, log_kl=False, bf16=True),
                       RolloutShape(1.0, args.lora_len), seed=0, num_threads=args.lora_threads)
    rows = _agentic_rows(len(rank.tokenizer), args.lora_rows, args.lora_len, args.policy_share)
    with torch.no_grad():
        logprobs, _ = token_logprobs(rank.engine.module.eval(), *token_batch(rows))
    rows = [replace(r, logprobs=logprobs[i, : len(r.token_ids)].tolist(),
                    advantages=[1.0 if i % 2 else -1.0] * len(r.token_ids)) for i, r in enumerate(rows)]
    total, tokens = sum(sum(r.loss_mask) for r in rows), sum(len(r.token_ids) for r in rows)
    variants = {"all_tokens": functools.partial(forward_scores, all_tokens=True), "loss_mask": forward_scores}
    timings: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for i in range(args.train_steps + 1):
            for name, scorer in variants.items():
                rank_module.forward_scores = scorer
                t0 = time.perf_counter()
                rank.train_step(rows, total, mode="rl")
                if i:  # step 0 warms up
                    timings[name].append(time.perf_counter() - t0)
    finally:
        rank_module.forward_scores = forward_scores
    tps = {name: tokens / statistics.median(v) for name, v in timings.items()}
    ratio = tps["loss_mask"] / tps["all_tokens"]
    share = total / tokens
    table.add_row(f"RL step, SmolLM2 LoRA top {args.lora_top_layers} bf16, every token scored "
                  f"({len(rows)} rows, {tokens} tokens, {share:.0%} policy)", f"{tps['all_tokens']:.0f} tok/s",
                  f"wall clock, median of {args.train_steps} steps, {args.lora_threads} threads")
    table.add_row("the same, logits only where a policy token is predicted", f"{tps['loss_mask']:.0f} tok/s",
                  f"loss_mask_vs_all_tokens = {ratio:.2f}x")
    return {"loss_mask_vs_all_tokens": round(ratio, 3), "loss_mask_policy_share": round(share, 3),
            "loss_mask_train_tokens_per_s": {k: round(v, 1) for k, v in tps.items()}}


# Sections run in order; each adds rows to the table and returns its JSON keys.
SECTIONS = [async_vs_sync_section, weight_sync_section, deepspeed_vs_torch_section, packing_section,
            lora_vs_full_section, precision_section, loss_mask_scoring_section, fused_lora_section,
            shared_trunk_section, padding_mask_section]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--delay", type=float, default=30.0, help="seconds each episode's environment takes to come up")
    ap.add_argument("--turns", type=int, default=1, help="rollout.max_turns")
    ap.add_argument("--tokens", type=int, default=8, help="rollout.max_new_tokens")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="rollout.workers")
    ap.add_argument("--concurrency", type=int, default=6, help="episodes per rollout worker")
    ap.add_argument("--tasks-per-step", type=int, default=2, help="rollout.tasks_per_step (each run 2 times)")
    ap.add_argument("--sync-preset", default="k3-mini", help="model whose weights the weight-sync section pushes")
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--train-rows", type=int, default=16)
    ap.add_argument("--train-len", type=int, default=320)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--pack-rows", type=int, default=32, help="episodes in the packing section's batch")
    ap.add_argument("--pack-longest", type=int, default=1024, help="longest episode in the packing section")
    ap.add_argument("--smollm2", default="smollm2-135m", help="lora_vs_full: catalogue name or HF directory")
    ap.add_argument("--lora-rows", type=int, default=4, help="lora_vs_full: sequences per step")
    ap.add_argument("--lora-len", type=int, default=512, help="lora_vs_full: tokens of the longest sequence")
    ap.add_argument("--lora-threads", type=int, default=2, help="lora_vs_full: torch threads")
    ap.add_argument("--lora-top-layers", type=int, default=10,
                    help="lora_vs_full: model.lora.top_layers of its third run")
    ap.add_argument("--policy-share", type=float, default=0.2,
                    help="loss_mask_scoring: the share of each episode's tokens the policy wrote")
    ap.add_argument("--sections", nargs="+", choices=[s.__name__.removesuffix("_section") for s in SECTIONS],
                    help="run only these sections (default: all)")
    args = ap.parse_args()

    table = Table(title="RL loop, k3-nano on CPU, real sandboxes")
    for column in ("what", "value", "notes"):
        table.add_column(column)
    result: dict = {}
    for section in SECTIONS:
        if args.sections is None or section.__name__.removesuffix("_section") in args.sections:
            result.update(section(args, table))
    Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
