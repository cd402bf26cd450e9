"""The K3-shaped policy: KDA and NoPE gated MLA in 3:1, Block Attention Residuals, Stable LatentMoE.

Layer layout (K3 report): groups of three KDA layers and one global MLA layer, then a final global MLA layer on top; the
first layer's feed-forward is dense, every other one is a LatentMoE. No positional encoding anywhere: KDA's recurrence
and the causal mask carry order. Each sublayer reads a Block Attention Residual mix of [embedding, completed block sums,
partial block sum] instead of a plain residual stream; a final mix feeds the output norm.

Decoding keeps a ``K3Cache``: per KDA layer its recurrent state and short-conv windows, per MLA layer its latent KV. The
cache can be selected, copied (``repeat_interleave``: one prompt, G samples) and continued across turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attnres import AttnResState, BlockAttnRes
from .config import PRESETS, K3Config  # noqa: F401  (PRESETS re-exported: model.PRESETS)
from .kda import KDA, KDACache
from .latent_moe import LatentMoE, SituGLU
from .mla import GatedMLA, MLACache

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass
class K3Cache:
    """One entry per layer: KDACache for KDA layers, MLACache for MLA layers."""

    layers: list[KDACache | MLACache]

    def select(self, rows) -> K3Cache:
        return K3Cache([c.select(rows) for c in self.layers])

    def repeat_interleave(self, n: int) -> K3Cache:
        return K3Cache([c.repeat_interleave(n) for c in self.layers])

    def clone(self) -> K3Cache:
        return K3Cache([c.clone() for c in self.layers])

    @classmethod
    def cat(cls, caches: list[K3Cache]) -> K3Cache:
        """One batch from the rows of several caches (MLA latents left-padded to the longest)."""
        return K3Cache([type(layers[0]).cat(list(layers)) for layers in zip(*(c.layers for c in caches))])

    def compact(self) -> K3Cache:
        """Drop the padding that MLA latents carry from batching (KDA states have none)."""
        return K3Cache([c.compact() if isinstance(c, MLACache) else c for c in self.layers])

    def keep_rows(self, rows) -> K3Cache:
        """``select(rows).compact()``: the rows that stay in a decode batch."""
        return self.select(rows).compact()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


class K3Output(NamedTuple):  # a tuple, so ZeRO-3's hooks find its tensors
    logits: Tensor  # [B, T, V] float32
    cache: K3Cache | None
    aux_loss: Tensor  # always 0: LatentMoE balances by bias, without an auxiliary loss
    router_ids: Tensor  # [B, T, n_moe_layers, top_k]
    hidden: Tensor | None = None  # [B, T, D] the normed final hidden state, with return_hidden (a value head reads it)


class Layer(nn.Module):
    def __init__(self, cfg: K3Config, kind: str, dense: bool):
        super().__init__()
        D = cfg.d_model
        self.kind = kind
        self.attn_res, self.ffn_res = BlockAttnRes(D), BlockAttnRes(D)
        self.attn_norm, self.ffn_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
        if kind == "kda":
            self.attn = KDA(D, cfg.n_heads, cfg.head_dim, cfg.head_dim, cfg.kda_low_rank, cfg.conv_kernel)
        else:
            self.attn = GatedMLA(D, cfg.n_heads, cfg.head_dim, cfg.q_latent, cfg.kv_latent)
        if dense:
            self.ffn = SituGLU(D, cfg.d_ff)
        else:
            self.ffn = LatentMoE(D, cfg.n_experts, cfg.top_k, cfg.n_shared, cfg.d_expert, balancing=cfg.balancing)


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, kind, dense=i == 0) for i, kind in enumerate(cfg.layer_kinds))
        self.final_res = BlockAttnRes(cfg.d_model)
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    @property
    def pack_align(self) -> int:
        """Packed sequences must start at multiples of this (the KDA chunk; see models/packing.py)."""
        return max([layer.attn.chunk_size for layer in self.layers if isinstance(layer.attn, KDA)], default=1)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.ffn, LatentMoE)]

    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor | None = None,  # [B, T] for the new tokens: 1 real, 0 pad (left padding)
        position_ids: Tensor | None = None,  # accepted for interface parity; there are no positions (NoPE)
        cache: K3Cache | None = None,
        use_cache: bool = False,
        forced_ids: Tensor | None = None,  # [B, T, n_moe_layers, top_k]: routing replay
        return_hidden: bool = False,
        segment_ids: Tensor | None = None,  # [B, T] packed sequences (models/packing.py): 1.. per sequence, 0 = pad
        logits_at: Tensor | None = None,  # [K] columns: logits [B, K, V] there only (models/sampling.py score_columns)
    ) -> K3Output:
        if segment_ids is not None:
            attention_mask = segment_ids > 0
        mask = None if attention_mask is None else attention_mask.bool()
        x = self.embed(input_ids)  # [B, T, D]
        state = AttnResState(x, sublayers_per_block=2 * self.config.attnres_block_layers)
        new_caches, router_ids = [], []
        moe_index = 0
        for i, layer in enumerate(self.layers):
            h = layer.attn_norm(layer.attn_res(state.sources()))
            y, layer_cache = layer.attn(h, mask, None if cache is None else cache.layers[i], use_cache,
                                        segment_ids=segment_ids)
            new_caches.append(layer_cache)
            state.add(y)
            h = layer.ffn_norm(layer.ffn_res(state.sources()))
            if isinstance(layer.ffn, LatentMoE):
                forced = None if forced_ids is None else forced_ids[:, :, moe_index]
                result = layer.ffn(h, mask, forced)
                router_ids.append(result.expert_ids)
                moe_index += 1
                state.add(result.y)
            else:
                state.add(layer.ffn(h))
        h = self.norm(self.final_res(state.sources()))
        at = h if logits_at is None else h[:, logits_at]
        logits = F.linear(at, self.embed.weight) if self.lm_head is None else self.lm_head(at)
        return K3Output(
            logits=logits.float(),
            cache=K3Cache(new_caches) if use_cache else None,
            aux_loss=torch.zeros((), device=logits.device),
            router_ids=torch.stack(router_ids, dim=2),
            hidden=h if return_hidden else None,
        )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_pretrained(model: K3Model, directory: str | Path, tokenizer=None, state_dict: dict | None = None) -> Path:
    """``config.json`` + ``model.safetensors`` (the MoE selection biases included), and ``tokenizer.json`` if given.
    ``state_dict`` (default: the model's) lets an expert-parallel rank save the gathered whole model."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=1) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or model.state_dict()).items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory


def from_pretrained(directory: str | Path) -> K3Model:
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing; write K3 checkpoints with save_pretrained()")
    cfg = K3Config.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    model = K3Model(cfg)
    model.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=True)
    return model
