"""Each CUDA fast path equals its reference, on the GPU: fla-core's chunk_kda (whole and packed/varlen) against
kda_chunked, grouped-GEMM experts against the loop over experts, MLA's maskless causal SDPA against the masked one."""

from __future__ import annotations

import pytest
import torch

from sandforge.models.k3.kda import KDA, fla_chunk_kda, kda_chunked
from sandforge.models.k3.naive import kda_naive
from sandforge.models.k3.latent_moe import LatentMoE
from sandforge.models.k3.mla import GatedMLA
from sandforge.models.packing import PackedLayout

CUDA = torch.device("cuda")


def kda_inputs(B, T, H, K, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1).to(dtype)
    return q, k, r(B, T, H, V).to(dtype), -5 * torch.sigmoid(r(B, T, H, K)), torch.sigmoid(r(B, T, H)), r(B, H, K, V) * 0.1


def test_fla_chunk_kda_equals_the_recurrence():
    chunk_kda = fla_chunk_kda()
    if chunk_kda is None:
        pytest.skip("fla-core is not installed")
    q, k, v, g, beta, h0 = kda_inputs(2, 300, 4, 64, 64, torch.float32)
    o_f, s_f = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_r, s_r = kda_naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, _ = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o_f - o_r).abs().max() < 1e-3 and (s_f - s_r).abs().max() < 1e-3
    assert (o_c - o_r).abs().max() < 1e-3


def test_packed_kda_layer_through_fla_equals_kda_chunked():
    """The trainer's packed forward: fla's varlen kernel (packed_cu_seqlens) against kda_chunked's chunk resets."""
    if fla_chunk_kda() is None:
        pytest.skip("fla-core is not installed")
    torch.manual_seed(0)
    layer = KDA(256, n_heads=4, head_k=64, head_v=64).to(CUDA)
    layout = PackedLayout.pack([150, 37, 64, 90, 5, 128, 70], align=layer.chunk_size)
    seg = layout.segment_ids(CUDA)
    x = torch.randn(*seg.shape, 256, device=CUDA)
    layer.use_fla = True
    fast, _ = layer(x, segment_ids=seg)
    layer.use_fla = False
    ref, _ = layer(x, segment_ids=seg)
    real = seg > 0
    assert (fast - ref)[real].abs().max() < 2e-3


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-4)])
def test_grouped_gemm_experts_equal_the_loop_on_cuda(dtype, tol):
    torch.manual_seed(1)
    moe = LatentMoE(512, n_experts=16, top_k=2, balancing="none").to(CUDA, dtype)
    x = torch.randn(4, 257, 512, device=CUDA, dtype=dtype)
    outs, grads = [], []
    for grouped in (False, True):
        moe.zero_grad()
        moe.grouped_mm = grouped
        xi = x.clone().requires_grad_()
        y = moe(xi).y
        y.float().square().mean().backward()
        outs.append(y.float())
        grads.append(xi.grad.float())
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol)
    assert torch.allclose(grads[0], grads[1], atol=tol, rtol=tol)


def test_maskless_mla_equals_the_masked_one_on_cuda():
    torch.manual_seed(2)
    layer = GatedMLA(1024, 8, 128, q_latent=512, kv_latent=256).to(CUDA, torch.bfloat16)
    x = torch.randn(4, 1024, 1024, device=CUDA, dtype=torch.bfloat16)
    fast, _ = layer(x)
    masked, _ = layer(x, torch.ones(4, 1024, device=CUDA))
    assert (fast.float() - masked.float()).abs().max() < 5e-2
