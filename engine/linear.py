"""Linear layers of a decode step (a few rows): the C kernel engine/kernels/small_gemm.c on weights packed for it,
or ``linear_reference``, torch's own ops on the unpacked weight.

``Linear.of(weight, bias)`` packs a bf16 ``[N, K]`` weight once (the decoder packs again after every weight load);
``Linear.__call__(x, residual=None, out_f32=False, norm=None, gated=False)`` computes ``x' W^T + bias`` in the
weight's dtype (rounded to bf16, then added to ``residual`` and rounded again where given: transformers' order),
widened to float32 with ``out_f32`` (logits: what ``HFPolicy`` returns, a bf16 model's logits as floats). ``x'`` is
``x``, or with ``norm=(weight, eps)`` the RMSNorm of x (``rms_norm``), or with ``gated`` ``silu(x[:, :K]) * x[:, K:]``
(the gated MLP's input to its down projection): the kernel prepares those rows itself, which saves a decode step of
SmolLM2 90 small torch ops.
The kernel takes bf16 on a CPU with AVX-512 BF16 and up to ``MAX_ROWS`` rows; anything else (float32 weights, a
prefill's many rows, another CPU, no compiler) takes the reference, so a ``Linear`` is always usable.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native

MAX_ROWS = 64  # above this a linear layer is compute-bound and torch's GEMM is the faster one
BLOCK = 32  # columns per packed block (the kernel's tile width)

def _kernel():
    """engine/kernels/small_gemm.c's ``small_gemm_bf16`` (None where it is not built, or the CPU has no AVX-512 BF16)."""
    available = native.function("small_gemm_available", (), ctypes.c_int)
    if available is None or not available():
        return None
    return native.function("small_gemm_bf16", (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                                ctypes.c_int), ctypes.c_int)


def kernel_available() -> bool:
    return _kernel() is not None


def pack(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N / 32), K / 2, 32, 2]: column blocks of 32, each k pair of a column adjacent (zero columns
    pad the last block)."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, k)
    padded[:n] = weight
    return padded.view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: statistics in float32, the normalised row rounded to x's dtype, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
                     out_f32: bool = False, norm: tuple[Tensor, float] | None = None, gated: bool = False) -> Tensor:
    """``Linear``'s definition in torch ops."""
    if norm is not None:
        x = rms_norm(x, *norm)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight, bias)
    if out_f32:
        return y.float()  # rounded to the weight's dtype first, as the model's own lm_head computes
    return y if residual is None else residual + y


@dataclass
class Linear:
    weight: Tensor  # [N, K], the model's own tensor (not a copy)
    bias: Tensor | None
    packed: Tensor | None  # pack(weight), where the kernel can take it

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None = None, use_kernel: bool = True) -> Linear:
        weight = weight.detach()
        fits = (use_kernel and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.shape[1] % 2 == 0 and _kernel() is not None)
        return cls(weight, None if bias is None else bias.detach(), pack(weight) if fits else None)

    def __call__(self, x: Tensor, residual: Tensor | None = None, out_f32: bool = False,
                 norm: tuple[Tensor, float] | None = None, gated: bool = False) -> Tensor:
        """x [M, K] ([M, 2K] gated) -> [M, N]."""
        if self.packed is None or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype != torch.bfloat16:
            return linear_reference(x, self.weight, self.bias, residual, out_f32, norm, gated)
        x = x.contiguous()
        M, N, K = x.shape[0], self.weight.shape[0], self.weight.shape[1]
        prep, prep_w, eps = 0, 0, 0.0
        if norm is not None:
            prep, prep_w, eps = 1, norm[0].contiguous().data_ptr(), float(norm[1])
        elif gated:
            prep = 2
        out = torch.empty(M, N, dtype=torch.float32 if out_f32 else torch.bfloat16)
        if residual is not None:
            residual = residual.contiguous()
        failed = _kernel()(x.data_ptr(), M, K, self.packed.data_ptr(), N,
                           0 if self.bias is None else self.bias.data_ptr(),
                           0 if residual is None or out_f32 else residual.data_ptr(), out.data_ptr(), 2 if out_f32 else 0,
                           prep, prep_w, eps, torch.get_num_threads())
        if failed:
            raise RuntimeError("small_gemm refused its arguments")
        return out
