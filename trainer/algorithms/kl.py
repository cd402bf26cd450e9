"""Per-token estimators of KL(p || q) from tokens sampled from p (Schulman, "Approximating KL divergence").

With log r = log q - log p on a sampled token:
  k1 = -log r                unbiased, can be negative per token
  k2 = (log r)^2 / 2         biased, low variance, >= 0
  k3 = (r - 1) - log r       unbiased, low variance, >= 0 (GRPO's choice)
"""

from __future__ import annotations

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || q); ``logp`` are the sampling policy's log-probs of the sampled tokens."""
    log_r = (logq - logp).clamp(-20.0, 20.0)  # one far-off token must not overflow the whole loss
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
