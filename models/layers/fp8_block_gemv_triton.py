"""One row of bf16 / fp16 activations times a block-FP8 weight without tensor cores (GPU; CUDA-graph capturable):
a batch-1 decode step's dense projections in one launch, no activation quantization.

Plain reference: ``fp8_block.block_fp8_linear_reference`` (the dequantized weight times x). e4m3 values are exact
in fp32, so each product here is the reference's; only the order of the fp32 sums differs.

Why: at one row the block-FP8 projections of DeepSeek-V3 ran far from their bytes on the H200 (#19; the slice's
batch-1 step, 2026-12-05-fp8-slice-shared-expert-pdl-ab-h200.json: q_a + kv_a and q_b_proj through the w8a8 GEMM
84 us for 50 of bytes a step, o_proj through ``scaled_mm`` 150 for 110, each behind an activation quantization
launch). The weight-only tensor-core GEMM (``fp8_block_w8a16_triton``) lost to the w8a8 path on an H100
(2026-12-06-w8a16-decode-kernels-slice-h100.json): its weight tiles go through the MMA's operand layout. A
GEMV needs no layout: as the bf16 GEMV (``linear_triton._gemv_kernel``) a program per ``BLOCK_N`` outputs
streams its [BLOCK_N, BLOCK_K] weight tiles, each converted to fp32 in registers and multiplied with the row of
x, the next tile loaded while one is multiplied. The block scale does not vary over a program's rows
(``BLOCK_N`` divides the format's bn), so it scales x instead of the tile: x[k] * scale_inv[row block, k // bk],
one multiply per column, not per weight. Under PDL (``pdl.py``) the first tile is read before waiting on the
kernel before.

``ROWS`` (0 or 1): the fast set's ``block_fp8_matmul`` routes one-row calls here (``fp8_block_gemm``). The A/B:
``--set models.layers.fp8_block_gemv_triton.ROWS=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_block import FP8_DTYPE, BlockFP8, block_fp8_linear_reference
from .pdl import pdl_launch, pdl_release, pdl_wait

# Rows up to which the fast kernel set takes this kernel (only one row is taken); 0: never.
ROWS = 0
# (BLOCK_N, BLOCK_K, warps): a tile of 8 rows x 2048 e4m3 columns is the bf16 GEMV's 16 KB.
BLOCK_N = 8
WARPS = 8


@triton.jit
def scaled_row(x_ptr, s_ptr, k0, rk, K, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr):
    """x[k0 + rk] in fp32 times the weight scale of each column's K block (``s_ptr``: the program's scale row)."""
    cols = k0 + rk
    if EVEN_K:
        x = tl.load(x_ptr + cols).to(tl.float32)
        s = tl.load(s_ptr + cols // GROUP_K)
    else:
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + cols // GROUP_K, mask=cols < K, other=0.0)
    return x * s


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, K, stride_wn, stride_sn,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Program n: outputs n * BLOCK_N.. of the one row, all of K in BLOCK_K steps (EVEN_K: BLOCK_K divides K, else
    the last step is masked)."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_N
    rn = first + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    s_row = s_ptr + (first // GROUP_N) * stride_sn
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=rk[None, :] < K, other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w_next = tl.load(w_ptrs + k)
        else:
            w_next = tl.load(w_ptrs + k, mask=rk[None, :] + k < K, other=0.0)
        xs = scaled_row(x_ptr, s_row, k - BLOCK_K, rk, K, GROUP_K, EVEN_K)
        acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
        w = w_next
    xs = scaled_row(x_ptr, s_row, (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K, rk, K, GROUP_K, EVEN_K)
    acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))


def block_k(k: int) -> int:
    """K columns a step for an input width k: 2048 (the bf16 GEMV's widest step) or the largest power of two
    from 256 that divides k, else one masked step of up to 1024 (as ``linear_triton.gemv_tile``)."""
    for bk in (2048, 1024, 512, 256):
        if k % bk == 0:
            return bk
    return min(1024, triton.next_power_of_2(k))


def supported(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
              fmt: BlockFP8, block_n: int | None = None) -> bool:
    """What the kernel takes: one contiguous bf16 / fp16 row, a contiguous e4m3 weight whose rows split into
    programs inside one scale row each (``block_n`` divides bn and N), fp32 scales, a bias of x's dtype."""
    bn = BLOCK_N if block_n is None else block_n
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and scale_inv.dtype == torch.float32
            and x.shape[1] == weight.shape[1] and weight.shape[0] % bn == 0 and fmt.block_n % bn == 0
            and (bias is None or (bias.dtype == x.dtype and bias.stride(-1) == 1)))


def block_fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
                          fmt: BlockFP8, block_n: int | None = None, block_k_: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """x [1, K] (bf16 / fp16) @ (weight e4m3 [N, K] with scale_inv [ceil(N/bn), ceil(K/bk)])^T (+ bias) -> [1, N]
    in x's dtype; what it does not take goes to the dequantized reference. ``block_n`` / ``block_k_`` /
    ``num_warps``: another launch (bench/fp8_gemm_tiles_probe.py --gemv)."""
    bn = BLOCK_N if block_n is None else block_n
    if not supported(x, weight, scale_inv, bias, fmt, bn):
        return block_fp8_linear_reference(x, weight, scale_inv, bias, fmt)
    n, k = weight.shape
    bk = block_k(k) if block_k_ is None else block_k_
    scale_inv = scale_inv.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(n // bn,)](
        x, weight, scale_inv, bias if bias is not None else y, y, k, weight.stride(0), scale_inv.stride(0),
        GROUP_N=fmt.block_n, GROUP_K=fmt.block_k, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        HAS_BIAS=bias is not None, num_warps=WARPS if num_warps is None else num_warps, **pdl_launch())
    return y
