"""Per-token policy losses. Shapes: B sequences, T tokens; ``mask`` is the loss mask (1 on policy tokens).

Every loss returns ``PolicyLoss``: the per-token loss (aggregated by the caller, see aggregate.py), the importance ratio
it used and where its clip acted. ``old_logprobs`` are the log-probs of the policy that the update starts from.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PolicyLoss(NamedTuple):
    per_token: Tensor  # [B, T]
    ratio: Tensor  # [B, T] detached; GSPO's sequence ratio repeated over the sequence's tokens
    clipped_low: Tensor  # [B, T] bool: the clip acted below 1 - eps_low
    clipped_high: Tensor  # [B, T] bool: the clip acted above 1 + eps_high


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> PolicyLoss:
    """-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A). The clip acts (and removes the token's gradient) only where
    it is the pessimistic choice: rho > 1 + eps_high with A > 0, or rho < 1 - eps_low with A < 0."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    r = ratio.detach()
    return PolicyLoss(
        per_token=-torch.minimum(unclipped, clipped),
        ratio=r,
        clipped_low=(advantages < 0) & (r < 1 - eps_low),
        clipped_high=(advantages > 0) & (r > 1 + eps_high),
    )


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  eps_low: float, eps_high: float) -> PolicyLoss:
    """PPO / GRPO token-level clipped surrogate; eps_high > eps_low is DAPO's clip-higher."""
    return _clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, eps_low, eps_high)


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              eps_low: float, eps_high: float) -> PolicyLoss:
    """GSPO: one ratio per sequence, s_i = exp(mean over its policy tokens of (logp - old)) (the geometric mean of the
    token ratios), clipped at the sequence level. Each policy token carries the sequence's loss, so seq-mean-token-mean
    aggregation gives GSPO's 1/N sum_i min(s_i A_i, clip(s_i) A_i) exactly."""
    mask = mask.float()
    log_s = ((logprobs - old_logprobs) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    return _clipped_surrogate(torch.exp(log_s)[:, None].expand_as(logprobs), advantages, eps_low, eps_high)


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               eps_low: float, eps_high: float) -> PolicyLoss:
    """CISPO (MiniMax-M1): the gradient is sg(clip(rho, 1 - eps_low, 1 + eps_high)) A grad(logp). The weight is
    clipped, never the token: a token far off-policy still gets a (bounded) gradient.

    Written as -w A exp(logp - sg(logp)): the same gradient, and a value (-w A) comparable with PPO's loss."""
    r = torch.exp(logprobs - old_logprobs).detach()
    weight = torch.clamp(r, 1 - eps_low, 1 + eps_high)
    return PolicyLoss(
        per_token=-weight * advantages * torch.exp(logprobs - logprobs.detach()),
        ratio=r,
        clipped_low=r < 1 - eps_low,
        clipped_high=r > 1 + eps_high,
    )


def value_loss(values: Tensor, returns: Tensor) -> Tensor:
    """PPO's critic: 0.5 (V - R)^2 per token."""
    return 0.5 * (values - returns) ** 2
