"""Routing replay (R3) and the router mismatch rate.

The engine records, for every token it feeds, the experts each MoE layer chose (``Trajectory.routed_experts``). The
trainer's own routing can differ for the same tokens: the selection biases move at every optimizer step, and batching
changes the last bits of the router's scores. With ``trainer.routing_replay: true`` the training forward uses the
engine's experts where they are known (``K3Model.forward(forced_ids=...)``; a position with unknown routing, marked -1,
routes by itself), so the policy-gradient ratio compares the same computation the engine sampled from. Either way the
trainer logs ``router/mismatch_rate``: the fraction of (token, MoE layer) pairs with known routing whose top-k set under
the trainer's own router differs from the engine's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sandforge.types import TrainingRow

UNKNOWN = -1


def routed_ids(rows: list[TrainingRow], width: int, device: torch.device | str | None = None) -> Tensor | None:
    """The engine's routing of right-padded rows: [B, width, n_moe_layers, top_k] on ``device``, -1 where unknown; None
    when no row carries any."""
    routed = [r.routed_experts or [] for r in rows]
    first = next((e for rr in routed for e in rr if e is not None), None)
    if first is None:
        return None
    unknown = [[UNKNOWN] * len(first[0])] * len(first)
    return torch.tensor([[e if e is not None else unknown for e in rr] + [unknown] * (width - len(rr))
                         for rr in routed], dtype=torch.long, device=device)


def replaying(model: nn.Module, forced: Tensor | None) -> Any:
    """``model``, or a callable that runs it with the engine's experts forced."""
    if forced is None:
        return model
    return lambda *args, **kwargs: model(*args, forced_ids=forced, **kwargs)


class RouterRecorder:
    """Records, during a forward, the experts each LatentMoE layer's own router picks (top-k of score + bias), whether
    or not routing is being replayed: [B, T, n_moe_layers, top_k]."""

    def __init__(self, model: nn.Module):
        from sandforge.models.k3.latent_moe import LatentMoE

        self.layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
        self.own: list[Tensor] = []
        self.hooks: list = []

    def _hook(self, module, args, output) -> None:
        x = args[0]  # [B, T, D]
        with torch.no_grad():
            s = module.scores(x.reshape(-1, x.shape[-1]))
            own = (s + module.bias).topk(module.top_k, dim=-1).indices
        self.own.append(own.view(*x.shape[:2], module.top_k))

    def __enter__(self) -> RouterRecorder:
        self.hooks = [m.register_forward_hook(self._hook) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def own_ids(self) -> Tensor | None:
        return torch.stack(self.own, dim=2) if self.own else None


def mismatch_counts(own: Tensor | None, engine: Tensor | None, attention_mask: Tensor) -> dict[str, Tensor]:
    """``router/mismatched`` and ``router/known``: (token, layer) pairs with known engine routing, and those of them
    whose expert set differs from ``own``. Zeros when either side is missing, so every rank reports the same keys."""
    zero = torch.zeros((), dtype=torch.float64)
    if own is None or engine is None:
        return {"router/mismatched": zero, "router/known": zero.clone()}
    engine = engine.to(own.device)
    known = (engine >= 0).all(-1) & attention_mask.bool().to(own.device)[..., None]  # [B, T, L]
    same = (own.sort(-1).values == engine.sort(-1).values).all(-1)
    return {"router/mismatched": (known & ~same).sum().double().cpu(), "router/known": known.sum().double().cpu()}


def mismatch_rate(metrics: dict[str, float]) -> dict[str, float]:
    """Turn the summed counts into ``router/mismatch_rate`` (left out when no routing was known)."""
    mismatched, known = metrics.pop("router/mismatched", 0.0), metrics.pop("router/known", 0.0)
    if known:
        metrics["router/mismatch_rate"] = mismatched / known
    return metrics
