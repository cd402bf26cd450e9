"""Gated Multi-head Latent Attention without positional encoding (NoPE), as in the K3 report.

Queries and keys/values go through low-rank latents; there is no rotary embedding anywhere, so the only notion of order
is the causal mask. Per token t and head h:

    c_q  = RMSNorm(W_dq x_t)                     [q_latent]
    c_kv = RMSNorm(W_dkv x_t)                    [kv_latent]   <- the only thing the decode cache keeps
    q_h = W_uq,h c_q,   k_h = W_uk,h c_kv,   v_h = W_uv,h c_kv
    o_h = Σ_{s ≤ t, s real or s = t} softmax_s(q_h·k_h,s / √head_dim) v_h,s
    y   = W_o [sigmoid(W_g x_t) ⊙ o]

`GatedMLA.forward` expands the cached latent to per-head K/V (or, with `absorb=True`, folds W_uk into the query and W_uv
after the weighted sum so attention runs in the latent space); `mla_naive` is the plain, cache-free version of the
same equations that the tests tie both paths to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class MLACache:
    """Decode cache of one MLA layer: the normalised KV latent of every token seen so far, and which of them are real.

    latent: [B, S, kv_latent] float; mask: [B, S] bool (True = real token, False = padding). Grown by concatenation.
    """

    latent: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return self.latent.shape[1]

    def append(self, latent: Tensor, mask: Tensor) -> "MLACache":
        return MLACache(torch.cat([self.latent, latent], dim=1), torch.cat([self.mask, mask], dim=1))

    def select(self, rows: Tensor | list[int]) -> "MLACache":
        """Keep the batch rows `rows` (e.g. the episodes still running)."""
        rows = torch.as_tensor(rows, device=self.latent.device)
        return MLACache(self.latent[rows], self.mask[rows])

    def repeat_interleave(self, n: int) -> "MLACache":
        """One prompt -> n samples: row b becomes rows b*n .. b*n+n-1."""
        return MLACache(self.latent.repeat_interleave(n, dim=0), self.mask.repeat_interleave(n, dim=0))

    def clone(self) -> "MLACache":
        return MLACache(self.latent.clone(), self.mask.clone())

    @classmethod
    def cat(cls, caches: list["MLACache"]) -> "MLACache":
        """Rows of several caches in one batch: each is left-padded (mask False) to the longest, then stacked.
        Positions are only mask columns here (NoPE), so a pad column changes no row's attention."""
        width = max(len(c) for c in caches)
        latents = [F.pad(c.latent, (0, 0, width - len(c), 0)) for c in caches]
        masks = [F.pad(c.mask, (width - len(c), 0), value=False) for c in caches]
        return MLACache(torch.cat(latents), torch.cat(masks))

    def compact(self) -> "MLACache":
        """Same attention for every row, fewest columns: each row's real tokens move to the right end, in order (with
        NoPE only the set of cached keys matters to later queries), and columns that are padding in every row go."""
        order = torch.argsort(self.mask.to(torch.int8), dim=1, stable=True)  # pads first, real tokens in order
        keep = int(self.mask.sum(1).max()) if self.mask.numel() else 0
        order = order[:, order.shape[1] - keep :]
        latent = self.latent.gather(1, order[..., None].expand(-1, -1, self.latent.shape[-1]))
        return MLACache(latent, self.mask.gather(1, order))

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + self.mask.nbytes


def attention_mask(key_mask: Tensor, n_queries: int) -> Tensor:
    """Which keys each of the last `n_queries` positions may attend to: [B, S] bool -> [B, T, S] bool.

    Causal, pad keys excluded, and a query always sees itself (so an all-pad row still gets a finite softmax).
    """
    S = key_mask.shape[1]
    k_pos = torch.arange(S, device=key_mask.device)
    q_pos = k_pos[S - n_queries :]
    causal = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    is_self = k_pos[None, :] == q_pos[:, None]  # [T, S]
    return causal & (key_mask[:, None, :] | is_self)  # [B, T, S]


def segment_attention_mask(segment_ids: Tensor) -> Tensor:
    """Packed sequences (``models/packing.py``): causal within each segment, pads see only themselves. [B, T, T]."""
    T = segment_ids.shape[1]
    pos = torch.arange(T, device=segment_ids.device)
    causal = pos[None, :] <= pos[:, None]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
    return causal & (same | (pos[None, :] == pos[:, None]))


class GatedMLA(nn.Module):
    """Gated MLA with NoPE: `forward(x, mask, cache, use_cache) -> (y, cache)`; equations in the module docstring."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, q_latent: int, kv_latent: int, eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.head_dim, self.kv_latent = n_heads, head_dim, kv_latent
        inner = n_heads * head_dim
        self.wq_down = nn.Linear(d_model, q_latent, bias=False)
        self.q_norm = nn.RMSNorm(q_latent, eps=eps)
        self.wq_up = nn.Linear(q_latent, inner, bias=False)
        self.wkv_down = nn.Linear(d_model, kv_latent, bias=False)
        self.kv_norm = nn.RMSNorm(kv_latent, eps=eps)
        self.wk_up = nn.Linear(kv_latent, inner, bias=False)
        self.wv_up = nn.Linear(kv_latent, inner, bias=False)
        self.w_g = nn.Linear(d_model, inner, bias=False)
        self.w_o = nn.Linear(inner, d_model, bias=False)

    def queries(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return self.wq_up(self.q_norm(self.wq_down(x))).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, hd]

    def kv_latents(self, x: Tensor) -> Tensor:
        return self.kv_norm(self.wkv_down(x))  # [B, T, kv_latent]

    def output(self, x: Tensor, o: Tensor) -> Tensor:
        """y = W_o[sigmoid(W_g x) ⊙ o], o: [B, T, H, hd]."""
        return self.w_o(torch.sigmoid(self.w_g(x)) * o.flatten(2))  # [B, T, D]

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        cache: MLACache | None = None,
        use_cache: bool = False,
        absorb: bool = False,
        segment_ids: Tensor | None = None,
    ) -> tuple[Tensor, MLACache | None]:
        """x: [B, T, D]; mask: [B, T] for the new tokens only (1 = real, 0 = pad; None = all real); cache: the
        latents of earlier tokens. Returns y [B, T, D] and, with use_cache, the cache extended by these T tokens
        (else None). absorb=True computes the same attention in the latent space (cheaper for short T, long cache).
        segment_ids [B, T] (packed training sequences, no cache): each token attends within its own segment."""
        B, T, _ = x.shape
        if segment_ids is not None:
            if cache is not None or use_cache:
                raise ValueError("GatedMLA: segment_ids are for packed training forwards, which keep no cache")
            mask = segment_ids > 0
        new_mask = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
        new = MLACache(self.kv_latents(x), new_mask)
        full = new if cache is None else cache.append(new.latent, new.mask)
        allowed = attention_mask(full.mask, T) if segment_ids is None else segment_attention_mask(segment_ids)
        q = self.queries(x)  # [B, T, H, hd]
        if absorb:
            o = self._absorbed_attention(q, full.latent, allowed)
        else:
            S = len(full)
            k = self.wk_up(full.latent).view(B, S, self.n_heads, self.head_dim)  # [B, S, H, hd]
            v = self.wv_up(full.latent).view(B, S, self.n_heads, self.head_dim)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if cache is None and mask is None:  # plain causal: SDPA may take its flash kernel, which takes no mask
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
            else:
                o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed[:, None]).transpose(1, 2)  # [B,T,H,hd]
        return self.output(x, o), (full if use_cache else None)

    def _absorbed_attention(self, q: Tensor, latent: Tensor, allowed: Tensor) -> Tensor:
        """q_h·(W_uk,h c) = (W_uk,hᵀ q_h)·c and Σ p (W_uv,h c) = W_uv,h Σ p c: attend over the latent directly."""
        w_uk = self.wk_up.weight.view(self.n_heads, self.head_dim, self.kv_latent)  # [H, hd, L]
        w_uv = self.wv_up.weight.view(self.n_heads, self.head_dim, self.kv_latent)
        q_lat = torch.einsum("bthd,hdl->bhtl", q, w_uk)  # [B, H, T, L]
        scores = torch.einsum("bhtl,bsl->bhts", q_lat, latent) * self.head_dim**-0.5  # [B, H, T, S]
        p = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
        o_lat = torch.einsum("bhts,bsl->bthl", p, latent)  # [B, T, H, L]
        return torch.einsum("bthl,hdl->bthd", o_lat, w_uv)  # [B, T, H, hd]
