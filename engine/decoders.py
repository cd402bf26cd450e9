"""The interface ``EngineCore`` runs a policy through, and which implementation it gets (``engine.decoder``).

A decoder answers ``prefill(items) -> forwards`` (each ``Prefill`` item gets its logits and cache), ``new_batch()``
(a decode batch: ``rows``, ``add``, ``remove``, ``clear``), ``step(batch, tokens) -> (logits, routing)`` and
``refresh()`` (after a weight load), and says whether its caches cut to a prefix (``prefix_caching``: the engine
then shares prompt prefixes between episodes).

- ``ModelDecoder``: the policy's own ``forward`` with left-padded prefills and the merged decode batch
  (engine/batch.py); any policy, and the reference of the fused path;
- ``LlamaDecoder`` (engine/llama.py): the fused path for Llama-family Hugging Face policies.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .batch import DecodeBatch, Prefill, prefill
from .llama import LlamaDecoder, unsupported

DECODERS = ("auto", "fused", "model")


class ModelDecoder:
    """The engine's prefill and decode through the policy's own ``forward`` (any policy; the reference of the fused
    path)."""

    prefix_caching = False  # K3's recurrent state and padded HF caches do not cut to a prefix

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device

    def prefill(self, items: list[Prefill]) -> int:
        return prefill(self.model, items, self.device)

    def new_batch(self) -> DecodeBatch:
        return DecodeBatch()

    def step(self, batch: DecodeBatch, tokens: list[int]) -> tuple[Tensor, Tensor | None]:
        return batch.step(self.model, tokens, self.device)

    def refresh(self) -> None:
        """Nothing to do after a weight load: the forward reads the model's weights where they are."""



def make_decoder(model: nn.Module, device: torch.device, kind: str = "auto"):
    """``engine.decoder``: ``fused`` the fused path (engine/llama.py; an error for a policy it does not cover),
    ``model`` the policy's own forward, ``auto`` the fused path where it covers the policy and the engine is on a CPU
    (its kernels are CPU code; on a GPU the fused path runs their torch references, unmeasured there yet)."""
    if kind not in DECODERS:
        raise ValueError(f"engine.decoder must be one of {', '.join(DECODERS)}, not {kind!r}")
    if kind == "fused" or (kind == "auto" and device.type == "cpu"):
        reason = unsupported(model)
        if reason is None:
            return LlamaDecoder(model)
        if kind == "fused":
            raise ValueError(f"engine.decoder fused does not cover this policy: {reason}; use auto or model")
    return ModelDecoder(model, device)
