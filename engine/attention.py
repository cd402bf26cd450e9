"""Decode attention over the slot layout (engine/blocks.py): one new query token a row, each row attending to its
own cached positions.

``decode_attention`` runs the C kernel (engine/kernels/decode_attention.c, built by engine/native.py) where it is
built and the tensors fit it, else ``attention_reference``: the same attention in torch ops (a copy of the used
positions, a mask, two matmuls), slower because a batched matmul copies a strided view whole before it starts and
reads these small per-head matrices far below the machine's bandwidth. tests/test_engine_llama.py ties the two.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import native

_KERNELS = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}


def _kernel(dtype: torch.dtype):
    """engine/kernels/decode_attention.c's function for ``dtype`` (None where there is none, or it is not built)."""
    if dtype not in _KERNELS:
        return None
    return native.function(_KERNELS[dtype], (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 5 + (ctypes.c_float,
                                                                                                ctypes.c_int),
                           ctypes.c_int)


def kernel_available(dtype: torch.dtype) -> bool:
    return _kernel(dtype) is not None


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scale: float,
                     use_kernel: bool = True) -> Tensor:
    """q [B, H, d] -> [B, H, d]: row b's query heads over keys and values [>= B, KV, capacity, d] at positions
    0 .. lengths[b] - 1 (query head j reads kv head j // (H / KV))."""
    fn = _kernel(q.dtype) if use_kernel and q.device.type == "cpu" else None
    if fn is None or not (keys.is_contiguous() and values.is_contiguous()):
        return attention_reference(q, keys, values, lengths, scale)
    B, H, d = q.shape
    q = q.contiguous()
    lengths = lengths.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    failed = fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), lengths.data_ptr(), out.data_ptr(), B, H,
                keys.shape[1], keys.shape[2], d, float(scale), torch.get_num_threads())
    if failed:
        raise MemoryError("decode attention could not allocate its scratch")
    return out


def attention_reference(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """Decode attention in torch ops: q [B, H, d] (query head j reads kv head j // G), keys and values
    [>= B, KV, >= max(lengths), d] with row b's positions 0 .. lengths[b] - 1 real -> [B, H, d]."""
    B, H, d = q.shape
    KV = keys.shape[1]
    width = int(lengths.max())
    k, v = keys[:B, :, :width], values[:B, :, :width]
    mask = torch.zeros(B, 1, 1, width, dtype=torch.float32, device=q.device)
    mask.masked_fill_((torch.arange(width, device=q.device)[None] >= lengths[:, None])[:, None, None], float("-inf"))
    scores = torch.matmul(q.reshape(B, KV, H // KV, d).float(), k.float().transpose(-1, -2)) * scale + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype).view(B, H, d)
