"""Block Attention Residuals (Attention Residuals, arXiv 2603.15031), as used by K3.

Instead of adding every sublayer's output to one residual stream, each sublayer reads a softmax-weighted mix of a few
sources: the token embedding, the sum of each completed block of sublayer outputs, and the partial sum of the current
block.

    h_l = Σ_i α_{l,i} v_i,    α_{l,i} = softmax_i(w_lᵀ RMSNorm(v_i))    (per token, over sources i)

w_l is a learned pseudo-query per mix, initialised to zero so every mix starts as the uniform mean of its sources. A
layer has two mixes (before attention, before the feed-forward) and the model one more before the output norm.

The mix is per token (no cross-token state), so it needs nothing in the decode cache. How a model uses it:

    state = AttnResState(embedding, sublayers_per_block=2 * layers_per_block)
    for layer in layers:
        state.add(layer.attn(layer.attn_norm(layer.attn_res(state.sources()))))
        state.add(layer.ffn(layer.ffn_norm(layer.ffn_res(state.sources()))))
    logits = head(final_norm(final_res(state.sources())))
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def attnres_weights(sources: list[Tensor] | Tensor, query: Tensor, norm: nn.Module) -> Tensor:
    """α_i = softmax_i(wᵀ RMSNorm(v_i)): sources [N, B, T, D] (or a list of N [B, T, D]), query [D] -> [N, B, T]."""
    v = torch.stack(list(sources)) if isinstance(sources, (list, tuple)) else sources  # [N, B, T, D]
    logits = norm(v) @ query  # [N, B, T]
    return logits.float().softmax(dim=0).to(v.dtype)  # float32 softmax, like the routers


def attnres_mix(sources: list[Tensor] | Tensor, query: Tensor, norm: nn.Module) -> Tensor:
    """h = Σ_i α_i v_i with α_i = softmax_i(wᵀ RMSNorm(v_i)): N sources of [B, T, D] -> [B, T, D]."""
    v = torch.stack(list(sources)) if isinstance(sources, (list, tuple)) else sources  # [N, B, T, D]
    return torch.einsum("nbt,nbtd->btd", attnres_weights(v, query, norm), v)


class BlockAttnRes(nn.Module):
    """One mix: a zero-initialised pseudo-query w [D] and the RMSNorm applied to the sources before scoring.

    The norm has no gain of its own: a per-channel gain would only rescale w, which is already learned.
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = nn.RMSNorm(d_model, eps=eps, elementwise_affine=False)

    def forward(self, sources: list[Tensor] | Tensor) -> Tensor:
        return attnres_mix(sources, self.query, self.norm)  # [B, T, D]


class AttnResState:
    """The sources of the next mix: [embedding, completed block sums ..., partial sum of the current block].

    Block size counts sublayers (attention and feed-forward count one each, so a layer is two): after
    `sublayers_per_block` calls to `add` the partial sum closes into a completed block. Until the first add of a new
    block there is no partial sum (an empty block is not a source; a zero source would dilute the mix).
    """

    def __init__(self, embedding: Tensor, sublayers_per_block: int):
        if sublayers_per_block < 1:
            raise ValueError(f"sublayers_per_block must be >= 1, got {sublayers_per_block}")
        self.sublayers_per_block = sublayers_per_block
        self.embedding = embedding  # [B, T, D]
        self.blocks: list[Tensor] = []  # completed block sums, each [B, T, D]
        self.partial: Tensor | None = None
        self.n_partial = 0  # sublayer outputs in the partial sum

    def add(self, out: Tensor) -> None:
        """Add one sublayer's output [B, T, D] to the current block, closing it when it is full."""
        self.partial = out if self.partial is None else self.partial + out
        self.n_partial += 1
        if self.n_partial == self.sublayers_per_block:
            self.blocks.append(self.partial)
            self.partial, self.n_partial = None, 0

    def sources(self) -> list[Tensor]:
        return [self.embedding, *self.blocks] + ([] if self.partial is None else [self.partial])
