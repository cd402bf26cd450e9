"""LoRA's forward and backward as one autograd function: the fast path of a LoRA layer in training.

peft computes an adapted linear layer as ``W x + s B (A x)``: three matmuls a token, two of them of rank r (16), plus
an elementwise scale and add over every output. On a CPU in bf16 the thin rank-r matmuls run far below the machine's
GEMM rate (a [2000, 576] x [576, 16] product is memory-bound and takes a slow kernel), so in the quickstart's trainer
they cost as much as the frozen base matmuls. ``MergedLoRA`` instead merges ``W' = W + s B A`` once per call (an
[out, r] x [r, in] product, tiny next to a micro-batch's tokens) and computes ``W' x`` with one GEMM. Its backward:

- the input's gradient ``g W'`` (one GEMM; skipped where the input needs none, e.g. the first adapted layer's);
- ``dB = s g^T (x A^T)`` and ``dA = s (g B)^T x``, peft's own rank-r products (forming ``g^T x`` [out, in] with one
  GEMM instead measured slower: 9.3 against 6.5 ms for a [2000, 576] -> 1536 layer's forward and backward, where
  peft's layer takes 13.1 ms; Intel Xeon with AMX, bf16, 2 threads).

On the whole RL step the gain is smaller, 1.07x train tokens/s (``bench/trainer.py --sections fused_lora``): the
frozen layers below the adapters, attention and the loss take the rest.

The result is the same function with the same gradients, up to the rounding of summing in another order (tests tie
it to peft's forward: tests/test_lora.py). ``fuse_lora`` makes a policy's adapted layers ``FusedLoraLinear``; a layer
in any state the fused path does not cover (adapters disabled or merged, dropout, several adapters, a variant such as
DoRA, mixed dtypes) runs peft's own forward, the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn

ADAPTER = "default"  # peft's name for an adapter (models/lora.py)


class MergedLoRA(torch.autograd.Function):
    """``x [..., in] -> x (W + s B A)^T + bias``; gradients for x, A and B (W and the bias are frozen)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, scaling: float) -> Tensor:
        merged = torch.addmm(weight, b, a, alpha=scaling)
        ctx.save_for_backward(x, merged, a, b)
        ctx.scaling = scaling
        return nn.functional.linear(x, merged, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, merged, a, b = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = (g2 @ merged).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_a = ((g2 @ b).t() @ x2) * ctx.scaling if ctx.needs_input_grad[3] else None
        grad_b = (g2.t() @ (x2 @ a.t())) * ctx.scaling if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


def _fusable(layer: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``layer`` computes plain ``W x + s B A x`` right now, with ``x`` in its weights' dtype."""
    if args or kwargs or layer.disable_adapters or layer.merged or list(layer.active_adapters) != [ADAPTER]:
        return False
    if ADAPTER in getattr(layer, "lora_variant", {}) or not isinstance(layer.lora_dropout[ADAPTER], nn.Identity):
        return False
    weight = layer.base_layer.weight
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    return x.dtype == weight.dtype == a.dtype == b.dtype and type(layer.base_layer) is nn.Linear


class FusedLoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` computing through ``MergedLoRA`` where ``_fusable``, else through peft's own forward."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not _fusable(self, x, args, kwargs):
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        return MergedLoRA.apply(x, base.weight, base.bias, self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight,
                                self.scaling[ADAPTER])


def fuse_lora(policy: nn.Module) -> int:
    """Every peft LoRA ``Linear`` of ``policy`` becomes a ``FusedLoraLinear`` (its class swapped in place: the same
    parameters, names and hooks); returns how many."""
    n = 0
    for module in policy.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            n += 1
    return n
