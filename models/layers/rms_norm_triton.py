"""RMSNorm and residual add + RMSNorm as one Triton kernel each (GPU; one program per row).

Plain references: ``parallel/fused_allreduce_norm.py`` (``rms_norm``, ``add_rms_norm``); the
rounding follows them step by step (the sum rounded to the input dtype, fp32 statistics, the
normed row rounded, then times the weight), so the results agree to bf16 rounding
(tests/test_gpu_decode.py, and tests/test_triton_interpret.py on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm_triton needs rows with unit stride")
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(cols)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
                                  cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                  num_warps=8 if block >= 4096 else 4, **pdl_launch())
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight. x: [n, hidden] -> [n, hidden]"""
    out, _ = _launch(x, None, weight, eps)
    return out


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); both fresh. x, residual: [n, hidden]"""
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed
