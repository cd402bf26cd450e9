"""Kimi Delta Attention: the chunked form against the token-by-token reference, the gated delta rule as a special
case, and the layer's decode cache and padding against full forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sandforge.models.k3.kda import KDA, KDACache, kda_chunked
from sandforge.models.k3.naive import kda_naive


def _inputs(B=2, T=75, H=3, K=16, V=24, seed=0, decay=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0) * decay  # <= 0, mostly mild
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent(chunk_size, with_state):
    q, k, v, g, beta, s0 = _inputs(T=75)  # 75: not a multiple of any chunk size
    s0 = s0 if with_state else None
    o_ref, s_ref = kda_naive(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    assert o.shape == (2, 75, 3, 24) and s.shape == (2, 3, 16, 24)
    assert (o - o_ref).abs().max() <= 1e-4
    assert (s - s_ref).abs().max() <= 1e-4
    assert kda_chunked(q, k, v, g, beta, chunk_size=chunk_size)[1] is None


@pytest.mark.parametrize("decay", [10.0, 15.0, 20.0, 30.0])
def test_chunked_is_stable_under_strong_decay(decay):
    # per-token log-decays down to -17 ... -52: a chunk of 64 decays by up to e^-3000, far past fp32's range, and the
    # chunked form falls back to sub-blocks of 8, 4, 2 and 1 tokens
    q, k, v, g, beta, s0 = _inputs(T=70, seed=1, decay=decay)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, scale=0.5, initial_state=s0, output_final_state=True)
    o, s = kda_chunked(q, k, v, g, beta, scale=0.5, initial_state=s0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert (o - o_ref).abs().max() <= 1e-4 and (s - s_ref).abs().max() <= 1e-4


def gated_delta_rule(q, k, v, a, beta, scale, s0):
    """Gated DeltaNet with one scalar decay a = log alpha per head and token, as matrices:
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t scale."""
    B, T, H, K = q.shape
    out = torch.zeros(B, T, H, v.shape[-1])
    final = torch.zeros_like(s0)
    for b in range(B):
        for h in range(H):
            S = s0[b, h].clone()
            for t in range(T):
                kt = k[b, t, h][:, None]  # [K,1]
                S = a[b, t, h].exp() * (torch.eye(K) - beta[b, t, h] * kt @ kt.T) @ S + beta[b, t, h] * kt @ v[b, t, h][None]
                out[b, t, h] = S.T @ q[b, t, h] * scale
            final[b, h] = S
    return out, final


def test_constant_decay_across_k_is_the_gated_delta_rule():
    q, k, v, g, beta, s0 = _inputs(B=1, T=40, H=2, K=8, V=8, seed=2)
    a = g[..., 0]  # [B,T,H], one decay per head
    o_ref, s_ref = gated_delta_rule(q, k, v, a, beta, 0.3, s0)
    o, s = kda_chunked(q, k, v, a[..., None].expand_as(g), beta, 0.3, s0, True, chunk_size=16)
    assert (o - o_ref).abs().max() <= 1e-4
    assert (s - s_ref).abs().max() <= 1e-4


def test_gradients_flow_through_chunked():
    q, k, v, g, beta, s0 = (t.requires_grad_() for t in _inputs(T=40))
    o, s = kda_chunked(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=16)
    (o.square().sum() + s.sum()).backward()
    for t in (q, k, v, g, beta, s0):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    # and they match the reference's gradients
    grads = [t.grad.clone() for t in (q, k, v, g, beta)]
    for t in (q, k, v, g, beta, s0):
        t.grad = None
    o, s = kda_naive(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    (o.square().sum() + s.sum()).backward()
    for got, t in zip(grads, (q, k, v, g, beta)):
        assert (got - t.grad).abs().max() <= 1e-3


def _layer(seed=0):
    torch.manual_seed(seed)
    return KDA(d_model=32, n_heads=2, head_k=16, head_v=8, chunk_size=16).eval()


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward():
    layer = _layer()
    x = torch.randn(2, 30, 32)
    full, _ = layer(x)
    y, cache = layer(x[:, :19], use_cache=True)  # prefill 19 (chunked, a partial chunk)
    steps = [y]
    for t in range(19, 30):  # then one token at a time (recurrent)
        y, cache = layer(x[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(y)
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-4
    # a second prefill continuing from a cache also agrees
    _, cache = layer(x[:, :10], use_cache=True)
    y, _ = layer(x[:, 10:], cache=cache)
    assert (y - full[:, 10:]).abs().max() <= 1e-4


@torch.no_grad()
def test_cache_repeat_interleave_clone_select_continue():
    layer = _layer(1)
    prompt = torch.randn(1, 12, 32)
    _, cache = layer(prompt, use_cache=True)
    n = 3
    conts = torch.randn(n, 5, 32)
    expected, _ = layer(torch.cat([prompt.expand(n, -1, -1), conts], 1))
    many = cache.repeat_interleave(n)
    assert many.state.shape == (3, 2, 16, 8) and many.conv_q.shape == (3, 3, 32) and many.conv_v.shape == (3, 3, 16)
    snapshot = many.clone()
    c = many
    for t in range(5):
        y, c = layer(conts[:, t : t + 1], cache=c, use_cache=True)
        assert (y[:, 0] - expected[:, 12 + t]).abs().max() <= 1e-4
    # the clone was not touched by decoding: continuing from it again gives the same outputs
    y, _ = layer(conts, cache=snapshot)
    assert (y - expected[:, 12:]).abs().max() <= 1e-4
    # select keeps rows: row 2 alone continues as before
    y, _ = layer(conts[2:3], cache=snapshot.select([2]))
    assert (y - expected[2:3, 12:]).abs().max() <= 1e-4
    assert isinstance(snapshot.select(torch.tensor([0, 2])), KDACache)


@torch.no_grad()
def test_left_padded_batch_equals_unpadded_rows():
    layer = _layer(2)
    lengths = [20, 13, 7]
    T = max(lengths)
    seqs = [torch.randn(1, n, 32) for n in lengths]
    x = torch.zeros(3, T, 32)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        x[i, T - n :] = s[0] + 0.0
        x[i, : T - n] = torch.randn(T - n, 32)  # junk in the pads must not matter either
        mask[i, T - n :] = 1
    y, cache = layer(x, mask=mask, use_cache=True)
    nxt = torch.randn(3, 1, 32)
    # pads in the middle (a row that sits out a decode step) change nothing either
    y_pad, cache_pad = layer(torch.randn(3, 1, 32), mask=torch.tensor([[1], [0], [1]]), cache=cache, use_cache=True)
    y2, _ = layer(nxt, cache=cache)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        ref, _ = layer(torch.cat([s, nxt[i : i + 1]], 1))
        assert (y[i, T - n :] - ref[0, :n]).abs().max() <= 1e-4
        assert (y2[i, 0] - ref[0, n]).abs().max() <= 1e-4
    y3, _ = layer(nxt[1:2], cache=cache_pad.select([1]))
    assert (y3 - y2[1:2]).abs().max() <= 1e-6


@torch.no_grad()
def test_pads_inside_a_prefill_are_skipped():
    # a continuation chunk that is left-padded after real tokens (next turn of a shorter row)
    layer = _layer(3)
    x = torch.randn(1, 16, 32)
    full, _ = layer(x)
    _, cache = layer(x[:, :6], use_cache=True)
    chunk = torch.cat([torch.randn(1, 4, 32), x[:, 6:]], 1)
    mask = torch.tensor([[0] * 4 + [1] * 10])
    y, cache2 = layer(chunk, mask=mask, cache=cache, use_cache=True)
    assert (y[:, 4:] - full[:, 6:]).abs().max() <= 1e-4
    _, cache_ref = layer(x, use_cache=True)
    assert (cache2.state - cache_ref.state).abs().max() <= 1e-4
    assert torch.equal(cache2.conv_k, cache_ref.conv_k)


def test_output_gate_shapes_and_backward():
    layer = _layer(4).train()
    x = torch.randn(2, 40, 32, requires_grad=True)
    y, cache = layer(x)
    assert y.shape == x.shape and cache is None and torch.isfinite(y).all()
    y.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # a closed output gate silences the layer
    with torch.no_grad():
        layer.gate_proj.weight.fill_(-1e4)
        closed, _ = layer(x.detach().abs() + 1.0)  # gate = sigmoid(-1e4 * positive) = 0
    assert y.abs().max() > 1e-3 and closed.abs().max() < 1e-6
