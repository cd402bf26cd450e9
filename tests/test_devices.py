"""Device plumbing without a GPU: what a trainer rank builds for a micro-batch lands on the model's device (checked on
``meta``, where a tensor left on CPU would fail the forward), and an engine sharing a GPU gives its caches back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sandforge.models.packing import PackedLayout
from sandforge.trainer.batches import forward_scores, pad_right, token_batch
from sandforge.trainer.routing_replay import routed_ids
from sandforge.types import TrainingRow

ROWS = [TrainingRow(token_ids=[5, 6, 7, 8, 9], loss_mask=[1] * 5, routed_experts=[[[0, 1]]] * 5),
        TrainingRow(token_ids=[3, 4], loss_mask=[1] * 2)]


def test_batches_are_built_on_the_requested_device():
    ids, attn = token_batch(ROWS, "meta")
    assert ids.device.type == attn.device.type == "meta" and ids.shape == (2, 5)
    assert pad_right([[1.0], [2.0, 3.0]], 0.0, torch.float32, "meta").device.type == "meta"
    assert routed_ids(ROWS, 5, "meta").device.type == "meta"
    assert token_batch(ROWS)[0].device.type == "cpu"  # no device: CPU, as before


class DeviceCheckingPolicy(torch.nn.Module):
    """Stands in for a policy living on ``meta`` (the real ones branch on values, which meta tensors do not have):
    every tensor it is handed must be on ``meta`` too, as it would have to be on the rank's GPU."""

    pack_align = 16

    def __init__(self, vocab: int = 32, width: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width, device="meta")
        self.head = torch.nn.Linear(width, vocab, device="meta")
        self.seen: list[str] = []

    def forward(self, input_ids, attention_mask=None, return_hidden=False, **kwargs):
        from types import SimpleNamespace

        for name, t in {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}.items():
            if isinstance(t, torch.Tensor):
                assert t.device.type == "meta", f"{name} on {t.device}"
                self.seen.append(name)
        h = self.emb(input_ids)
        at = h if kwargs.get("logits_at") is None else h[:, kwargs["logits_at"]]
        return SimpleNamespace(logits=self.head(at), hidden=h, aux_loss=torch.zeros((), device="meta"))


@pytest.mark.parametrize("packed", [False, True])
def test_a_forward_takes_every_input_from_the_models_device(packed):
    """The padded and the packed forward (segment ids, packed rows, replayed routing) hand the policy only tensors on
    its device, and return scores in the padded layout."""
    model = DeviceCheckingPolicy()
    rows = [TrainingRow(token_ids=list(range(1, 1 + n)), loss_mask=[1] * n, routed_experts=[[[0, 1]]] * n)
            for n in (20, 9, 13)]
    lengths = [len(r.token_ids) for r in rows]
    layout = PackedLayout.pack(lengths, model.pack_align) if packed else PackedLayout.padded(lengths)
    forced = routed_ids(rows, 20, "meta")
    scores = forward_scores(model, rows, layout, 0.7, forced, device="meta", entropy="metric", hidden=True)
    assert scores.logprobs.device.type == "meta" and scores.logprobs.shape == (3, 20)
    assert scores.entropy.shape == (3, 20) and scores.hidden.shape == (3, 20, 8)
    assert {"input_ids", "forced_ids", "logits_at"} <= set(model.seen)
    assert ("segment_ids" in model.seen) == packed


def test_an_engine_releases_its_session_caches_on_request():
    """``release_memory`` (a colocated trainer is about to step) drops every idle cache; the session's next turn
    rebuilds it by prefilling its whole prompt, and its tokens are those of a fresh engine."""
    from test_engine import peaky_k3, request, serve

    model = peaky_k3(seed=2)

    async def turns(engine):
        [first] = await engine.generate(request([1, 2, 3], session_id="ep", max_tokens=4))
        follow = [1, 2, 3] + first.token_ids + [7, 8]
        held = engine.stats()["session_mb"]
        engine.release_memory()
        [second] = await engine.generate(request(follow, session_id="ep", max_tokens=4))
        return held, second, follow

    (held, second, follow), stats = serve(model, turns)
    assert held > 0 and second.cached_tokens == 0 and second.prefill_tokens == len(follow)
    [[fresh]], _ = serve(model, lambda e: asyncio.gather(e.generate(request(follow, max_tokens=4))))
    assert second.token_ids == fresh.token_ids
