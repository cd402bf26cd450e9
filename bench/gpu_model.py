"""Training-step throughput of a K3 preset on one GPU in bf16: tokens/s and model FLOPs utilisation (MFU).

    python bench/gpu_model.py [--preset k3-1b] [--batch 4] [--seq 2048] [--steps 8] [--peak-tflops 989]

One step = forward, next-token cross-entropy, backward, AdamW step, LatentMoE bias update (Quantile Balancing). MFU counts
6 FLOPs per active parameter per token (routed experts at top_k / n_experts, embeddings excluded) plus causal attention
in the MLA layers, against the chip's dense bf16 peak (989 TFLOP/s for an H200 SXM by the datasheet). The baseline, run
in the same script on the same model: the same steps with the routed experts as their reference loop
(``experts_naive``, ``LatentMoE.grouped_mm = False``) instead of grouped GEMMs; ``grouped_vs_loop`` is its step time
over the grouped one's, the steps of the two alternated. Runs from a bare checkout too (the model code only needs
torch), so a lent GPU machine needs no install. ``--device cpu --preset k3-nano`` is a smoke run (no meaningful
numbers). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from sandforge.models.k3.latent_moe import LatentMoE, update_all_biases
    from sandforge.models.k3.model import PRESETS, K3Model, count_parameters
except ImportError:  # a bare checkout: the repository root holds models/ as a plain package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models.k3.latent_moe import LatentMoE, update_all_biases
    from models.k3.model import PRESETS, K3Model, count_parameters


def active_parameters(model: K3Model) -> int:
    """Parameters a token passes through: everything but the embedding, routed experts at top_k / n_experts."""
    total = count_parameters(model) - model.embed.weight.numel()
    for module in model.modules():
        if isinstance(module, LatentMoE):
            routed = sum(p.numel() for p in module.experts.parameters())
            total -= routed * (1 - module.top_k / module.n_experts)
    return int(total)


def step_flops(model: K3Model, batch: int, seq: int) -> float:
    cfg = model.config
    tokens = batch * seq
    dense = 6 * active_parameters(model) * tokens
    n_mla = cfg.layer_kinds.count("mla")
    attention = 6 * n_mla * batch * seq * seq * cfg.n_heads * cfg.head_dim  # QK^T and AV, causal half, fwd + bwd
    return dense + attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-1b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_model.py: no CUDA device here (--device cpu --preset k3-nano for a smoke run)")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    model = K3Model(cfg).to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def set_grouped(on: bool) -> None:  # the routed experts as grouped GEMMs, or as the reference loop over experts
        for module in model.modules():
            if isinstance(module, LatentMoE):
                module.grouped_mm = on

    def step() -> float:
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=gen)
        logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_all_biases(model)
        return loss.item()  # syncs

    def timed_step() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()  # .item() syncs
        return loss, time.perf_counter() - t0

    losses = []
    for grouped in (True, False):  # warm-up, both paths
        set_grouped(grouped)
        losses += [step() for _ in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.steps):  # alternated, so a noisy neighbour slows both alike
        for grouped in (True, False):
            set_grouped(grouped)
            loss, t = timed_step()
            times[grouped].append(t)
            losses.append(loss)
        print(f"step {i + 1}/{args.steps}  loss {losses[-1]:.3f}  grouped {times[True][-1] * 1e3:.1f} ms  "
              f"loop {times[False][-1] * 1e3:.1f} ms", flush=True)
    seconds = sum(times[True]) / args.steps
    baseline_seconds = sum(times[False]) / args.steps

    tokens_per_s = args.batch * args.seq / seconds
    achieved = step_flops(model, args.batch, args.seq) / seconds
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "batch": args.batch,
        "seq": args.seq,
        "total_params": count_parameters(model),
        "active_params": active_parameters(model),
        "step_ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(tokens_per_s, 1),
        "baseline_step_ms": round(baseline_seconds * 1e3, 1),
        "grouped_vs_loop": round(baseline_seconds / seconds, 3),
        "tflops": round(achieved / 1e12, 2),
        "mfu": round(achieved / (args.peak_tflops * 1e12), 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
    }
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
