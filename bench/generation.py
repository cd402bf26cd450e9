"""Batched KV-cache generation vs the naive reference (one prompt at a time, full recompute per token).

    python bench/generation.py [--prompts 8] [--prompt-len 200] [--new-tokens 64] [--threads 1]

Both references of engine/naive.py run in this process on the same model and prompts, with greedy decoding, so the
printed ratio is robust to a noisy machine and the outputs can be checked for equality: ``generate_batch_naive`` (one
left-padded batch, a KV cache) against ``generate_naive`` (one prompt at a time, the whole sequence recomputed per
token). Last line: one JSON object, ``batched_vs_naive`` (naive time / batched time) first.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sandforge.engine.naive import generate_batch_naive, generate_naive
from sandforge.models.k3.model import PRESETS, K3Model, count_parameters
from sandforge.models.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="k3-nano", choices=sorted(PRESETS))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = K3Model(PRESETS[args.preset]).eval()
    rng = torch.Generator().manual_seed(args.seed)
    # lengths vary around prompt_len so the batch needs left padding, as in a real rollout
    lengths = torch.randint(args.prompt_len * 3 // 4, args.prompt_len * 5 // 4 + 1, (args.prompts,), generator=rng)
    prompts = [torch.randint(0, 256, (int(n),), generator=rng).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    print(
        f"model {args.preset} {count_parameters(model) / 1e6:.2f}M params, {args.prompts} prompts of {min(lengths)}-{max(lengths)} "
        f"tokens, {args.new_tokens} new tokens each, {args.threads} thread(s)"
    )

    generate_batch_naive(model, prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    batched = generate_batch_naive(model, prompts, params)
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    naive = generate_naive(model, prompts, params)
    t_naive = time.perf_counter() - t0

    n_tokens = sum(len(g.token_ids) for g in batched)
    same = [g.token_ids for g in batched] == [g.token_ids for g in naive]
    print(f"naive (no batch, no cache): {t_naive:7.2f} s  {n_tokens / t_naive:8.1f} tok/s")
    print(f"batched + KV cache:         {t_batched:7.2f} s  {n_tokens / t_batched:8.1f} tok/s")
    print(f"speed-up: {t_naive / t_batched:.1f}x   identical greedy outputs: {same}")
    print(json.dumps({"batched_vs_naive": round(t_naive / t_batched, 2), "identical_greedy_outputs": same,
                      "batched_tokens_per_s": round(n_tokens / t_batched, 1),
                      "naive_tokens_per_s": round(n_tokens / t_naive, 1), "preset": args.preset,
                      "prompts": args.prompts, "new_tokens": args.new_tokens}))


if __name__ == "__main__":
    main()
