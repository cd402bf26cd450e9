"""GRPO: group-relative advantages and the clipped policy-gradient loss, as plain functions.

Shapes: B sequences, T tokens. ``mask`` is the loss mask (1 on policy-generated tokens only). Losses are returned as
*sums* over masked tokens so the caller can normalise by the token count of the whole global batch (token-mean across
micro-batches and ranks, not a mean of micro-batch means).
"""

from __future__ import annotations

from collections import defaultdict

import torch


def group_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6, scale: bool = True) -> list[float]:
    """A_i = (r_i - mean(group)) / (std(group) + eps). A group of identical rewards gives zero advantage."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in members.values():
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        centred = r - r.mean()
        if scale and len(idx) > 1:
            centred = centred / (r.std(unbiased=False) + eps)
        for i, a in zip(idx, centred.tolist()):
            adv[i] = a
    return adv


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy; always >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_token_losses(
    logprobs: torch.Tensor,  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor,  # [B, T] the engine's log-probs at sampling time
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] float, 1 on policy tokens
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over masked tokens of -min(ρA, clip(ρ, 1±ε)A) (+ kl_coef·KL), and summed statistics."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {
        "clipped": ((unclipped != clipped).float() * mask).sum().detach(),
        "ratio": (ratio * mask).sum().detach(),
    }
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        stats["kl"] = (kl * mask).sum().detach()
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum()
    stats["pg_loss"] = loss.detach()
    return loss, stats


def sft_token_losses(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood summed over masked (assistant) tokens."""
    loss = -(logprobs * mask).sum()
    return loss, {"nll": loss.detach()}
