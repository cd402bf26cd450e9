"""Trainer and RL loop benchmarks on CPU.

    python bench/trainer.py [--sections weight_sync deepspeed_vs_torch]

Sections (each returns a dict of JSON keys; ``main`` merges them):
- weight_sync: seconds per GB of weights pushed from a trainer actor into the serving engine actor (loaded, version
  reported back), ``trainer.weight_sync`` object_store vs collective (Gloo on CPU; NCCL on GPU). JSON
  ``weight_sync_s_per_gb`` {object_store, collective}.
- deepspeed_vs_torch: train tokens/s (CPU time) of ``TrainerRank.train_step`` (DeepSpeed ZeRO-2) over a plain torch
  loop (AdamW, the same micro-batches, gradient accumulation, clipping and bias upkeep) on the same k3-nano and batch;
  target >= 0.9.

``--sections weight_sync deepspeed_vs_torch`` runs only those.

Prints a table, then as the last line a JSON object with the keys of every section.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


# ---- weight sync and the DeepSpeed step (trainer/weight_sync.py, trainer/actor.py) -------------------------------

class _WeightSender:
    """Trainer rank 0's side of a push, without DeepSpeed: a policy's state dict to send either way."""

    def __init__(self, policy_cfg: dict, seed: int):
        import torch

        from sandforge.models.policy import policy_from_config

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.weights = {k: v.detach().clone() for k, v in policy_from_config(policy_cfg).state_dict().items()}

    def get_weights(self) -> dict:
        return self.weights

    def open_weight_channel(self, host: str, port: int) -> None:
        from sandforge.models.weight_sync import WeightChannel

        self.channel = WeightChannel(host, port, rank=0)

    def send_weights(self, version: int) -> int:
        return self.channel.send(self.weights, version)


def weight_sync_section(args, table: Table) -> dict:
    """Seconds per GB of weights from a trainer actor into a serving InferenceEngine actor (received, loaded, version
    reported), through the Ray object store and through the collective channel (Gloo on CPU), same actors."""
    import statistics
    import time

    import ray
    import torch

    from sandforge.models.k3.model import PRESETS, K3Model
    from sandforge.models.policy import policy_config
    from sandforge.rollout.engine import InferenceEngine
    from sandforge.trainer.weight_sync import WeightSync

    policy_cfg = policy_config(K3Model(PRESETS[args.sync_preset]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=1024 * 1024**2)
    try:
        sender = ray.remote(num_cpus=0)(_WeightSender).remote(policy_cfg, 0)
        engine = ray.remote(num_cpus=0)(InferenceEngine).remote(policy_cfg, 4, 64, 0, 1)
        weights = ray.get(sender.get_weights.remote())
        gb = sum(v.numel() * v.element_size() for v in weights.values()) / 1e9
        del weights
        out, version = {}, 0
        for mode in ("object_store", "collective"):
            sync = WeightSync(mode, [sender], engine, gather_all=False)
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
    return {"weight_sync_s_per_gb": {k: round(v, 3) for k, v in out.items()},
            "weight_sync_object_store_vs_collective": round(ratio, 2), "weight_sync_gb": round(gb, 4)}


def _train_rows(vocab: int, n: int, length: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        size = length - 7 * i  # uneven, as episodes are
        rows.append({"token_ids": torch.randint(1, vocab, (size,), generator=g).tolist(),
                     "loss_mask": [0] * 16 + [1] * (size - 16)})
    return rows


def deepspeed_vs_torch_section(args, table: Table) -> dict:
    """Train tokens/s of TrainerRank.train_step (DeepSpeed, ZeRO-2, CPU) over a plain torch loop (AdamW, the same
    micro-batches and gradient accumulation, clipping, loss and bias upkeep) on the same model and batch."""
    import os
    import time

    import torch

    from sandforge.config import TrainerConfig
    from sandforge.models.generate import token_logprobs
    from sandforge.models.policy import after_optimizer_step, build_policy
    from sandforge.trainer.actor import TrainerRank, pad_right, split_micro_batches
    from sandforge.trainer.loop import free_port

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_cfg = {"arch": "k3", "preset": "k3-nano", "k3": {}}
    trainer_cfg = TrainerConfig(grad_accum_steps=2).model_dump() | {"temperature": 1.0, "response_budget": 256}
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), model_cfg, trainer_cfg, None, "bytes", seed=0, num_threads=1)
    torch.manual_seed(0)
    model = build_policy(model_cfg, len(rank.tokenizer))
    model.load_state_dict(rank.engine.module.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=trainer_cfg["lr"], weight_decay=trainer_cfg["weight_decay"])
    rows = _train_rows(len(rank.tokenizer), args.train_rows, args.train_len)
    total = sum(sum(r["loss_mask"]) for r in rows)
    tokens = sum(len(r["token_ids"]) for r in rows)

    def torch_step() -> float:
        model.train()
        step_loss = 0.0
        for micro in split_micro_batches(rows, trainer_cfg["grad_accum_steps"]):
            ids = pad_right([r["token_ids"] for r in micro], 0, torch.long)
            attn = pad_right([[1] * len(r["token_ids"]) for r in micro], 0, torch.long)
            mask = pad_right([r["loss_mask"] for r in micro], 0, torch.float32)
            logprobs, aux = token_logprobs(model, ids, attn)
            loss = -(logprobs * mask).sum() / total  # the SFT loss: token-mean over the whole step's assistant tokens
            (loss + aux).backward()
            step_loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg["grad_clip"])
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


# Sections run in order; each adds rows to the table and returns its JSON keys.
SECTIONS = [weight_sync_section, deepspeed_vs_torch_section]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sync-preset", default="k3-mini", help="model whose weights the weight-sync section pushes")
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--train-rows", type=int, default=16)
    ap.add_argument("--train-len", type=int, default=320)
    ap.add_argument("--train-steps", type=int, default=3)
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
