"""K3 model benchmarks on CPU: chunked KDA vs its token-by-token reference (same process, same inputs), KDA layer
prefill/decode throughput, and whole-model forward tokens/s for the k3-nano and k3-mini presets.

    python bench/model.py [--T 4096] [--heads 4] [--dim 64] [--threads 2] [--repeats 3] [--model-len 512]

Prints a table, then as the last line a JSON object: kda_chunked_vs_recurrent (recurrent time / chunked time, fp32),
kda_max_err (max abs output difference between the two), and k3_nano/k3_mini forward tokens/s.
Each timing is the best of --repeats runs, interleaved, because these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sandforge.models.k3.kda import KDA, kda_chunked
from sandforge.models.k3.naive import kda_naive
from sandforge.models.k3.model import PRESETS, K3Model


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="head_k = head_v")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-len", type=int, default=512, help="tokens per sequence of the whole-model forwards (4 rows)")
    args = ap.parse_args()

    torch.set_num_threads(min(args.threads, 2))
    torch.manual_seed(0)
    B, T, H, K = args.batch, args.T, args.heads, args.dim
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, K)
    # decays as the KDA layer makes them at initialisation: g = g_min * sigmoid(z), g_min = -5, z around dt_bias
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K) - 4.0)
    g_strong = -5.0 * torch.rand(B, T, H, K)  # stress case: every channel anywhere in [g_min, 0]
    beta = torch.rand(B, T, H)

    layer = KDA(d_model=H * K, n_heads=H, head_k=K, head_v=K).eval()
    x = torch.randn(1, 1024, H * K)
    chunked_t, recurrent_t, strong_t = [], [], []
    with torch.no_grad(), Progress(transient=True) as progress:
        task = progress.add_task("KDA chunked vs recurrent", total=args.repeats + 2)
        kda_chunked(q[:, :256], k[:, :256], v[:, :256], g[:, :256], beta[:, :256])  # warm-up
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            chunked_t.append(best_time(lambda: kda_chunked(q, k, v, g, beta, chunk_size=args.chunk), 5))
            strong_t.append(best_time(lambda: kda_chunked(q, k, v, g_strong, beta, chunk_size=args.chunk), 3))
            recurrent_t.append(best_time(lambda: kda_naive(q, k, v, g, beta), 1))
            progress.advance(task)
        o_ref, _ = kda_naive(q, k, v, g, beta)
        o, _ = kda_chunked(q, k, v, g, beta, chunk_size=args.chunk)
        max_err = (o - o_ref).abs().max().item()
        o_ref, _ = kda_naive(q, k, v, g_strong, beta)
        o, _ = kda_chunked(q, k, v, g_strong, beta, chunk_size=args.chunk)
        max_err = max(max_err, (o - o_ref).abs().max().item())
        progress.advance(task)
        prefill_t = best_time(lambda: layer(x), args.repeats)
        _, cache = layer(x[:, :512], use_cache=True)
        n_decode = 128
        step = x[:, :1]

        def decode():
            c = cache
            for _ in range(n_decode):
                _, c = layer(step, cache=c, use_cache=True)

        decode_t = best_time(decode, args.repeats)
        progress.advance(task)

    t_c, t_r, t_s = min(chunked_t), min(recurrent_t), min(strong_t)
    ratio = t_r / t_c
    table = Table(title=f"KDA, fp32 CPU, {torch.get_num_threads()} threads (B={B}, T={T}, H={H}, K=V={K})")
    table.add_column("what")
    table.add_column("time", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_row("kda_naive (reference)", f"{t_r * 1e3:.1f} ms", f"{B * T / t_r:,.0f}")
    table.add_row(f"kda_chunked (chunk {args.chunk})", f"{t_c * 1e3:.1f} ms", f"{B * T / t_c:,.0f}")
    table.add_row("speed-up (recurrent / chunked)", f"{ratio:.1f}x", "")
    table.add_row("kda_chunked, strong decay g ~ U[-5, 0]", f"{t_s * 1e3:.1f} ms", f"{B * T / t_s:,.0f}")
    table.add_row("speed-up, strong decay", f"{t_r / t_s:.1f}x", "")
    table.add_row("max abs error (both decay cases)", f"{max_err:.2e}", "")
    table.add_row(f"KDA layer prefill (d_model {H * K}, 1024 tokens)", f"{prefill_t * 1e3:.1f} ms", f"{1024 / prefill_t:,.0f}")
    table.add_row(f"KDA layer decode ({n_decode} steps)", f"{decode_t * 1e3:.1f} ms", f"{n_decode / decode_t:,.0f}")
    model_tps = {}
    for name in ("k3-nano", "k3-mini"):
        torch.manual_seed(0)
        model = K3Model(PRESETS[name]).eval()
        ids = torch.randint(0, PRESETS[name].vocab_size, (4, args.model_len))
        with torch.inference_mode():
            t_m = best_time(lambda: model(ids), args.repeats)
        model_tps[name] = ids.numel() / t_m
        table.add_row(f"{name} forward (4 x {args.model_len} tokens)", f"{t_m * 1e3:.1f} ms", f"{model_tps[name]:,.0f}")
    Console().print(table)

    result = {
        "kda_chunked_vs_recurrent": round(ratio, 2),
        "kda_max_err": max_err,
        "kda_chunked_ms": round(t_c * 1e3, 2),
        "kda_naive_ms": round(t_r * 1e3, 2),
        "kda_chunked_vs_recurrent_strong_decay": round(t_r / t_s, 2),
        "kda_layer_prefill_tokens_per_s": round(1024 / prefill_t, 1),
        "kda_layer_decode_tokens_per_s": round(n_decode / decode_t, 1),
        "k3_nano_tokens_per_s": round(model_tps["k3-nano"], 1),
        "k3_mini_tokens_per_s": round(model_tps["k3-mini"], 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
