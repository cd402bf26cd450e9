"""Any local Hugging Face causal LM as a sandforge policy: the model, its tokenizer and its own chat template.

``HFPolicy`` answers ``forward`` like the built-in model (``HFOutput``, shaped like ``K3Output``: fp32 logits, a cache
with ``select``, the router aux loss), so ``generate`` and ``token_logprobs`` work unchanged.

Its chat template is ``HFChatFormat`` (models/hf_chat.py); ``load_hf_policy`` gives both.

No hub access: everything loads with ``local_files_only=True``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .hf_chat import HFChatFormat
from .hf_kv_cache import cat_into_room, has_room_layers, rows_into_room, with_room_layers


# ---------------------------------------------------------------- model
@dataclass
class HFPolicyConfig:
    """What sandforge reads from a policy's config; the model's own config stays at ``HFPolicy.hf_config``."""

    vocab_size: int
    max_seq_len: int | None


@dataclass
class HFCache:
    """HF ``past_key_values`` plus the attention mask of every cached position ([B, S]), like ``KVCache``."""

    past: Any
    mask: Tensor
    fast: bool = True  # compact by slicing where rows end in their tokens; False: always the gather (the reference)

    @property
    def seq_len(self) -> int:
        return self.mask.shape[1]

    def select(self, rows: Tensor) -> HFCache:
        """The cache of batch rows ``rows`` only. The original is left intact (layers are copied shallowly, and HF
        caches replace their tensors rather than write into them)."""
        past = copy.copy(self.past)
        if hasattr(past, "layers"):  # transformers >= 4.54: a list of cache layers
            past.layers = [copy.copy(layer) for layer in past.layers]
        elif hasattr(past, "key_cache"):  # older DynamicCache: parallel lists of tensors
            past.key_cache, past.value_cache = list(past.key_cache), list(past.value_cache)
        elif isinstance(past, tuple):  # legacy tuple of (k, v) per layer
            return HFCache(tuple(tuple(t[rows] for t in kv) for kv in past), self.mask[rows], self.fast)
        past.batch_select_indices(rows)
        for layer in getattr(past, "layers", ()):
            if hasattr(layer, "room"):  # its keys are new tensors now: the original's buffer is not its own
                layer.room = None
        return HFCache(past, self.mask[rows], self.fast)

    def _kv(self) -> list[tuple[Tensor, Tensor]]:
        """(keys, values) per layer, each [B, heads, S, head_dim]."""
        past = self.past
        if hasattr(past, "layers"):
            return [(layer.keys, layer.values) for layer in past.layers]
        if hasattr(past, "key_cache"):
            return list(zip(past.key_cache, past.value_cache))
        return [(k, v) for k, v in past]

    def _with_kv(self, kv: list[tuple[Tensor, Tensor]], mask: Tensor, rooms: list | None = None) -> HFCache:
        """A new cache object of the same kind holding ``kv``; this one is left intact. ``rooms``: the buffers ``kv``
        are views of, one per layer (room layers only)."""
        past = copy.copy(self.past)
        if hasattr(past, "layers"):
            past.layers = [copy.copy(layer) for layer in past.layers]
            for i, (layer, (k, v)) in enumerate(zip(past.layers, kv)):
                layer.keys, layer.values = k, v
                if hasattr(layer, "room"):  # a copy must not keep the original's buffer alive (or append into it)
                    layer.room = rooms[i] if rooms is not None else None
        elif hasattr(past, "key_cache"):
            past.key_cache, past.value_cache = [k for k, _ in kv], [v for _, v in kv]
        else:
            past = tuple((k, v) for k, v in kv)
        return HFCache(past, mask, self.fast)

    @classmethod
    def cat(cls, caches: list[HFCache]) -> HFCache:
        """One batch from the rows of several caches: each left-padded (mask 0) to the longest. Positions come from the
        mask's cumsum, so padding shifts no row's positions. A fast cache of room layers is written straight into
        buffers with room after it (models/hf_kv_cache.py ``cat_into_room``), so the next token's append copies nothing."""
        width = max(c.seq_len for c in caches)
        pad = [width - c.seq_len for c in caches]
        left_pad = torch.nn.functional.pad
        mask = torch.cat([left_pad(c.mask, (p, 0)) for c, p in zip(caches, pad)])
        layers = list(zip(*(c._kv() for c in caches)))
        if caches[0].fast and has_room_layers(caches[0].past):
            rooms = [cat_into_room(keys, values, pad) for keys, values in (zip(*layer) for layer in layers)]
            return caches[0]._with_kv([(r.keys[:, :, :width], r.values[:, :, :width]) for r in rooms], mask, rooms)
        kv = [
            tuple(torch.cat([left_pad(t, (0, 0, p, 0)) for t, p in zip(ts, pad)]) for ts in zip(*layer))
            for layer in layers
        ]
        return caches[0]._with_kv(kv, mask)

    def compact(self) -> HFCache:
        """Each row's cached tokens moved to the right end, in order, and all-padding columns dropped. Keys carry
        their rotary positions already and new positions count real tokens, so attention is unchanged.

        A cache whose rows already end in their tokens (a decode batch, a fresh left-padded prefill) only drops its
        leading padding columns: a slice, copied when it drops any (a column copy is 7x faster than the gather on a
        CPU, and the copy lets the wider tensors go). Otherwise, and as the reference, ``compact_by_gather``."""
        if not self.fast or not _right_aligned(self.mask):
            return self.compact_by_gather()
        width = self.mask.shape[1]
        keep = int((self.mask != 0).sum(1).max()) if self.mask.numel() else 0
        if keep == width:
            return self
        return self._with_kv([(k[:, :, width - keep :].contiguous(), v[:, :, width - keep :].contiguous())
                              for k, v in self._kv()], self.mask[:, width - keep :].contiguous())

    def keep_rows(self, rows: list[int]) -> HFCache:
        """``select(rows).compact()``: the rows that stay in a decode batch. A fast cache of room layers whose rows end
        in their tokens (a decode batch's do) copies the kept columns straight into buffers with room after them
        (models/hf_kv_cache.py ``rows_into_room``), so the next token's append copies nothing; otherwise the two steps."""
        if not (self.fast and rows and has_room_layers(self.past) and _right_aligned(self.mask)):
            return self.select(torch.tensor(rows)).compact()
        idx = torch.tensor(rows)
        mask = self.mask[idx]
        keep = int((mask != 0).sum(1).max())
        start = self.seq_len - keep
        rooms = [rows_into_room(k, v, rows, start) for k, v in self._kv()]
        return self._with_kv([(r.keys[:, :, :keep], r.values[:, :, :keep]) for r in rooms],
                             mask[:, start:].contiguous(), rooms)

    def compact_by_gather(self) -> HFCache:
        """``compact`` for any layout: every row's tokens gathered to its right end (pads first, order kept)."""
        order = torch.argsort((self.mask != 0).to(torch.int8), dim=1, stable=True)  # pads first
        keep = int((self.mask != 0).sum(1).max()) if self.mask.numel() else 0
        order = order[:, order.shape[1] - keep :]

        def take(t: Tensor) -> Tensor:  # [B, heads, S, d] -> [B, heads, keep, d]
            return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))

        return self._with_kv([(take(k), take(v)) for k, v in self._kv()], self.mask.gather(1, order))

    @property
    def nbytes(self) -> int:
        return self.mask.nbytes + sum(k.nbytes + v.nbytes for k, v in self._kv())


def _right_padded(mask: Tensor) -> bool:
    """Whether every row's tokens are its first columns (all its padding after them)."""
    real = mask != 0
    return bool((real.to(torch.int8).cumprod(1).sum(1) == real.sum(1)).all())


def _right_aligned(mask: Tensor) -> bool:
    """Whether every row's cached tokens are its last columns (all its padding before them)."""
    real = mask != 0
    return bool((real.flip(1).to(torch.int8).cumprod(1).sum(1) == real.sum(1)).all())


@dataclass
class HFOutput:
    logits: Tensor  # [B, T, V] float32 ([B, K, V] with logits_at)
    cache: HFCache | None
    aux_loss: Tensor  # the model's router auxiliary loss (scaled by its own coefficient), or 0
    router_ids: Tensor | None  # HF models do not report routing
    hidden: Tensor | None = None  # [B, T, D] the last layer's (normed) hidden state, with return_hidden


class HFPolicy(nn.Module):
    """A local ``AutoModelForCausalLM`` behind the built-in policy's ``forward``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.hf_config = model.config
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(text.vocab_size)
        self.config = HFPolicyConfig(self.vocab_size, getattr(text, "max_position_embeddings", None))
        self._moe = hasattr(text, "router_aux_loss_coef") and hasattr(text, "output_router_logits")
        self.aux_loss_coef = float(getattr(text, "router_aux_loss_coef", 0.0))
        # the caches this forward fills append each token in place (models/hf_kv_cache.py) and compact by slicing where
        # they can; False: transformers' own DynamicLayer, which copies the whole cache every token, and compaction
        # by gather (the references, engine.kv_cache: reference)
        self.fast_cache = True
        # a right-padded batch without a cache (the trainer's scoring) runs without its padding mask: a causal model's
        # real tokens never attend to the pads after them, and transformers then takes SDPA's causal kernel, which
        # skips the blocks above the diagonal (bench/trainer.py padding_mask); what comes out at pad positions is then
        # unspecified. False: the mask always (the reference). Not for MoE configs: pads would route, and count in
        # the balance loss
        self.causal_right_padding = not self._moe

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFPolicy:
        from transformers import AutoModelForCausalLM

        kwargs.setdefault("dtype", torch.float32)
        return cls(AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs))

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(str(path))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: HFCache | None = None,
        use_cache: bool = False,
        return_hidden: bool = False,
        logits_at: Tensor | None = None,
    ) -> HFOutput:
        """input_ids [B, T] (left padding allowed) -> HFOutput(logits [B, T, V] fp32, cache, aux_loss, None). Outputs
        at pad positions are unspecified (``causal_right_padding``).

        Positions count real tokens only (cumsum of the mask), so a left-padded row sees the positions it would see
        alone and batched decoding equals unbatched. ``aux_loss`` is the router balance loss times
        ``router_aux_loss_coef`` on a full forward of an MoE config, else 0. ``logits_at`` [K]: logits [B, K, V] at
        those columns only (transformers' ``logits_to_keep``, so a model's own logit scaling or soft-capping holds).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.long()
        if cache is not None:
            mask = torch.cat([cache.mask.to(mask.device), mask], dim=1)
        model_mask = mask
        if (self.causal_right_padding and cache is None and not use_cache and position_ids is None
                and _right_padded(mask)):  # see __init__; a row's real tokens keep positions 0..n-1
            model_mask = None
            position_ids = torch.arange(mask.shape[1], device=mask.device)[None].expand(mask.shape[0], -1)
        if position_ids is None:
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
        want_aux = self._moe and cache is None and not use_cache
        extra = {"output_router_logits": True} if want_aux else {}
        if return_hidden:
            extra["output_hidden_states"] = True
        if logits_at is not None:
            extra["logits_to_keep"] = logits_at
        past = cache.past if cache is not None else None
        if use_cache and self.fast_cache:
            past = with_room_layers(past if past is not None else self._empty_cache())
        out = self.model(
            input_ids=input_ids,
            attention_mask=model_mask,
            position_ids=position_ids,
            past_key_values=past,
            use_cache=use_cache,
            **extra,
        )
        aux = getattr(out, "aux_loss", None)
        if want_aux and aux is not None:
            aux = self.aux_loss_coef * aux.float()
        else:
            aux = torch.zeros((), device=out.logits.device)
        new_cache = HFCache(out.past_key_values, mask, self.fast_cache) if use_cache else None
        hidden = out.hidden_states[-1].float() if return_hidden else None
        return HFOutput(logits=out.logits.float(), cache=new_cache, aux_loss=aux, router_ids=None, hidden=hidden)

    def _empty_cache(self) -> Any:
        """The cache transformers would make for this model (its layer kinds from the config), or None to let it."""
        try:
            from transformers import DynamicCache
        except ImportError:  # pragma: no cover
            return None
        return DynamicCache(config=self.hf_config)


def load_hf_policy(path: str, parser: str = "hermes", **model_kwargs: Any) -> tuple[HFPolicy, HFChatFormat]:
    """The model and chat format saved in the local directory ``path`` (no hub access)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return HFPolicy.from_pretrained(path, **model_kwargs), HFChatFormat(tokenizer, parser=parser)
