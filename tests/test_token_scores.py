"""Scoring only the loss-mask tokens (models/sampling.py ``score_mask``) equals scoring every token and masking: the
same log-probs, entropies and hidden states, and the same gradients, for the built-in and a Hugging Face policy, in
the padded and the packed layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from sandforge.models.hf import HFPolicy
from sandforge.models.k3.config import preset_config
from sandforge.models.k3.model import K3Model
from sandforge.models.packing import PackedLayout
from sandforge.models.sampling import score_columns
from sandforge.trainer.batches import forward_scores
from sandforge.types import TrainingRow

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 300


def _k3() -> K3Model:
    torch.manual_seed(0)
    return K3Model(preset_config("k3-nano", vocab_size=VOCAB)).eval()


def _hf() -> HFPolicy:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=256)
    return HFPolicy(transformers.AutoModelForCausalLM.from_config(config)).eval()


def _rows(seed: int = 1) -> list[TrainingRow]:
    """Agentic shapes: a prompt, then policy turns between tool outputs; one row has nothing to learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for turns in ([(40, 12), (30, 20)], [(64, 9)], [(25, 30), (10, 5), (8, 16)], [(50, 0)]):
        mask: list[int] = []
        for outside, policy in turns:
            mask += [0] * outside + [1] * policy
        ids = torch.randint(1, VOCAB, (len(mask),), generator=g).tolist()
        rows.append(TrainingRow(token_ids=ids, loss_mask=mask))
    return rows


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _scores_and_grads(model, rows, layout, all_tokens):
    model.zero_grad()
    s = forward_scores(model, rows, layout, 0.7, entropy=True, hidden=True, all_tokens=all_tokens)
    mask = torch.tensor([r.loss_mask + [0] * (s.logprobs.shape[1] - len(r.loss_mask)) for r in rows]).float()
    weights = torch.linspace(-1, 1, mask.numel()).view_as(mask)  # advantages of either sign
    ((s.logprobs * weights * mask).sum() + (s.entropy * mask).sum() * 0.1).backward()
    return s, mask, _grads(model)


@pytest.mark.parametrize("make,packed", [(_k3, False), (_k3, True), (_hf, False)], ids=["k3", "k3-packed", "hf"])
def test_scoring_the_loss_mask_equals_scoring_every_token(make, packed):
    model, rows = make(), _rows()
    lengths = [len(r.token_ids) for r in rows]
    layout = PackedLayout.pack(lengths, model.pack_align) if packed else PackedLayout.padded(lengths)
    ref, mask, ref_grads = _scores_and_grads(model, rows, layout, all_tokens=True)
    fast, _, fast_grads = _scores_and_grads(model, rows, layout, all_tokens=False)
    torch.testing.assert_close(fast.logprobs, ref.logprobs * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.entropy, ref.entropy * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
    assert (fast.logprobs[mask.bool()] < 0).all()  # every policy token was scored, none left at 0
    assert ref_grads.keys() == fast_grads.keys() and ref_grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_the_forward_computes_logits_only_where_a_policy_token_is_predicted():
    """The saving itself: the model is asked for the columns that predict a loss-mask token, no others."""
    model, rows = _k3(), _rows()
    shapes = []

    def recording(*args, **kwargs):
        out = model(*args, **kwargs)
        shapes.append(tuple(out.logits.shape))
        return out

    forward_scores(recording, rows, PackedLayout.padded([len(r.token_ids) for r in rows]))
    width = max(len(r.token_ids) for r in rows)
    wanted = sorted({t - 1 for r in rows for t, m in enumerate(r.loss_mask) if m})
    mask = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in rows], dtype=torch.bool)
    assert score_columns(mask).tolist() == wanted
    assert shapes == [(len(rows), len(wanted), VOCAB)] and len(wanted) < width - 1


def test_a_batch_with_nothing_to_score_still_backpropagates():
    """A rank's stand-in row (no loss tokens) keeps a graph, so every rank runs the same backward."""
    model = _k3()
    row = TrainingRow(token_ids=[0, 0], loss_mask=[0, 0])
    s = forward_scores(model, [row], PackedLayout.padded([2]))
    assert (s.logprobs == 0).all() and s.logprobs.requires_grad
    (s.logprobs.sum() * 0).backward()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rows_sampled_at_different_temperatures_are_each_scored_at_their_own(packed):
    """Episodes of environments with their own temperature share a micro-batch: each row's log-probs are those it
    gets scored alone at its temperature (a row without one takes the call's), in either layout."""
    from dataclasses import replace

    model = _k3()
    rows = [replace(r, temperature=t) for r, t in zip(_rows(), (1.0, None, 0.4, 1.0))]
    lengths = [len(r.token_ids) for r in rows]
    layout = PackedLayout.pack(lengths, model.pack_align) if packed else PackedLayout.padded(lengths)
    with torch.no_grad():
        mixed = forward_scores(model, rows, layout, 0.7, entropy="metric")
        for i, r in enumerate(rows):
            alone = forward_scores(model, [replace(r, temperature=None)], PackedLayout.padded([len(r.token_ids)]),
                                   0.7 if r.temperature is None else r.temperature, entropy="metric")
            n = len(r.token_ids)
            torch.testing.assert_close(mixed.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mixed.entropy[i, :n], alone.entropy[0, :n], atol=1e-5, rtol=1e-5)
        at_one = forward_scores(model, [replace(r, temperature=None) for r in rows], layout, 0.7)
    assert not torch.allclose(mixed.logprobs[0], at_one.logprobs[0])  # the row's own temperature was used
