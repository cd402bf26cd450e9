"""The plain references the K3 layers' fast paths are tested against, one per fast path, each named ``<what>_naive``
(flash-linear-attention's ``naive.py`` convention; the engine's are in ``engine/naive.py``). They follow the equations
one token or one expert at a time. ``kda_naive`` and ``experts_naive`` are also run where they are the right algorithm
(one decode token; experts on the CPU); the others never run in a job.

    kda_naive         <- kda_chunked (kda.py)
    experts_naive     <- grouped_experts, ExpertGroup.mix (latent_moe.py, expert_parallel.py)
    latent_moe_naive  <- LatentMoE.forward (latent_moe.py)
    mla_naive         <- GatedMLA.forward with and without its cache (mla.py)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def kda_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA in fp32: q, k, g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; state [B,H,K,V] -> o [B,T,H,V].

    Uses S_t = D_t S_{t-1} + k_t [beta_t (v_t - k_t^T D_t S_{t-1})]^T, which is the update of kda.py's docstring multiplied out.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # Diag(alpha_t) S_{t-1}
        k_t = k[:, t]  # [B,H,K]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))  # [B,H,V]
        S = S + k_t[..., None] * u[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o.to(out_dtype), (S if output_final_state else None)


def experts_naive(z: Tensor, ids: Tensor, p: Tensor, experts: nn.ModuleList) -> Tensor:
    """Σ_i p_i E_i(z) per token [N, L] in fp32, one expert at a time over the tokens that chose it (the reference for
    ``grouped_experts``; also the CPU path, where grouped GEMMs do not apply)."""
    N, k = ids.shape
    per_slot = torch.zeros(N, k, z.shape[-1], dtype=torch.float32, device=z.device)  # [N, k, L]
    for e, expert in enumerate(experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # each (token, slot) pair is written once
        if tok.numel():
            per_slot[tok, slot] = expert(z[tok]).float() * p[tok, slot, None]
    return per_slot.sum(1)  # summed in slot order


@torch.no_grad()
def latent_moe_naive(  # moe: a LatentMoE (not imported: latent_moe.py imports this file)
    moe: nn.Module, x: Tensor, forced_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The same layer one token and one expert at a time, no batching: (y [B,T,D], ids [B,T,k], weights [B,T,k])."""
    B, T, D = x.shape
    y = torch.zeros_like(x)
    ids = torch.zeros(B, T, moe.top_k, dtype=torch.long)
    weights = torch.zeros(B, T, moe.top_k)
    for b in range(B):
        for t in range(T):
            xt = x[b, t]
            s = torch.sigmoid(moe.router.weight.float() @ xt.float())  # [n]
            chosen = (s + moe.bias).topk(moe.top_k).indices if forced_ids is None else forced_ids[b, t]
            total = sum(s[e] for e in chosen)
            z = moe.w_down.weight @ xt  # [L]
            mixed = torch.zeros(moe.latent_dim)
            for slot, e in enumerate(chosen.tolist()):
                p = s[e] / total
                mixed += p * moe.experts[e](z)
                ids[b, t, slot], weights[b, t, slot] = e, p
            normed = mixed / torch.sqrt(mixed.pow(2).mean() + moe.norm.eps) * moe.norm.weight
            out = moe.w_up.weight @ normed
            for expert in moe.shared:
                out = out + expert(xt)
            y[b, t] = out
    return y, ids, weights


def mla_naive(layer: nn.Module, x: Tensor, mask: Tensor | None = None) -> Tensor:
    """The plain equations over the whole sequence, no cache: full per-head K and V, an explicit masked softmax."""
    B, T, _ = x.shape
    mask = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
    c_kv = layer.kv_norm(layer.wkv_down(x))  # [B, T, L]
    q = layer.wq_up(layer.q_norm(layer.wq_down(x))).view(B, T, layer.n_heads, layer.head_dim)
    k = layer.wk_up(c_kv).view(B, T, layer.n_heads, layer.head_dim)
    v = layer.wv_up(c_kv).view(B, T, layer.n_heads, layer.head_dim)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / layer.head_dim**0.5  # [B, H, T, T]
    pos = torch.arange(T, device=x.device)
    allowed = (pos[None, :] <= pos[:, None]) & (mask[:, None, :] | (pos[None, :] == pos[:, None]))  # [B, T, T]
    p = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, v)  # [B, T, H, hd]
    return layer.w_o(torch.sigmoid(layer.w_g(x)) * o.reshape(B, T, -1))
