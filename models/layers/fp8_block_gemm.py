"""The fast kernel set's block-FP8 linear: cuBLASLt's blockwise ``scaled_mm`` where it measured faster
than the project's Triton GEMM, the Triton GEMM elsewhere. Plain reference: ``fp8_block.block_fp8_linear_w8a8_reference``.

The rule comes from the GEMM tables of two H200 runs of ``bench/fp8_slice.py`` (DeepSeek-V3's dense shapes
at M = 1 … 4096, bench/results/2026-12-01-fp8-slice-h200.json and 2026-12-02-fp8-slice-h200.json, the same
winner in both): ``scaled_mm`` at M >= 256 on every shape it takes (e.g. ``o_proj`` at M = 4096: 1.06 vs
1.80 ms, ``q_b_proj`` 0.31 vs 0.63 ms), and at every M on the one long-K shape (``o_proj``, K = 16384: 47.6
vs 62.6 us at M = 1); the Triton GEMM at M <= 64 on the others (``kv_b_proj`` at M = 1: 9.2 vs 18.6 us).
Shapes ``scaled_mm`` does not take (``fp8_block_cublas.supported``: whole 128 x 128 blocks only, e.g.
``kv_a_proj_with_mqa``'s N = 576) always go to Triton. One row (a batch-1 decode step) goes to
``fp8_block_gemv_triton``'s GEMV before any of them (bf16 / fp16 x as it is, no quantization launch, no tensor cores:
o_proj 44.3 against 56.8 us through ``scaled_mm`` on an H100, 2026-12-07-fp8-gemv-words-slice-h100.json), where its
``ROWS`` is 1 (the default); decode rows up to ``fp8_block_w8a16_triton.ROWS`` (0: off) to the weight-only
tensor-core kernel.
"""

from __future__ import annotations

import torch

from . import fp8_block_cublas, fp8_block_gemv_triton, fp8_block_w8a16_triton
from .fp8_block import FP8_DTYPE, BlockFP8
from .fp8_block_triton import block_fp8_linear_triton

SCALED_MM_MIN_ROWS = 256
SCALED_MM_MIN_K = 8192


def prefers_scaled_mm(m: int, n: int, k: int, fmt: BlockFP8) -> bool:
    """Whether y = x [m, k] @ W [n, k]^T runs through ``scaled_mm`` (pure: shapes only)."""
    return fp8_block_cublas.supported(fmt, n, k) and (m >= SCALED_MM_MIN_ROWS or k >= SCALED_MM_MIN_K)


def block_fp8_linear_fast(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                          bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ (weight e4m3 [N, K] with scale_inv)^T (+ bias) -> [M, N] in x's dtype."""
    if x.dim() == 2 and x.shape[0] <= fp8_block_gemv_triton.ROWS and fp8_block_gemv_triton.supported(
            x, weight, scale_inv, bias, fmt):
        return fp8_block_gemv_triton.block_fp8_gemv_triton(x, weight, scale_inv, bias, fmt)
    if x.dim() == 2 and x.shape[0] <= fp8_block_w8a16_triton.ROWS and fp8_block_w8a16_triton.supported(
            x, weight, scale_inv, fmt):
        return fp8_block_w8a16_triton.block_fp8_linear_w8a16_triton(x, weight, scale_inv, bias, fmt)
    if (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == FP8_DTYPE
            and prefers_scaled_mm(x.shape[0], weight.shape[0], weight.shape[1], fmt)):
        return fp8_block_cublas.block_fp8_linear_cublas(x, weight, scale_inv, bias, fmt)
    return block_fp8_linear_triton(x, weight, scale_inv, bias, fmt)
