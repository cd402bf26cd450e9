"""The plain references the engine is tested against (flash-linear-attention's ``naive.py`` convention: each fast path's
reference sits in a ``naive.py`` beside it and is named ``<what>_naive``). Slow on purpose; never used in a run.

``generate_naive``: one prompt at a time, no cache, the whole sequence recomputed for every token.
``generate_batch_naive``: a static left-padded batch with a cache. ``EngineCore`` must agree with both.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from sandforge.models.sampling import SamplingParams, sample_next


@dataclass
class Generation:
    token_ids: list[int]  # includes the stop id when finish_reason == "stop"
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def _budgets(model: nn.Module, prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """New tokens each prompt may get: max_new_tokens, capped by the model's context length (``config.max_seq_len``)."""
    max_len = getattr(getattr(model, "config", None), "max_seq_len", None) or float("inf")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; render it with ChatFormat.render_prompt (it starts with <|bos|>)")
        if len(p) >= max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the model's max_seq_len is {max_len}")
    return [int(min(params.max_new_tokens, max_len - len(p))) for p in prompts]


@contextmanager
def _eval_mode(model: nn.Module):
    """Run in eval mode and restore the caller's train/eval state afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def generate_batch_naive(
    model: nn.Module, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
) -> list[Generation]:
    """A static batch: every prompt left-padded, one prefill, then one cached decode step per token until all stop.
    The reference for the engine's continuous batching (``EngineCore``), and the baseline its benchmarks beat."""
    budgets = _budgets(model, prompts, params)
    out = [Generation([], [], "length") for _ in prompts]
    if not prompts or max(budgets) <= 0:
        return out
    device = next(model.parameters()).device
    stop = torch.tensor(list(params.stop_ids), dtype=torch.long, device=device)

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1

    with torch.inference_mode(), _eval_mode(model):
        res = model(ids, attention_mask=mask, use_cache=True)
        logits, cache = res.logits[:, -1], res.cache  # left padding: the last column is every row's last token
        rows = torch.arange(len(prompts), device=device)  # batch row -> prompt index, unfinished rows only
        while True:
            tokens, logprobs = sample_next(logits, params, generator)
            done = torch.isin(tokens, stop)
            for r, (i, t, lp, d) in enumerate(zip(rows.tolist(), tokens.tolist(), logprobs.tolist(), done.tolist())):
                out[i].token_ids.append(t)
                out[i].logprobs.append(lp)
                if d:
                    out[i].finish_reason = "stop"
                elif len(out[i].token_ids) >= budgets[i]:
                    done[r] = True
            if done.all():
                return out
            if done.any():
                keep = (~done).nonzero().squeeze(-1)
                rows, tokens, cache = rows[keep], tokens[keep], cache.select(keep)
            res = model(tokens[:, None], attention_mask=torch.ones_like(tokens[:, None]), cache=cache, use_cache=True)
            logits, cache = res.logits[:, -1], res.cache



def generate_naive(
    model: nn.Module, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
) -> list[Generation]:
    """``generate_batch_naive`` without batching or cache: one prompt at a time, the whole sequence recomputed for every token."""
    budgets = _budgets(model, prompts, params)
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode(), _eval_mode(model):
        for prompt, budget in zip(prompts, budgets):
            gen = Generation([], [], "length")
            seq = list(prompt)
            while len(gen.token_ids) < budget:
                logits = model(torch.tensor([seq], device=device)).logits[:, -1]
                token, logprob = sample_next(logits, params, generator)
                gen.token_ids.append(token.item())
                gen.logprobs.append(logprob.item())
                seq.append(token.item())
                if token.item() in params.stop_ids:
                    gen.finish_reason = "stop"
                    break
            out.append(gen)
    return out
