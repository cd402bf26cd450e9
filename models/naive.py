"""Plain reference implementations the fast paths are tested against. Slow on purpose; never used in a run."""

from __future__ import annotations

import torch
from torch import nn

from .generate import Generation, SamplingParams, _budgets, _eval_mode, sample_next


def generate_naive(
    model: nn.Module, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
) -> list[Generation]:
    """``generate`` without batching or cache: one prompt at a time, the whole sequence recomputed for every token."""
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
