"""Sequence packing (models/packing.py): a packed forward computes what separate forwards compute, with fewer pads."""

from __future__ import annotations

import pytest
import torch

from sandforge.models.sampling import token_scores
from sandforge.models.k3.config import preset_config
from sandforge.models.k3.kda import kda_chunked
from sandforge.models.k3.naive import kda_naive
from sandforge.models.k3.model import K3Model
from sandforge.models.packing import PackedLayout
from sandforge.types import TrainingRow

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [150, 37, 64, 90, 5, 128, 70]  # cross chunk boundaries, exactly fill chunks, tiny ones


def _model(seed: int = 0) -> K3Model:
    torch.manual_seed(seed)
    model = K3Model(preset_config("k3-nano", vocab_size=300))
    model.eval()
    return model


def _sequences(lengths, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=g) for n in lengths]


def _padded_ids(seqs) -> torch.Tensor:
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids


def test_layout_first_fit_decreasing_and_never_wider_than_padding():
    layout = PackedLayout.pack(LENGTHS, align=64)
    assert layout.width == max(LENGTHS)
    assert layout.n_rows < len(LENGTHS)
    assert layout.slots < PackedLayout.padded(LENGTHS).slots
    seg = layout.segment_ids()
    for i, (r, o, n) in enumerate(zip(layout.rows, layout.offsets, LENGTHS)):
        assert o % 64 == 0 and o + n <= layout.width
        assert (seg[r, o : o + n] == i + 1).all()
    assert int((seg > 0).sum()) == sum(LENGTHS)  # no overlaps: every token has its own slot
    one = PackedLayout.pack([10], align=64)
    assert (one.n_rows, one.width) == (1, 10)


def test_pack_and_unpack_round_trip_with_gradients():
    layout = PackedLayout.pack(LENGTHS, align=64)
    x = torch.randn(len(LENGTHS), max(LENGTHS), 3)
    for i, n in enumerate(LENGTHS):
        x[i, n:] = 0
    x.requires_grad_(True)
    packed = layout.pack_tensor(x)
    assert packed.shape == (layout.n_rows, layout.width, 3)
    back = layout.unpack(packed * 2)
    assert torch.equal(back, 2 * x.detach())
    back.sum().backward()
    mask = torch.tensor([[t < n for t in range(max(LENGTHS))] for n in LENGTHS])
    assert torch.equal(x.grad, 2.0 * mask[..., None].float().expand_as(x))


def test_kda_chunk_reset_equals_separate_recurrences():
    torch.manual_seed(0)
    B, T, H, K, V, C = 1, 128, 2, 8, 8, 32
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v, g = torch.randn(B, T, H, V), -torch.rand(B, T, H, K)
    beta = torch.rand(B, T, H)
    reset = torch.tensor([[False, False, True, False]])  # a second sequence starts at token 64
    o, _ = kda_chunked(q, k, v, g, beta, chunk_size=C, reset=reset)
    first, _ = kda_naive(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64])
    second, _ = kda_naive(q[:, 64:], k[:, 64:], v[:, 64:], g[:, 64:], beta[:, 64:])
    torch.testing.assert_close(o, torch.cat([first, second], dim=1), atol=1e-5, rtol=1e-5)


def test_varlen_boundaries_of_packed_rows_give_what_chunk_resets_give():
    """What fla-core's varlen chunk_kda is handed on CUDA (``packed_cu_seqlens``: packed rows flattened into one
    sequence, one span per segment) computes what ``kda_chunked`` with chunk resets computes on the packed rows: each
    span run alone (as a varlen kernel does) equals it, pads included (they neither decay nor write the state)."""
    from sandforge.models.packing import packed_cu_seqlens

    torch.manual_seed(0)
    layout = PackedLayout.pack(LENGTHS, align=64)
    seg = layout.segment_ids()
    B, T, H, K, V = *seg.shape, 2, 8, 8
    real = (seg > 0)[..., None]
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1) * real[..., None]
    v, g = torch.randn(B, T, H, V) * real[..., None], -torch.rand(B, T, H, K) * real[..., None]
    beta = torch.rand(B, T, H) * real
    starts = torch.nn.functional.pad(seg, (1, 0))[:, :-1] != seg
    reset = (starts & (seg > 0))[:, ::64]
    packed, _ = kda_chunked(q, k, v, g, beta, chunk_size=64, reset=reset)
    cu = packed_cu_seqlens(seg).tolist()
    assert cu[0] == 0 and cu[-1] == B * T and len(cu) - 1 == len(LENGTHS) + sum(1 for r in range(B) if seg[r, 0] == 0)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    spans = [kda_naive(*(t[:, a:b] for t in flat))[0] for a, b in zip(cu, cu[1:])]
    torch.testing.assert_close(torch.cat(spans, dim=1).view(B, T, H, V), packed, atol=1e-5, rtol=1e-5)


def test_packed_k3_forward_and_backward_equal_separate_forwards():
    model = _model()
    seqs = _sequences(LENGTHS)
    layout = PackedLayout.pack(LENGTHS, align=model.pack_align)
    assert layout.n_rows < len(LENGTHS)
    ids = layout.pack_tensor(_padded_ids(seqs))
    out = model(ids, segment_ids=layout.segment_ids())
    logits = layout.unpack(out.logits)
    router = layout.unpack(out.router_ids)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    total = 0.0
    for i, s in enumerate(seqs):
        alone = model(s[None])
        torch.testing.assert_close(logits[i, : len(s)], alone.logits[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(router[i, : len(s)], alone.router_ids[0])
        total = total + (alone.logits * torch.linspace(-1, 1, logits.shape[-1])).sum()
    total.backward()
    assert packed_grads
    for name, p in model.named_parameters():
        if p.grad is not None:  # fp32 sums over ~500 tokens in another order: relative to the gradient's scale
            err = (packed_grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)
            assert err < 2e-5, (name, float(err))


def test_packed_token_scores_match_padded_ones():
    model = _model(3)
    seqs = _sequences(LENGTHS, seed=4)
    ids = _padded_ids(seqs)
    attn = (ids != 0).long()
    for i, s in enumerate(seqs):
        attn[i, : len(s)] = 1
    padded = token_scores(model, ids, attn, temperature=0.7, entropy=True, hidden=True)
    layout = PackedLayout.pack(LENGTHS, align=model.pack_align)
    packed = token_scores(model, layout.pack_tensor(ids), None, temperature=0.7, entropy=True, hidden=True,
                          segment_ids=layout.segment_ids())
    torch.testing.assert_close(layout.unpack(packed.logprobs), padded.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layout.unpack(packed.entropy), padded.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layout.unpack(packed.hidden), padded.hidden, atol=5e-5, rtol=1e-4)
    assert (layout.unpack(packed.logprobs)[:, 0] == 0).all()  # a sequence's first token has no prediction


def test_segment_inside_a_chunk_is_refused():
    model = _model()
    seg = torch.tensor([[1] * 10 + [2] * 10])
    with pytest.raises(ValueError, match="align=64"):
        model(torch.ones(1, 20, dtype=torch.long), segment_ids=seg)


class _Plain(torch.nn.Module):
    """Stands in for the DeepSpeed engine: ``engine(...)`` runs the policy, ``engine.module`` is the policy."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.module = policy

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.fixture(scope="module")
def rank():
    """A real DeepSpeed rank (ZeRO-2, CPU) on a small K3 policy, per-sequence loss aggregation."""
    import os

    from sandforge.config import ModelConfig, TrainerConfig
    from sandforge.job.fleet.lifecycle import free_port
    from sandforge.trainer.rank import RolloutShape, TrainerRank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = ModelConfig(arch="k3", preset="k3-nano", tokenizer="bytes",
                        k3=dict(d_model=32, n_heads=2, head_dim=16, d_ff=32, d_expert=16))
    cfg = TrainerConfig(lr=1e-3, grad_accum_steps=1, loss_agg="seq-mean-token-mean", kl_coef=0.1)
    return TrainerRank(0, 1, "127.0.0.1", free_port(), model, cfg, RolloutShape(temperature=0.9, response_budget=256),
                       seed=0, num_threads=1)


def _rows(n_vocab: int = 256) -> list[TrainingRow]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for i, n in enumerate(LENGTHS):
        prompt = max(1, n // 3)
        rows.append(TrainingRow(token_ids=torch.randint(1, n_vocab, (n,), generator=g).tolist(),
                                loss_mask=[0] * prompt + [1] * (n - prompt),
                                logprobs=(-torch.rand(n, generator=g) * 6).tolist(),  # off-policy: ratios, clipping
                                advantages=[(-1.0) ** i * (1 + i / 4)] * n))
    return rows


def test_packed_training_loss_stats_and_gradients_equal_padded(rank):
    from sandforge.trainer.algorithms import Totals

    rows = _rows()
    assert rank.layout(rows).n_rows < len(rows)  # packing is on and actually packs
    totals = Totals(tokens=sum(sum(r.loss_mask) for r in rows), sequences=len(rows))
    # gradients from a plain copy of the policy: DeepSpeed's own backward would reduce them into its buffers
    policy = K3Model(rank.engine.module.config)
    policy.load_state_dict(rank.engine.module.state_dict())
    engine, rank.engine = rank.engine, _Plain(policy)
    results = {}
    try:
        for pack in (False, True):
            rank.cfg.pack_sequences = pack
            policy.zero_grad()
            loss, stats, aux = rank._micro_batch_loss(rows, totals, "rl")
            (loss + aux).backward()
            grads = [None if p.grad is None else p.grad.clone() for p in policy.parameters()]
            results[pack] = (loss.detach(), {k: v.detach() for k, v in stats.sums.items()}, grads)
    finally:
        rank.engine, rank.cfg.pack_sequences = engine, True
    (loss_pad, stats_pad, grads_pad), (loss_pack, stats_pack, grads_pack) = results[False], results[True]
    torch.testing.assert_close(loss_pack, loss_pad, atol=1e-5, rtol=1e-5)
    assert stats_pack.keys() == stats_pad.keys() and "kl" in stats_pad and "clip_frac" in stats_pad
    for key in stats_pad:
        torch.testing.assert_close(stats_pack[key].double(), stats_pad[key].double(), atol=1e-5, rtol=1e-4,
                                   msg=key)
    assert sum(g is not None for g in grads_pad) > 20
    # fp32 sums taken in another order differ by ~1e-7 whatever a tensor's own scale (seen: 3.6e-7 on a bias whose
    # gradient is 8e-3), so the bound scales with the model's largest gradient; attention leaking across packed
    # sequences would change a tensor by a share of its own size, far more
    scale = max(float(b.abs().max()) for b in grads_pad if b is not None)
    for a, b in zip(grads_pack, grads_pad):
        if b is not None:
            assert float((a - b).abs().max()) <= 2e-5 * scale


def test_packed_scores_equal_padded(rank):
    rows = _rows()
    rank.cfg.pack_sequences = False
    padded = rank.score(rows)
    rank.cfg.pack_sequences = True
    packed = rank.score(rows)
    for a, b in zip(packed, padded):
        assert a.old_logprobs == pytest.approx(b.old_logprobs, abs=1e-5)
