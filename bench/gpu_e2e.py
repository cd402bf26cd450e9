"""One RL step's GPU work, measured: the engine decoding a batch of 64, the trainer's DeepSpeed step on what it decoded,
and the weight sync between them, for the policy of configs/gpu.yaml (SmolLM2-135M) and for the K3-shaped k3-1b.

    python bench/gpu_e2e.py [--models gpu,k3-1b] [--batch 64] [--prompt 256] [--new-tokens 256] [--peak-tflops 989]

Last line: one JSON object, per model:

- ``engine_decode_tokens_per_s``: sandforge's engine (continuous batching, bf16) at batch ``--batch``, and
  ``baseline_decode_tokens_per_s`` for the same model and batch under Hugging Face ``generate`` (HF policy) or
  ``engine/naive.py`` (K3), run in this script: ``engine_vs_baseline`` is their ratio;
- ``train_tokens_per_s`` and ``train_mfu``: one DeepSpeed step (bf16, fp32 master weights, ZeRO-2) of a trainer rank
  on the decoded sequences, MFU being 6 FLOPs per active parameter per token (plus causal attention for K3) over the
  chip's dense bf16 peak (``--peak-tflops``: 989 for an H200 SXM by the datasheet). With LoRA (the gpu policy) that
  overstates the work done, as the backward stops below the adapted layers: read its MFU as an upper bound;
- ``weight_sync_s_per_gb``: the colocated path (the engine copies the rank's GPU tensors straight into its own; here
  in one process, so without the IPC handles the Ray actors exchange) and the CPU round trip the object store makes;
- ``rl_step_s``: decode + train step + colocated sync; ``gpu_mem_peak_gb``: the most GPU memory allocated.

Sandboxes are left out (the GPU machine has no Docker): this is the step's GPU work, not its environment time. Neither
Ray nor Docker is needed; DeepSpeed is. Without the real SmolLM2 weights (``--hf-dir``: a directory with config.json
and the tokenizer files) the HF policy is built from its config with random weights: the same shapes, the same work.
``--device cpu --models k3-nano`` runs the whole script on a CPU in a minute (a smoke run, no meaningful numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from sandforge.config import EngineConfig, ModelConfig, TrainerConfig
from sandforge.engine import EngineActor
from sandforge.engine.naive import generate_batch_naive
from sandforge.job.fleet.lifecycle import free_port
from sandforge.models.lora import adapter_weights
from sandforge.models.sampling import SamplingParams
from sandforge.trainer.rank import RolloutShape, TrainerRank
from sandforge.types import GenerateRequest, Sample, TrainingRow

SMOLLM2 = Path.home() / ".cache/sandforge/models/catalog/smollm2-135m"


def hf_shape_dir(source: Path, out: Path) -> Path:
    """A loadable HF directory with ``source``'s config and tokenizer: its own weights when it has them, else random
    ones of the same shapes (written once into ``out``)."""
    if (source / "model.safetensors").is_file():
        return source
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    model.save_pretrained(out)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def model_config(name: str, hf_dir: Path, scratch: Path) -> ModelConfig:
    if name == "gpu":  # configs/gpu.yaml's policy, adapted like the quickstart's (LoRA on the top layers)
        path = hf_shape_dir(hf_dir, scratch / "smollm2-shape")
        return ModelConfig(arch="hf", path=str(path), lora={"r": 16, "alpha": 32, "top_layers": 10})
    return ModelConfig(arch="k3", preset=name, tokenizer="bytes")


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token passes through: embeddings out, routed experts at top_k / n_experts."""
    from sandforge.models.k3.latent_moe import LatentMoE

    total = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    for module in model.modules():
        if isinstance(module, LatentMoE):
            routed = sum(p.numel() for p in module.experts.parameters())
            total -= routed * (1 - module.top_k / module.n_experts)
    return int(total)


def step_flops(model: torch.nn.Module, lengths: list[int]) -> float:
    flops = 6.0 * active_parameters(model) * sum(lengths)
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "layer_kinds"):  # K3: causal attention in its MLA layers
        flops += sum(6.0 * cfg.layer_kinds.count("mla") * n * n * cfg.n_heads * cfg.head_dim for n in lengths)
    return flops


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def decode(engine: EngineActor, prompts: list[list[int]], new_tokens: int) -> list[Sample]:
    async def run():
        try:
            reqs = [GenerateRequest(prompt_ids=p, session_id=f"s{i}", max_tokens=new_tokens, temperature=1.0, seed=i)
                    for i, p in enumerate(prompts)]
            return [r[0] for r in await asyncio.gather(*(engine.generate(r) for r in reqs))]
        finally:
            await engine.core.shutdown()

    return asyncio.run(run())


def baseline_decode(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    """The same batch through Hugging Face ``generate`` (an HF policy) or ``engine/naive.py`` (K3)."""
    hf = getattr(model, "model", None)
    with torch.inference_mode():
        if hf is not None and hasattr(hf, "generate"):
            ids = torch.tensor(prompts, device=next(model.parameters()).device)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        do_sample=True, pad_token_id=0)
        else:
            generate_batch_naive(model, prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0))


def gb(state: dict) -> float:
    return sum(v.numel() * v.element_size() for v in state.values()) / 1e9


def measure(name: str, args, scratch: Path) -> dict:
    device = torch.device(args.device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    model = model_config(name, Path(args.hf_dir), scratch)
    trainer = TrainerConfig(lr=1e-5, zero_stage=2, grad_accum_steps=args.grad_accum, bf16=kind == "cuda",
                            log_kl=False, device=kind)
    rank = TrainerRank(0, 1, "127.0.0.1", free_port(), model, trainer, RolloutShape(1.0, args.new_tokens),
                       seed=0, num_threads=os.cpu_count() or 1, device=kind)
    config = rank.model_config_dict()
    engine = EngineActor(config, EngineConfig(max_batch_size=args.batch, session_memory_mb=4096,
                                                  dtype="bfloat16" if kind == "cuda" else "float32"),
                             0, os.cpu_count() or 1, kind)
    g = torch.Generator().manual_seed(0)
    vocab = min(rank.engine.module.config.vocab_size, 30000)
    prompts = [torch.randint(10, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]

    # weight sync: the engine takes the rank's weights, first over CPU (what the object store does), then straight
    # from the rank's GPU tensors (the colocated path; across processes the same copy runs through IPC handles)
    weights, cpu_s = timed(lambda: rank.get_weights(), device)
    _, load_s = timed(lambda: asyncio.run(engine.load_weights(weights, 0)), device)
    size = gb(weights)
    module = rank.engine.module
    shared = {k: v.detach() for k, v in (adapter_weights(module) if rank.lora else module.state_dict()).items()}
    _, direct_s = timed(lambda: asyncio.run(engine.load_weights(shared, 1)), device)

    decode(engine, prompts[:2], 4)  # warm-up: kernels, allocator
    samples, decode_s = timed(lambda: decode(engine, prompts, args.new_tokens), device)
    decoded = sum(len(s.token_ids) for s in samples)
    baseline_decode(engine.core.model, prompts[:2], 4)
    _, base_s = timed(lambda: baseline_decode(engine.core.model, prompts, args.new_tokens), device)

    rows = [TrainingRow(token_ids=p + s.token_ids, loss_mask=[0] * len(p) + [1] * len(s.token_ids),
                        logprobs=[0.0] * len(p) + s.logprobs,
                        advantages=[float(i % 2) - 0.5] * (len(p) + len(s.token_ids)))
            for i, (p, s) in enumerate(zip(prompts, samples))]
    loss_tokens = sum(sum(r.loss_mask) for r in rows)
    rank.train_step(rows[:2], sum(sum(r.loss_mask) for r in rows[:2]))  # warm-up step
    _, train_s = timed(lambda: rank.train_step(rows, loss_tokens), device)
    lengths = [len(r.token_ids) for r in rows]
    flops = step_flops(rank.engine.module, lengths)
    out = {
        "engine_decode_tokens_per_s": round(decoded / decode_s, 1),
        "baseline_decode_tokens_per_s": round(args.batch * args.new_tokens / base_s, 1),
        "train_tokens_per_s": round(sum(lengths) / train_s, 1),
        "train_mfu": round(flops / train_s / (args.peak_tflops * 1e12), 4),
        "weight_sync_s_per_gb": {"colocated": round(direct_s / size, 4), "cpu_round_trip": round((cpu_s + load_s) / size, 4)},
        "weight_sync_gb": round(size, 4),
        "rl_step_s": round(decode_s + train_s + direct_s, 3),
        "gpu_mem_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None,
    }
    out["engine_vs_baseline"] = round(out["engine_decode_tokens_per_s"] / out["baseline_decode_tokens_per_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpu,k3-1b", help="gpu (configs/gpu.yaml's SmolLM2) and/or K3 presets")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--hf-dir", default=str(SMOLLM2), help="SmolLM2's directory, or its config and tokenizer alone")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_e2e.py: no CUDA device here (--device cpu for a smoke run)")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "batch": args.batch,
              "peak_tflops": args.peak_tflops}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            print(f"measuring {name} ...", flush=True)
            result[name] = measure(name, args, Path(scratch))
            print(json.dumps({name: result[name]}), flush=True)
            gc.collect()  # the model's rank and engine go before the next model is measured
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
