"""The engine's decode step against the machine's roofline, the fused path (``engine.decoder: auto``) beside the
policy's own forward (``engine.decoder: model``, the engine before it) in the same run.

    python bench/engine.py [--models smollm2-135m,k3-nano] [--batches 1,8,24,64] [--context 1024] [--new-tokens 32]
                           [--rounds 2] [--threads 0] [--dtype auto]

Measured in this run, round by round (the machines this runs on are shared, and their memory bandwidth moves by a
factor of 1.5 within minutes, so each round measures the machine right before its decodes):

- the machine: memory bandwidth as a large copy (bytes read plus written per second), a bf16 and an fp32 GEMM;
- per model and batch B: decode tokens/s, the B rows each at ``--context`` cached tokens, timed over the decode steps
  that ran all B rows (a seeded sample per row, so rows differ); both engines are ``EngineCore``;
- the roofline of that step: bytes = the weights a step reads (every parameter, the input embedding only where the
  output layer shares it) plus each row's cache (its bytes measured from a prefill), at the measured bandwidth;
  FLOPs = 2 x the multiplied parameters x B plus attention's 4 x context x heads x head_dim per layer and row, at the
  measured GEMM rate; the roofline is the slower of the two, and ``decode_vs_roofline_bB`` is the engine's tokens/s
  over the roofline's;
- for the first model, where it is a Hugging Face one: transformers' own ``generate`` (greedy, one batch of 24) decode
  tokens/s, ``decode_vs_hf_generate``; and the sampled tokens' log-probs against a full forward of the policy (what
  the trainer recomputes): mean |difference| for each engine (``mismatch_old``, ``mismatch_new``).

Prints a table, then as the last line a JSON object; the first model's keys are unsuffixed (``decode_vs_roofline_b24``),
the others' end in their name (``decode_vs_roofline_b24_k3``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from sandforge.engine import EngineCore  # noqa: E402
from sandforge.engine.batch import Prefill  # noqa: E402
from sandforge.types import GenerateRequest  # noqa: E402

ENGINES = {"old": "model", "new": "auto"}


def cpu_model() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"cpu": name, "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "cores": torch.get_num_threads()}


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def machine() -> dict:
    """Copy bandwidth (bytes read + written per second) and GEMM FLOP/s, now."""
    a = torch.ones(256 * 2**20 // 4)
    b = torch.empty_like(a)
    bandwidth = 2 * a.nbytes / timed(lambda: b.copy_(a), 8)
    out = {"bandwidth_gb_s": bandwidth / 1e9}
    for dtype in (torch.bfloat16, torch.float32):
        x, y = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        out[f"gemm_{str(dtype).split('.')[1]}_gflop_s"] = 2 * 2048**3 / timed(lambda: x @ y, 4) / 1e9
    return out


class TimedEngine(EngineCore):
    """``EngineCore`` that times its decode steps that run ``full`` rows."""

    full = 0
    seconds = 0.0
    rows = 0

    def _decode(self) -> None:
        if len(self.batch) != self.full:
            return super()._decode()
        start = time.perf_counter()
        super()._decode()
        self.seconds += time.perf_counter() - start
        self.rows += self.full


def load(name: str, dtype: torch.dtype):
    if name.startswith("k3"):
        from sandforge.models.k3.model import PRESETS, K3Model

        torch.manual_seed(0)
        return K3Model(PRESETS[name]).to(dtype).eval()
    from sandforge.models.hf import HFPolicy
    from sandforge.models.sources import local_model_dir

    return HFPolicy.from_pretrained(str(local_model_dir(name, announce=lambda _: None))).to(dtype).eval()


def decode_run(model, kind: str, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, list]:
    """Decode tokens/s of ``batch`` rows after ``prompt``, and the samples."""

    async def main():
        engine = TimedEngine(model, max_batch_size=batch, seed=0, decoder=kind, session_memory_mb=1,
                             max_prefill_tokens=max(4096, len(prompt)))
        engine.full = batch
        try:
            requests = [GenerateRequest(prompt_ids=prompt, max_tokens=new_tokens, temperature=1.0, seed=i)
                        for i in range(batch)]
            samples = await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.shutdown()
        return engine.rows / max(engine.seconds, 1e-9), [s[0] for s in samples]

    return asyncio.run(main())


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, the input embedding only where it is also the
    output layer (otherwise a step reads B of its rows)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    embed = model.model.get_input_embeddings().weight if hasattr(model, "hf_config") else model.embed.weight
    output = model.model.get_output_embeddings().weight if hasattr(model, "hf_config") else (
        model.embed.weight if model.lm_head is None else model.lm_head.weight)
    total = sum(p.nbytes for p in params.values())
    return total if embed.data_ptr() == output.data_ptr() else total - embed.nbytes


def multiplied_params(model) -> int:
    embed = model.model.get_input_embeddings().weight if hasattr(model, "hf_config") else model.embed.weight
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    tied = any(p.data_ptr() == embed.data_ptr() for p in params.values()) and weight_bytes(model) == sum(
        p.nbytes for p in params.values())
    return total if tied else total - embed.numel()


def cache_bytes(model, prompt: list[int]) -> int:
    """One row's cache after ``prompt``, as the engine keeps it (the model's own forward)."""
    from sandforge.engine.decoders import ModelDecoder

    item = Prefill(None, prompt)
    with torch.inference_mode():
        ModelDecoder(model, torch.device("cpu")).prefill([item])
    return item.out_cache.select([0]).compact().nbytes


def attention_flops(model, context: int) -> int:
    """4 x context x heads x head_dim per layer (scores and the weighted sum) for one row's step."""
    c = getattr(model, "hf_config", None) or model.config
    heads = getattr(c, "num_attention_heads", None) or c.n_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    layers = getattr(c, "num_hidden_layers", None) or c.n_layers
    return 4 * context * heads * head_dim * layers


def roofline(model, batch: int, row_cache: int, context: int, gemm: float, bandwidth: float) -> float:
    """The step's bound in tokens/s: the slower of reading its bytes and computing its FLOPs."""
    flops = batch * (2 * multiplied_params(model) + attention_flops(model, context))
    seconds = max((weight_bytes(model) + batch * row_cache) / bandwidth, flops / gemm)
    return batch / seconds


def hf_generate(model, prompt: list[int], batch: int, new_tokens: int) -> float:
    """transformers' ``generate`` decode tokens/s: (generate n tokens - generate 1) / (n - 1) steps."""
    ids = torch.tensor([prompt] * batch)
    hf = model.model

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    return batch * (new_tokens - 1) / max(run(new_tokens) - run(1), 1e-9)


def mismatch(model, prompt: list[int], samples: list) -> float:
    """Mean |engine log-prob - full forward log-prob| over the sampled tokens (temperature 1, as sampled)."""
    from sandforge.models.sampling import token_logprobs

    diffs = []
    with torch.inference_mode():
        for sample in samples:
            seq = torch.tensor([prompt + sample.token_ids])
            logprobs, _ = token_logprobs(model, seq, torch.ones_like(seq))
            ref = logprobs[0, len(prompt):].tolist()
            diffs += [abs(a - b) for a, b in zip(sample.logprobs, ref)]
    return sum(diffs) / len(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,k3-nano")
    parser.add_argument("--batches", default="1,8,24,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: one per core")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    from sandforge.models.device import engine_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, engine_dtype(args.dtype, "cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    result: dict = cpu_model() | {"dtype": str(dtype).split(".")[1], "context": args.context}
    console = Console()
    table = Table(title=f"engine decode, {result['cpu']} ({result['cores']} threads), {result['dtype']}, "
                        f"context {args.context}")
    for col in ("model", "batch", "old tok/s", "new tok/s", "new / old", "roofline tok/s", "new / roofline"):
        table.add_column(col, justify="right")
    for index, name in enumerate(args.models.split(",")):
        model = load(name, dtype)
        vocab = model.config.vocab_size
        prompt = torch.randint(1, vocab, (args.context,), generator=gen).tolist()
        short = Path(name).name.split("-")[0]
        suffix = "" if index == 0 else f"_{short}"  # the first model's keys are unsuffixed
        hf = hasattr(model, "hf_config")
        row_cache = cache_bytes(model, prompt)
        for batch in batches:
            runs: dict[str, list[float]] = {"old": [], "new": [], "roof": []}
            for _ in range(args.rounds):
                m = machine()
                gemm = m["gemm_bfloat16_gflop_s" if dtype == torch.bfloat16 else "gemm_float32_gflop_s"] * 1e9
                runs["roof"].append(roofline(model, batch, row_cache, args.context, gemm,
                                             m["bandwidth_gb_s"] * 1e9))
                for label, kind in ENGINES.items():
                    tps, samples = decode_run(model, kind, prompt, batch, args.new_tokens)
                    runs[label].append(tps)
                    if index == 0 and hf and batch == min(max(batches), 8) and _ == 0:
                        result[f"mismatch_{label}"] = round(mismatch(model, prompt, samples), 5)
                result.setdefault("machine", []).append({k: round(v, 1) for k, v in m.items()})
            old, new, roof = (statistics.median(runs[k]) for k in ("old", "new", "roof"))
            result[f"{short}_b{batch}"] = {"old_tok_s": round(old, 1), "new_tok_s": round(new, 1),
                                           "roofline_tok_s": round(roof, 1),
                                           "new_vs_old": round(new / old, 2), "rounds": args.rounds}
            result[f"decode_vs_roofline_b{batch}{suffix}"] = round(new / roof, 3)
            result[f"old_vs_roofline_b{batch}{suffix}"] = round(old / roof, 3)
            table.add_row(name, str(batch), f"{old:,.0f}", f"{new:,.0f}", f"{new / old:.2f}x", f"{roof:,.0f}",
                          f"{new / roof:.2f}")
        if index == 0 and hf and 24 in batches:
            generate = hf_generate(model, prompt, 24, args.new_tokens)
            new24 = result[f"{short}_b24"]["new_tok_s"]
            result["hf_generate_b24_tok_s"] = round(generate, 1)
            result["decode_vs_hf_generate"] = round(new24 / generate, 2)
            table.add_row(name, "24", f"HF generate {generate:,.0f}", "", f"{new24 / generate:.2f}x", "", "")
    console.print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
