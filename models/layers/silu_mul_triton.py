"""The SwiGLU activation silu(gate) * up as one Triton kernel (GPU).

Plain reference: ``mlp.silu_and_mul`` (which rounds silu(gate) to the input dtype before the
product; this kernel rounds once, at the end: the two agree to bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [n, 2*I] (gate | up) -> [n, I]"""
    n, width = x.shape
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul_triton needs rows with unit stride")
    inter = width // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n:
        _silu_mul_kernel[(n, triton.cdiv(inter, BLOCK))](x, out, x.stride(0), out.stride(0), inter, BLOCK=BLOCK,
                                                          num_warps=4, **pdl_launch())
    return out
