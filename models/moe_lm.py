"""A small decoder-only Mixture-of-Experts language model, readable top to bottom.

Pre-RMSNorm blocks of causal multi-head attention with RoPE and a top-k MoE feed-forward (softmax router, gates
renormalised over the chosen k, SwiGLU experts, Switch-style load-balancing loss). The K3 architecture in ``models/k3/``
replaces it later; this one is the simple baseline every fast path is checked against.

Shapes: B batch, T new tokens, S keys (cached + new), H heads, D head dim, E experts, K experts per token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class MoEConfig:
    vocab_size: int = 272
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256  # hidden size of each expert
    n_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    aux_loss_coef: float = 0.01
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of even size (RoPE)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MoEConfig keys {unknown}; expected some of {sorted(known)}")
        return cls(**d)


@dataclass
class KVCache:
    """Keys and values of every layer for the tokens seen so far, and which of those tokens are real (not padding).

    ``keys[i]``/``values[i]``: [B, H, S, D] for layer i; ``mask``: [B, S] bool. Grown by concatenation each step.
    """

    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor

    @property
    def seq_len(self) -> int:
        return self.mask.shape[1]

    def select(self, rows: Tensor) -> KVCache:
        """The cache of the batch rows ``rows`` only (drops finished sequences during decoding)."""
        return KVCache([k[rows] for k in self.keys], [v[rows] for v in self.values], self.mask[rows])


@dataclass
class MoEOutput:
    logits: Tensor  # [B, T, V] float32
    cache: KVCache | None
    aux_loss: Tensor  # scalar, already scaled by aux_loss_coef: add it to the training loss as is
    router_ids: Tensor  # [B, T, n_layers, top_k] long, experts chosen per token and layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[:D/2], x[D/2:]) of x [B, H, T, D] by the angles whose cos/sin are [B, 1, T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [B, H, S, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts. Expert weights are stacked: [E, d_ff, d_model] and [E, d_model, d_ff]."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_ff, cfg.d_model))
        self.w_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_ff, cfg.d_model))
        self.w_down = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model, cfg.d_ff))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, C] -> router probs [N, E] (float32), gates [N, K] summing to 1, expert ids [N, K]."""
        probs = self.router(x).float().softmax(dim=-1)
        top_p, top_ids = probs.topk(self.top_k, dim=-1)
        return probs, top_p / top_p.sum(-1, keepdim=True), top_ids

    def expert(self, e: int, x: Tensor) -> Tensor:
        return (F.silu(x @ self.w_gate[e].T) * (x @ self.w_up[e].T)) @ self.w_down[e].T

    def forward(self, x: Tensor, token_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, C], token_mask [B, T] (True = real) -> (y [B, T, C], balance loss, expert ids [B, T, K])."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs, gates, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for e in range(self.n_experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, self.expert(e, flat[tok]) * gates[tok, slot, None].to(x.dtype))

        # Switch balance loss E * sum_e f_e * P_e over real tokens: f_e = share of the N*K assignments that went to
        # expert e, P_e = mean router probability of e. It is 1 when routing is uniform.
        m = token_mask.reshape(-1, 1).float()
        n = m.sum().clamp(min=1.0)
        assigned = F.one_hot(ids, self.n_experts).float().sum(1)  # [N, E]
        f = (assigned * m).sum(0) / (n * self.top_k)
        p = (probs * m).sum(0) / n
        return out.view(B, T, C), self.n_experts * (f * p).sum(), ids.view(B, T, self.top_k)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.moe_norm, self.moe = RMSNorm(cfg.d_model), MoE(cfg)

    def forward(self, x, cos, sin, mask, token_mask, past):
        a, kv = self.attn(self.attn_norm(x), cos, sin, mask, past)
        x = x + a
        m, aux, ids = self.moe(self.moe_norm(x), token_mask)
        return x + m, kv, aux, ids


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        head_dim = cfg.d_model // cfg.n_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled down by sqrt(2 * n_layers)."""
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith(("proj.weight", "w_down")) else std)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
    ) -> MoEOutput:
        """input_ids [B, T]; attention_mask [B, T] (1 real, 0 pad; left or right); cache from a previous call."""
        B, T = input_ids.shape
        new_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        full_mask = new_mask if cache is None else torch.cat([cache.mask, new_mask], dim=1)  # [B, S]
        if position_ids is None:
            # Count real tokens only, so a sequence has the same positions whether padded on the left or the right.
            position_ids = (full_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        angles = position_ids[:, None, :, None].float() * self.inv_freq  # [B, 1, T, D/2]
        cos, sin = angles.cos(), angles.sin()

        mask = None  # plain causal attention when nothing is padded or cached
        if attention_mask is not None or cache is not None:
            S = full_mask.shape[1]
            q_pos = torch.arange(S - T, S, device=input_ids.device)[:, None]
            k_pos = torch.arange(S, device=input_ids.device)[None, :]
            # Causal, pad keys hidden; every query also sees itself, so a pad query has a key and gives no NaN.
            mask = ((k_pos <= q_pos) & full_mask[:, None, :]) | (k_pos == q_pos)  # [B, T, S]
            mask = mask[:, None]  # [B, 1, T, S]

        x = self.embed(input_ids)
        kvs, auxes, router_ids = [], [], []
        for i, block in enumerate(self.blocks):
            past = None if cache is None else (cache.keys[i], cache.values[i])
            x, kv, aux, ids = block(x, cos, sin, mask, new_mask, past)
            kvs.append(kv)
            auxes.append(aux)
            router_ids.append(ids)
        x = self.norm(x)
        logits = (F.linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)).float()
        return MoEOutput(
            logits=logits,
            cache=KVCache([k for k, _ in kvs], [v for _, v in kvs], full_mask) if use_cache else None,
            aux_loss=self.config.aux_loss_coef * torch.stack(auxes).mean(),
            router_ids=torch.stack(router_ids, dim=2),
        )


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def save_pretrained(model: MoETransformer, directory: str | Path, tokenizer=None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (and ``tokenizer.json`` when a tokenizer is given)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=1) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory


def load_pretrained(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> MoETransformer:
    """Build the model described by ``directory/config.json`` and load ``model.safetensors`` into it."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing; write checkpoints with save_pretrained()")
    cfg = MoEConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    model = MoETransformer(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_NAME} does not match its config: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device=device, dtype=dtype)
