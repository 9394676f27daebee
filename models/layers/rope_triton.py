"""Rotary position embedding of q and k in one Triton launch (GPU; one program per token and head).

Plain reference: ``rotary.rope_reference`` (rotate-half, fp32 math, cos/sin of
position x inv_freq, output in the input dtype). Only full-width rotation (rotary_dim ==
head_dim, as Llama); q and k may be strided views of the fused qkv output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open


@triton.jit
def _rope_kernel(pos_ptr, inv_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_qot, stride_qoh, stride_kot, stride_koh, Q_HEADS: tl.constexpr, HALF: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_open(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freqs = pos * tl.load(inv_ptr + i)
    c = tl.cos(freqs)
    s = tl.sin(freqs)
    if h < Q_HEADS:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = qo_ptr + t * stride_qot + h * stride_qoh
    else:
        src = k_ptr + t * stride_kt + (h - Q_HEADS) * stride_kh
        dst = ko_ptr + t * stride_kot + (h - Q_HEADS) * stride_koh
    x1 = tl.load(src + i)
    x2 = tl.load(src + HALF + i)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(dst + i, (x1f * c - x2f * s).to(x1.dtype))
    tl.store(dst + HALF + i, (x2f * c + x1f * s).to(x1.dtype))


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [n]; q: [n, heads, d]; k: [n, kv_heads, d]; inv_freq: [d/2] fp32 -> fresh (q, k)"""
    n, q_heads, dim = q.shape
    half = inv_freq.shape[0]
    if 2 * half != dim or half & (half - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"rope_triton rotates whole power-of-two heads with unit stride; got head_dim {dim}, "
                         f"rotary_dim {2 * half}")
    positions = positions.contiguous()  # read at unit stride (a no-op for the engine's buffers)
    qo = torch.empty((n, q_heads, dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((n, k.shape[1], dim), dtype=k.dtype, device=k.device)
    if n:
        _rope_kernel[(n, q_heads + k.shape[1])](
            positions, inv_freq, q, k, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), Q_HEADS=q_heads, HALF=half, num_warps=1, **pdl_launch())
    return qo, ko
