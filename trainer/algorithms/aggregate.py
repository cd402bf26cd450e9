"""How per-token losses become one number, exactly across micro-batches and ranks.

Each micro-batch contributes ``sum(per_token * token_weights(...))``; the weights use *global* counts (over every rank
and micro-batch of the step), so the contributions add up to the formula over the whole batch, not to a mean of
micro-batch means. With N sequences, |o_i| policy tokens in sequence i and per-token losses l_it:

  token-mean            sum_i sum_t l_it / sum_i |o_i|         (DAPO; long answers weigh more)
  seq-mean-token-mean   1/N sum_i (1/|o_i|) sum_t l_it          (the GRPO paper; every answer weighs the same)
  seq-mean-token-sum    1/N sum_i sum_t l_it / L                (Dr.GRPO: a constant L, no length bias)

L is the response budget, ``rollout.max_new_tokens * rollout.max_turns`` (capped by ``rollout.max_context``): the
most policy tokens an episode can have. Being constant across steps and batches, it only rescales the learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class Totals:
    """Counts over the whole step (all ranks, all micro-batches)."""

    tokens: int  # policy (loss-mask) tokens
    sequences: int


def token_weights(mask: torch.Tensor, mode: str, totals: Totals, norm_len: int = 1) -> torch.Tensor:
    """[B, T] weights w with sum(l * w) this micro-batch's share of the aggregated loss; 0 off the mask."""
    mask = mask.float()
    if mode == "token-mean":
        return mask / max(totals.tokens, 1)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        return mask / lengths / max(totals.sequences, 1)
    if mode == "seq-mean-token-sum":
        return mask / (max(totals.sequences, 1) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(MODES)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, totals: Totals,
              norm_len: int = 1) -> torch.Tensor:
    """This micro-batch's share of the aggregated loss."""
    return (per_token * token_weights(mask, mode, totals, norm_len)).sum()
