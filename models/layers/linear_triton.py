"""Decode-sized matmuls y = x W^T (at most 16 rows of x) as one Triton kernel streaming W once (GPU).

Plain reference: ``torch.nn.functional.linear`` (cuBLAS), which also takes every other case:
more than 16 rows (prefill), a bias, or shapes the kernel's tiles do not divide. One program per
16 output features reads its [16, K] slice of W in [16, 256] tiles, pipelined 4 deep; x is
padded to 16 rows for ``tl.dot``. Opt-in (``Kernels.triton(skinny_matmul=True)``): measured on
an H200 under CUDA graphs it streams the Llama-3-8B weights at ~3.1 TB/s against cuBLAS's ~3.7
(~4.8 vs 4.1 ms of matmul per batch-1 token; bench/results/2026-11-30-decode-roofline-h200.json);
its loads are probably not software-pipelined (not checked on the device), the next thing to look at.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16
BLOCK_N = 16
BLOCK_K = 256
STAGES = 4
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter mis-multiplies bf16 matrices


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    rows = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rows)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [m, K]; weight: [N, K] -> [m, N]. The kernel for m <= 16 without bias; F.linear otherwise."""
    m, k = x.shape
    n = weight.shape[0]
    if (bias is not None or m > MAX_ROWS or m == 0 or k % BLOCK_K or n % BLOCK_N or x.stride(-1) != 1
            or weight.stride(-1) != 1 or x.dtype != weight.dtype):
        return F.linear(x, weight, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(n // BLOCK_N,)](x, weight, y, m, k, x.stride(0), weight.stride(0), y.stride(0),
                                           BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=_DOT_FP32,
                                           num_warps=4, num_stages=STAGES)
    return y
