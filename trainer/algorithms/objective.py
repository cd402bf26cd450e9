"""One micro-batch's share of the step's loss, and the statistics the trainer logs.

Log-prob convention (three policies look at each token):
  engine    sampled it (``Trajectory.logprobs``);
  old       the trainer's policy when the step began: since weights change only at the optimizer boundary, these are
            the trainer's current log-probs, detached, at every micro-batch of the step;
  current   the trainer's log-probs with grad.
The ratio rho = exp(current - old) (1 in value, grad logp in gradient: the policy-gradient estimate PPO's clip and
CISPO's weight act on), and truncated importance sampling corrects the engine/trainer mismatch (different kernels,
batching, precision) with a per-token weight w = min(exp(old - engine), trainer.tis_cap) on the policy loss.

Every ``Stats.sums`` entry is this micro-batch's share of the logged value (token statistics divided by the global
token count), so sums over micro-batches and ranks are the step's value; ``mins``/``maxs`` reduce with min/max.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .aggregate import Totals, aggregate
from .kl import kl_estimate
from .losses import value_loss
from .registry import Settings


@dataclass
class MicroBatch:
    logprobs: Tensor  # [B, T] the trainer's, with grad
    engine_logprobs: Tensor  # [B, T] the sampler's
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] float, 1 on policy tokens
    ref_logprobs: Tensor | None = None  # [B, T] the frozen reference policy's
    entropy: Tensor | None = None  # [B, T] the trainer's per-token entropy, with grad
    values: Tensor | None = None  # [B, T] the value head's estimates, with grad (PPO)
    returns: Tensor | None = None  # [B, T] value targets (PPO)
    old_logprobs: Tensor | None = None  # [B, T] the trainer's before this RL step's first update (mini-batches)


@dataclass
class Stats:
    sums: dict[str, Tensor] = field(default_factory=dict)
    mins: dict[str, Tensor] = field(default_factory=dict)
    maxs: dict[str, Tensor] = field(default_factory=dict)

    def add(self, other: Stats) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        for k, v in other.mins.items():
            self.mins[k] = torch.minimum(self.mins[k], v) if k in self.mins else v
        for k, v in other.maxs.items():
            self.maxs[k] = torch.maximum(self.maxs[k], v) if k in self.maxs else v


def _token_mean(x: Tensor, mask: Tensor, totals: Totals) -> Tensor:
    return (x.detach() * mask).sum() / max(totals.tokens, 1)


def rl_objective(b: MicroBatch, s: Settings, totals: Totals) -> tuple[Tensor, Stats]:
    """The loss to backpropagate (this micro-batch's share of the step's aggregated loss) and its statistics."""
    mask = b.mask.float()
    on = mask.bool()
    old = b.old_logprobs if b.old_logprobs is not None else b.logprobs.detach()
    pl = s.algorithm.loss(b.logprobs, old, b.advantages, mask, s.eps_low, s.eps_high)
    per_token = pl.per_token
    st = Stats()
    if s.tis_cap is not None:
        raw = torch.exp(old - b.engine_logprobs)
        tis = raw.clamp(max=s.tis_cap)
        per_token = per_token * tis
        st.sums["tis/mean"] = _token_mean(tis, mask, totals)
        st.sums["tis/clipped_frac"] = _token_mean((raw > s.tis_cap).float(), mask, totals)
    st.sums["mismatch/kl"] = _token_mean(kl_estimate(b.engine_logprobs, old, "k3"), mask, totals)
    agg = lambda x: aggregate(x, mask, s.loss_agg, totals, s.response_budget)  # noqa: E731
    pg = agg(per_token)
    loss = pg
    if b.ref_logprobs is not None:
        kl = kl_estimate(b.logprobs, b.ref_logprobs, s.kl_estimator)
        st.sums["kl"] = _token_mean(kl, mask, totals)
        if s.kl_in == "loss" and s.kl_coef:
            loss = loss + s.kl_coef * agg(kl)
    if b.entropy is not None:
        st.sums["entropy"] = _token_mean(b.entropy, mask, totals)
        if s.entropy_coef:
            loss = loss - s.entropy_coef * agg(b.entropy)
    if b.values is not None and b.returns is not None:
        vl = agg(value_loss(b.values, b.returns))
        loss = loss + s.value_coef * vl
        st.sums["value/loss"] = vl.detach()
        st.sums["value/mean"] = _token_mean(b.values, mask, totals)
    low, high = _token_mean(pl.clipped_low.float(), mask, totals), _token_mean(pl.clipped_high.float(), mask, totals)
    st.sums |= {"clip_frac": low + high, "clip_frac/low": low, "clip_frac/high": high,
                "ratio/mean": _token_mean(pl.ratio, mask, totals), "loss/policy": pg.detach(), "loss": loss.detach()}
    st.mins["ratio/min"] = torch.where(on, pl.ratio, torch.inf).min()
    st.maxs["ratio/max"] = torch.where(on, pl.ratio, -torch.inf).max()
    return loss, st


def sft_objective(logprobs: Tensor, mask: Tensor, totals: Totals) -> tuple[Tensor, Stats]:
    """Supervised warm start: negative log-likelihood, token-mean over the assistant tokens of the whole step."""
    loss = aggregate(-logprobs, mask.float(), "token-mean", totals)
    return loss, Stats(sums={"loss": loss.detach()})
