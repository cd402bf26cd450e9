"""The small MoE decoder: padding invariance, causality, KV cache, routing, aux loss, checkpoints."""

import pytest
import torch

from sandforge.models.moe_lm import (
    KVCache,
    MoEConfig,
    MoETransformer,
    count_parameters,
    load_pretrained,
    save_pretrained,
)
from sandforge.models.naive import moe_naive


def tiny(seed=0, **overrides) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(MoEConfig(**{"d_model": 64, "d_ff": 96, "n_heads": 4, **overrides})).eval()


def pad_batch(seqs, left: bool, pad_id=0):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    return ids, mask


def real(t, mask):
    """Rows of t [B, T, ...] at real positions, as a list of [n_i, ...] tensors."""
    return [t[i][mask[i].bool()] for i in range(t.shape[0])]


SEQS = [[1, 5, 9, 200, 7, 7, 3], [42, 17], [257, 8, 100, 101, 102]]


def test_config_round_trip_and_validation():
    cfg = MoEConfig(n_layers=3, top_k=1)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    assert MoEConfig().to_dict()["vocab_size"] == 272
    with pytest.raises(ValueError, match="unknown MoEConfig keys"):
        MoEConfig.from_dict({"d_modle": 64})
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(top_k=5)


def test_output_shapes_and_dtypes():
    model = tiny()
    out = model(torch.randint(0, 272, (2, 9)))
    assert out.logits.shape == (2, 9, 272) and out.logits.dtype == torch.float32
    assert out.router_ids.shape == (2, 9, 2, 2) and out.router_ids.dtype == torch.long
    assert 0 <= out.router_ids.min() and out.router_ids.max() < 4
    assert (out.router_ids[..., 0] != out.router_ids[..., 1]).all()  # k distinct experts per token
    assert out.aux_loss.ndim == 0 and out.cache is None


def test_causal():
    model = tiny()
    ids = torch.randint(0, 272, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 272
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_left_and_right_padding_give_the_same_logits():
    model = tiny()
    left_ids, left_mask = pad_batch(SEQS, left=True)
    right_ids, right_mask = pad_batch(SEQS, left=False)
    left, right = model(left_ids, left_mask), model(right_ids, right_mask)
    for s, l, r, rl, rr in zip(
        SEQS, real(left.logits, left_mask), real(right.logits, right_mask),
        real(left.router_ids, left_mask), real(right.router_ids, right_mask),
    ):  # fmt: skip
        alone = model(torch.tensor([s]))
        torch.testing.assert_close(l, r, atol=1e-5, rtol=0)
        torch.testing.assert_close(l, alone.logits[0], atol=1e-5, rtol=0)
        assert torch.equal(rl, rr)
    # the aux loss counts real tokens only
    torch.testing.assert_close(left.aux_loss, right.aux_loss, atol=1e-6, rtol=0)


def test_explicit_position_ids():
    model = tiny()
    ids, mask = pad_batch(SEQS, left=True)
    default = model(ids, mask).logits
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    torch.testing.assert_close(model(ids, mask, position_ids=counted).logits, default, atol=0, rtol=0)
    assert not torch.allclose(model(ids, mask, position_ids=counted * 2).logits, default)  # RoPE is in use


def test_pad_keys_are_masked_out():
    model = tiny()
    ids, mask = pad_batch(SEQS, left=True, pad_id=0)
    other, _ = pad_batch(SEQS, left=True, pad_id=123)
    a, b = model(ids, mask).logits, model(other, mask).logits
    for x, y in zip(real(a, mask), real(b, mask)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    assert torch.isfinite(a).all()


def test_kv_cache_decoding_matches_full_forward():
    model = tiny(n_layers=3)
    full = [s + [11, 12, 13, 14] for s in SEQS]
    ids, mask = pad_batch(full, left=True)
    expected = model(ids, mask).logits
    P = ids.shape[1] - 4  # everything but the last 4 columns is the prompt
    out = model(ids[:, :P], mask[:, :P], use_cache=True)
    assert isinstance(out.cache, KVCache) and out.cache.seq_len == P
    assert out.cache.keys[0].shape == (3, 4, P, 16) and len(out.cache.values) == 3
    steps = [out.logits]
    cache = out.cache
    for t in range(P, ids.shape[1]):
        out = model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0)
    # dropping rows from the cache keeps the others intact
    rows = torch.tensor([2, 0])
    sub = model(ids[rows, -1:], mask[rows, -1:], cache=cache.select(rows)).logits
    nxt = model(ids[:, -1:], mask[:, -1:], cache=cache).logits
    torch.testing.assert_close(sub, nxt[rows], atol=1e-6, rtol=0)


def test_moe_layer_matches_per_token_reference():
    model = tiny(n_experts=6, top_k=3)
    moe = model.blocks[0].moe
    x = torch.randn(2, 5, 64)
    y, aux, ids = moe(x, torch.ones(2, 5, dtype=torch.bool))
    torch.testing.assert_close(y.reshape(-1, 64), moe_naive(moe, x.reshape(-1, 64)), atol=1e-5, rtol=1e-5)
    _, gates, _ = moe.route(x.reshape(-1, 64))
    torch.testing.assert_close(gates.sum(-1), torch.ones(10))


def test_aux_loss_trains_the_router():
    model = tiny().train()
    out = model(torch.randint(0, 272, (2, 16)))
    (out.logits.logsumexp(-1).mean() + out.aux_loss).backward()
    router = model.blocks[0].moe.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_aux_loss_is_coef_times_one_for_uniform_routing_and_grows_with_imbalance():
    model = tiny(aux_loss_coef=0.5)
    ids = torch.randint(0, 272, (2, 16))
    with torch.no_grad():
        for block in model.blocks:
            block.moe.router.weight.zero_()  # every expert equally likely
    torch.testing.assert_close(model(ids).aux_loss, torch.tensor(0.5))
    # every token the same and expert 0 almost certain: f_0 = 1/k, P_0 ~ 1, so the Switch loss is ~ E / k = 2
    moe = model.blocks[0].moe
    x = torch.randn(64).expand(1, 10, 64)
    with torch.no_grad():
        moe.router.weight[0] = 10 * x[0, 0]
    _, aux, _ = moe(x, torch.ones(1, 10, dtype=torch.bool))
    torch.testing.assert_close(aux, torch.tensor(2.0), atol=1e-3, rtol=0)


def test_save_and_load_round_trip(tmp_path):
    from sandforge.models.tokenizer import ByteTokenizer

    for tie in (True, False):
        model = tiny(tie_embeddings=tie)
        save_pretrained(model, tmp_path / str(tie), tokenizer=ByteTokenizer())
        loaded = load_pretrained(tmp_path / str(tie)).eval()
        assert loaded.config == model.config
        files = {p.name for p in (tmp_path / str(tie)).iterdir()}
        assert files == {"config.json", "model.safetensors", "tokenizer.json"}
        ids = torch.randint(0, 272, (2, 6))
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        load_pretrained(tmp_path / "nowhere")


def test_count_parameters():
    model = tiny()
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    untied = tiny(tie_embeddings=False)
    assert count_parameters(untied) - count_parameters(model) == 272 * 64
    model.embed.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == count_parameters(model) - 272 * 64
