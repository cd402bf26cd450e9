"""Gated NoPE MLA: cached decoding equals the full forward, padding, no positional information, the latent cache."""

import pytest
import torch

from sandforge.models.k3.mla import GatedMLA, MLACache
from sandforge.models.k3.naive import mla_naive

D, H, HD, QL, KVL = 32, 4, 8, 16, 12


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return GatedMLA(D, H, HD, q_latent=QL, kv_latent=KVL).eval()


def _decode(layer, x, cache, absorb=False, mask=None):
    """Feed x [B, T, D] one token at a time onto cache; returns the outputs [B, T, D] and the grown cache."""
    ys = []
    for t in range(x.shape[1]):
        m = None if mask is None else mask[:, t : t + 1]
        y, cache = layer(x[:, t : t + 1], m, cache=cache, use_cache=True, absorb=absorb)
        ys.append(y)
    return torch.cat(ys, dim=1), cache


@torch.no_grad()
@pytest.mark.parametrize("absorb", [False, True])
def test_prefill_then_decode_equals_full_forward(layer, absorb):
    x = torch.randn(2, 11, D)
    full, _ = layer(x)
    y_pre, cache = layer(x[:, :6], use_cache=True, absorb=absorb)
    y_dec, cache = _decode(layer, x[:, 6:], cache, absorb=absorb)
    torch.testing.assert_close(torch.cat([y_pre, y_dec], 1), full, rtol=0, atol=1e-4)
    # the cache holds kv_latent floats per token (the normalised latent), not per-head K/V
    assert isinstance(cache, MLACache)
    assert cache.latent.shape == (2, 11, KVL) and cache.mask.shape == (2, 11) and cache.mask.dtype == torch.bool
    torch.testing.assert_close(cache.latent, layer.kv_norm(layer.wkv_down(x)))
    assert layer(x, use_cache=False)[1] is None


@torch.no_grad()
def test_reference_and_absorbed_tie(layer):
    x = torch.randn(3, 9, D)
    mask = torch.ones(3, 9)
    mask[1, :4] = 0
    mask[2, :] = 0  # an all-pad row stays finite
    ref = mla_naive(layer, x, mask)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(layer(x, mask)[0], ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer(x, mask, absorb=True)[0], ref, rtol=0, atol=1e-5)


@torch.no_grad()
def test_repeat_interleave_and_clone_continue(layer):
    prompt = torch.randn(2, 5, D)
    n = 3
    _, cache = layer(prompt, use_cache=True)
    samples = torch.randn(2 * n, 4, D)
    # one prompt -> n samples, each continued independently; compare with full forwards of prompt + sample
    y_dec, grown = _decode(layer, samples, cache.repeat_interleave(n))
    full, _ = layer(torch.cat([prompt.repeat_interleave(n, 0), samples], 1))
    torch.testing.assert_close(y_dec, full[:, 5:], rtol=0, atol=1e-4)
    # a clone continues on its own and leaves the original untouched
    branch = grown.clone()
    more = torch.randn(2 * n, 2, D)
    y_branch, branch = _decode(layer, more, branch)
    assert len(grown) == 9 and len(branch) == 11
    full2, _ = layer(torch.cat([prompt.repeat_interleave(n, 0), samples, more], 1))
    torch.testing.assert_close(y_branch, full2[:, 9:], rtol=0, atol=1e-4)
    # select keeps rows: continuing rows [4, 1] equals those rows of the batched continuation
    picked = grown.select([4, 1])
    y_pick, _ = _decode(layer, more[[4, 1]], picked)
    torch.testing.assert_close(y_pick, y_branch[[4, 1]], rtol=0, atol=1e-5)


@torch.no_grad()
def test_left_padded_batch_equals_unpadded_rows(layer):
    lengths = [7, 4, 1]
    T = max(lengths)
    rows = [torch.randn(1, n, D) for n in lengths]
    x = torch.zeros(len(rows), T, D)
    mask = torch.zeros(len(rows), T)
    for b, r in enumerate(rows):
        x[b, T - r.shape[1] :] = r[0]
        mask[b, T - r.shape[1] :] = 1
    x[mask == 0] = torch.randn(int((mask == 0).sum()), D) * 5  # pad content must not leak
    y_pre, cache = layer(x[:, :-2], mask[:, :-2], use_cache=True)  # prefill, then decode the last two tokens
    y_dec, _ = _decode(layer, x[:, -2:], cache, mask=mask[:, -2:])
    y = torch.cat([y_pre, y_dec], 1)
    assert torch.isfinite(y).all()
    for b, r in enumerate(rows):
        alone, _ = layer(r)
        torch.testing.assert_close(y[b, T - r.shape[1] :], alone[0], rtol=0, atol=1e-4)


@torch.no_grad()
def test_no_positional_information(layer):
    x = torch.randn(2, 10, D)
    y, _ = layer(x)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(perm, torch.arange(9))
    x_perm = torch.cat([x[:, perm], x[:, 9:]], 1)  # shuffle the prefix, keep the last token
    y_perm, _ = layer(x_perm)
    torch.testing.assert_close(y_perm[:, -1], y[:, -1], rtol=0, atol=1e-5)
    # earlier queries do see a different (causal) prefix, so the test can tell
    assert not torch.allclose(y_perm[:, :-1], y[:, :-1], atol=1e-3)


def test_gradients_flow_through_all_projections(layer):
    x = torch.randn(2, 6, D, requires_grad=True)
    layer(x)[0].square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_the_maskless_causal_path_equals_the_masked_one(layer):
    """No mask and no cache: SDPA's is_causal path (flash attention on GPU) against an explicit all-real mask, forward
    and backward."""
    x = torch.randn(2, 13, D, requires_grad=True)
    y_fast, _ = layer(x)
    g_fast, = torch.autograd.grad(y_fast.square().sum(), x)
    y_mask, _ = layer(x, torch.ones(2, 13))
    g_mask, = torch.autograd.grad(y_mask.square().sum(), x)
    torch.testing.assert_close(y_fast, y_mask, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_fast, g_mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_fast.detach(), mla_naive(layer, x.detach()), atol=1e-5, rtol=1e-5)
