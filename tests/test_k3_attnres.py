"""Block Attention Residuals: the uniform start, the softmax over sources, block bookkeeping, gradients."""

import torch
from torch import nn

from sandforge.models.k3.attnres import AttnResState, BlockAttnRes, attnres_mix, attnres_weights


def _sources(n, B=2, T=5, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, D, generator=g) * (i + 1) for i in range(n)]


def test_zero_query_is_uniform_mean():
    mix = BlockAttnRes(16)
    assert torch.equal(mix.query, torch.zeros(16))
    for n in (1, 2, 3, 5):
        src = _sources(n, seed=n)
        torch.testing.assert_close(mix(src), torch.stack(src).mean(0), rtol=1e-6, atol=1e-6)
    # a list and a stacked tensor are the same input
    src = _sources(3)
    assert torch.equal(mix(src), mix(torch.stack(src)))


def test_weights_sum_to_one_and_large_query_selects_one_source():
    norm = nn.RMSNorm(16, elementwise_affine=False)
    src = _sources(4)
    query = torch.randn(16)
    w = attnres_weights(src, query, norm)
    assert w.shape == (4, 2, 5)
    torch.testing.assert_close(w.sum(0), torch.ones(2, 5))
    assert (w > 0).all()
    # make source 2 point along a fixed direction at every token; a large query along it picks source 2 alone
    direction = torch.zeros(16)
    direction[3] = 1.0
    src[2] = direction.expand(2, 5, 16) * 7.0 + 0.01 * src[2]
    h = attnres_mix(src, 100.0 * direction, norm)
    torch.testing.assert_close(h, src[2], rtol=1e-5, atol=1e-5)


def test_state_follows_block_grouping():
    e = torch.full((1, 1, 2), 1.0)
    outs = [torch.full((1, 1, 2), float(10**i)) for i in range(1, 6)]  # o1=10, o2=100, ..., o5=1e5
    state = AttnResState(e, sublayers_per_block=2)
    expected = [
        [1.0],
        [1.0, 10.0],  # partial = o1
        [1.0, 110.0],  # block 1 = o1 + o2 closed, no partial yet
        [1.0, 110.0, 1000.0],
        [1.0, 110.0, 11000.0],
        [1.0, 110.0, 11000.0, 100000.0],
    ]
    for step, want in enumerate(expected):
        got = [s[0, 0, 0].item() for s in state.sources()]
        assert got == want, f"after {step} sublayers: {got} != {want}"
        if step < len(outs):
            state.add(outs[step])


def test_block_of_one_sublayer_keeps_every_output():
    e = torch.zeros(1, 1, 2)
    state = AttnResState(e, sublayers_per_block=1)
    for i in range(3):
        state.add(torch.full((1, 1, 2), float(i + 1)))
    assert [s[0, 0, 0].item() for s in state.sources()] == [0.0, 1.0, 2.0, 3.0]


def test_gradient_reaches_pseudo_query():
    torch.manual_seed(0)
    mix = BlockAttnRes(16)
    src = _sources(3)
    target = torch.randn(2, 5, 16)
    ((mix(src) - target) ** 2).mean().backward()
    assert mix.query.grad is not None and mix.query.grad.abs().sum() > 0
    # and a step on it moves the mix away from the uniform mean
    with torch.no_grad():
        mix.query -= 10.0 * mix.query.grad
    assert not torch.allclose(mix(src), torch.stack(src).mean(0), atol=1e-4)
