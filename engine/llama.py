"""The fused decode path for Llama-family Hugging Face policies (Llama, Mistral without a sliding window, Qwen2,
Qwen3): the engine's prefill and decode step written against the policy's own weights in a few plain torch ops a
layer, instead of through transformers' modules.

Why: a decode step is bound by memory, and at SmolLM2-135M's size transformers' per-module Python, mask building and
cache bookkeeping cost more than reading the weights (66 ms a step at batch 1, where reading the 270 MB of bf16
weights takes 7 ms; 2-core AMD EPYC). Here a layer is four linear layers and one attention call:

    qkv  = [RMSNorm(x)] W_qkv          one fused matrix (the kernel normalises the rows itself)
    q, k = rotary(q, k)                 the policy's own rotary module, so every rope variant holds
    a    = attention(q, cache + k, v)   each row over its own positions (engine/attention.py, engine/blocks.py)
    x    = x + a W_o                    the residual added as transformers adds it (rounded after the product)
    x    = x + [silu(g) * u] W_down,    g, u = [RMSNorm(x)] W_gate_up, one fused matrix

The linear layers of a decode step (a few rows) and its attention are C kernels (engine/linear.py, engine/attention.py),
each beside the torch reference it is tested against; a prefill's many rows take torch's GEMM.

The weights are the policy's own tensors except the fused q/k/v and gate/up matrices and the kernels' packed copies,
which ``refresh`` makes again after every weight load (the engine calls it).

The reference is the policy's own forward (``HFPolicy`` through the generic engine path, ``engine.decoder: model``):
tests/test_engine_llama.py ties the two, greedy tokens equal and log-probs within 1e-4 in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batch import Prefill
from .attention import decode_attention
from .blocks import RowCaches, RowKV, SlotBatch
from .linear import Linear, rms_norm

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(policy: nn.Module) -> str | None:
    """Why ``policy`` cannot take the fused path (None: it can)."""
    hf = getattr(policy, "model", None)
    config = getattr(policy, "hf_config", None)
    if config is None or hf is None:
        return "not a Hugging Face policy"
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    if kind == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "a sliding window"
    inner = getattr(hf, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(hf, "lm_head"):
        return "an unexpected module layout"
    return None


class LlamaDecoder:
    """Prefill and decode for the engine over ``policy`` (an ``HFPolicy`` of a family in ``FAMILIES``)."""

    prefix_caching = True  # its caches cut to a prefix (``RowCaches.prefix``): the engine shares prompt prefixes

    def __init__(self, policy: nn.Module, use_kernel: bool = True):
        reason = unsupported(policy)
        if reason is not None:
            raise ValueError(f"the fused decode path does not cover this policy: {reason}")
        self.policy = policy
        hf = policy.model
        self.inner, self.lm_head = hf.model, hf.lm_head
        config = policy.hf_config
        self.n_layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.use_kernel = use_kernel  # False: attention and linear layers in torch ops (their references)
        self.layers: list[dict[str, Any]] = []
        self.refresh()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def refresh(self) -> None:
        """Re-read the policy's weights: the fused and packed matrices are copies, made again after every load."""
        k = self.use_kernel

        def fused(*projections: nn.Linear) -> Linear:
            bias = None
            if projections[0].bias is not None:
                bias = torch.cat([p.bias for p in projections])
            weight = projections[0].weight if len(projections) == 1 else torch.cat([p.weight for p in projections])
            return Linear.of(weight, bias, k)

        self.layers = []
        for layer in self.inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "ln1": layer.input_layernorm.weight.detach(),
                "ln2": layer.post_attention_layernorm.weight.detach(),
                "qkv": fused(a.q_proj, a.k_proj, a.v_proj),
                "q_norm": a.q_norm.weight.detach() if hasattr(a, "q_norm") else None,
                "k_norm": a.k_norm.weight.detach() if hasattr(a, "k_norm") else None,
                "o": fused(a.o_proj),
                "gate_up": fused(m.gate_proj, m.up_proj),
                "down": fused(m.down_proj),
            })
        self.lm = Linear.of(self.lm_head.weight, None, k)

    def new_batch(self) -> SlotBatch:
        return SlotBatch(self.n_layers, self.kv_heads, self.head_dim, self.dtype, self.device)

    # ---------------------------------------------------------------- shared pieces
    def _rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, T, d] for ``positions`` [B, T], from the policy's own rotary module."""
        return self.inner.rotary_emb(x, positions)

    def _qkv(self, w: dict, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, D] -> q [N, H, d], k and v [N, KV, d] of RMSNorm(x), q and k rotated (cos, sin [N, 1, d])."""
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        qkv = w["qkv"](x, norm=(w["ln1"], self.eps)).unflatten(-1, (H + 2 * KV, d))
        qk, v = qkv[..., : H + KV, :], qkv[..., H + KV :, :]
        if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head's q and k before the rotation
            qk = torch.cat([rms_norm(qk[..., :H, :], w["q_norm"], self.eps),
                            rms_norm(qk[..., H:, :], w["k_norm"], self.eps)], dim=-2)
        half = d // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + rotated * sin
        return qk[..., :H, :], qk[..., H:, :], v

    def _mlp(self, w: dict, x: Tensor) -> Tensor:
        """x + MLP(RMSNorm(x)), for x [N, D]."""
        return w["down"](w["gate_up"](x, norm=(w["ln2"], self.eps)), residual=x, gated=True)

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm(x, out_f32=True, norm=(self.inner.norm.weight.detach(), self.eps))

    # ---------------------------------------------------------------- prefill
    def prefill(self, items: list[Prefill]) -> int:
        """Feed each item's new tokens after its cache (a one-row ``RowCaches`` or None), one forward per item: a
        prefill is compute-bound, so batching items buys little on a CPU, and alone each runs without padding. An
        item whose forward fails gets ``error``; the others still run. Returns the number of forwards."""
        for item in items:
            try:
                logits, cache = self._prefill_one(item.cache, item.tokens)
            except Exception as e:  # noqa: BLE001 - the engine fails this item's requests, not the others
                item.error = e
                continue
            item.logits, item.out_cache, item.out_row = logits, cache, 0
        return len(items)

    def _prefill_one(self, cache: RowCaches | None, tokens: list[int]) -> tuple[Tensor, RowCaches]:
        row = cache.rows[0] if cache is not None else None
        n = row.n if row is not None else 0
        T = len(tokens)
        if T == 0:
            raise ValueError("nothing to prefill")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(n, n + T, device=self.device)[None]
        x = F.embedding(ids, self.inner.embed_tokens.weight)  # [T, D]
        cos, sin = self._rope(x, positions)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [T, 1, d]
        mask = None
        if n:  # the new tokens see every cached one and the new ones up to themselves
            mask = torch.ones(T, n + T, dtype=torch.bool, device=self.device).tril(diagonal=n)
        keys, values = [], []
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)  # q [T, H, d], k v [T, KV, d]
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KV, T, d]
            if row is not None:
                k = torch.cat([row.keys[layer], k], dim=1)
                v = torch.cat([row.values[layer], v], dim=1)
            else:
                k, v = k.contiguous(), v.contiguous()
            keys.append(k)
            values.append(v)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                  is_causal=mask is None, scale=self.scale, enable_gqa=True)
            x = w["o"](attn[0].transpose(0, 1).reshape(T, -1), residual=x)
            x = self._mlp(w, x)
        return self._logits(x[-1:])[0], RowCaches([RowKV(keys, values)])

    # ---------------------------------------------------------------- decode
    def step(self, batch: SlotBatch, tokens: list[int]) -> tuple[Tensor, None]:
        """Feed one token per row of ``batch`` (``tokens[i]`` to ``batch.rows[i]``): logits [rows, V] (float32), and
        no routing (these policies are dense)."""
        batch.reserve_step()
        B = len(batch)
        positions = batch.lengths  # the new token's position: the tokens before it
        seen = positions + 1  # what each row attends to, the new token included
        x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=self.device), self.inner.embed_tokens.weight)
        cos, sin = self._rope(x[:, None], positions[:, None])
        cos, sin = cos[:, 0, None], sin[:, 0, None]  # [B, 1, d]
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)  # q [B, H, d], k v [B, KV, d]
            batch.write(layer, k, v)
            attn = decode_attention(q, batch.keys[layer], batch.values[layer], seen, self.scale, self.use_kernel)
            x = w["o"](attn.reshape(B, -1), residual=x)
            x = self._mlp(w, x)
        batch.advance()
        return self._logits(x), None
