"""Block-FP8 weights times bf16 / fp16 activations at decode rows, in Triton (Hopper / Ada; CUDA-graph capturable):
one launch, no activation quantization.

Plain reference: ``fp8_block.block_fp8_linear_reference`` (the dequantized weight times x): this kernel computes
the same products, only in another order — e4m3 values are exact in bf16 and fp16, so each K block's dot runs on
the weight's e4m3 values as they are, in fp32 sums, and its weight scale multiplies the block's sums after.

Why beside the w8a8 GEMM (``fp8_block_triton``): at 1..16 rows that GEMM is two launches (the per-token-group
quantization, then the GEMM) and its small matmuls ran far from their bytes on an H100
(2026-12-06-fp8-gemm-per-sm-h100.json: kv_a_proj_with_mqa 7.7 us for 1.4 us of bytes, q_a + kv_a 11.6 for 5.0,
q_b_proj 18.3 for 12.4, o_proj 51.4 for 38.7), which kept the DeepSeek-V3 slice's FP8 decode step at 65-77 % of
its byte roofline at batch 1-4 on the H200 (#19). Decode rows are memory-bound: the MMA's precision does not
matter there, the bytes do, and these are the FP8 weight's.

The launch: a program per BLOCK_N outputs and K split (``w8a16_launch``), the operands swapped as the bf16 decode
GEMM does (``linear_triton._decode_gemm_kernel``): acc^T [BLOCK_N, BLOCK_M] += (W tile in x's dtype) x^T, so the
weight's rows fill the MMA's wide side and the batch's rows (padded to 16) its narrow side; K in steps of the
format's bk, one weight scale per row block and step. K splits (few output tiles) store fp32 partials and the
tile's last program to finish adds them in split order (``arrival_counters``), as the w8a8 GEMM does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .arrival_counters import arrival_counters
from .fp8_block import FP8_DTYPE, BlockFP8, block_fp8_linear_reference
from .fp8_block_triton import _sm_count, k_splits

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter: dots in fp32 (exact for e4m3 values)

# Rows up to which the fast kernel set takes this kernel instead of the w8a8 GEMM (``fp8_block_gemm``); 0: never
# (the A/B: --set models.layers.fp8_block_w8a16_triton.ROWS=16). Off: slower than the w8a8 path
# on an H100 (bench/results/2026-12-06-w8a16-decode-kernels-slice-h100.json: the slice's batch-1 step 1.303 vs 1.244 ms).
ROWS = 0
# The launch: columns a program, programs a multiprocessor the K splits aim at, pipeline stages, warps.
BLOCK_N = 64
PER_SM = 2
STAGES = 4
WARPS = 4
MOST_SPLITS = 16


@triton.jit(do_not_specialize=["M"])  # counts that change call to call: one compile for all
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_blocks_per_split,
                  stride_xm, stride_wn, stride_sn, stride_om,
                  GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, SPLITS: tl.constexpr):
    """Program (n, s): outputs n * BLOCK_N.. of every row over the s-th of SPLITS K ranges; SPLITS > 1: fp32
    partials in ``ws`` [SPLITS, N, BLOCK_M], the tile's last program adds them in split order (an arrival count a
    tile in ``cnt``, reset by it), adds the bias and stores out; SPLITS = 1: it stores out itself."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    kb_first = split * k_blocks_per_split
    kb_last = tl.minimum(kb_first + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :] + kb_first * BLOCK_K
    x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None] + kb_first * BLOCK_K
    s_ptrs = s_ptr + (rn // GROUP_N).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for kb in range(kb_first, kb_last):
        k_ok = rk + kb * BLOCK_K < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        s = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        if DOT_FP32:
            part = tl.dot(w.to(tl.float32), x.to(tl.float32))
        else:
            part = tl.dot(w.to(x_ptr.dtype.element_ty), x)
        acc += part * s[:, None]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    ok = n_ok[:, None] & m_ok[None, :]
    dest = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part_ptrs = ws_ptr + rn[:, None].to(tl.int64) * BLOCK_M + rm[None, :]
        tl.store(part_ptrs + split.to(tl.int64) * N * BLOCK_M, acc, mask=n_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s_ in tl.static_range(SPLITS):
                total += tl.load(part_ptrs + s_ * N * BLOCK_M, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(dest, total.to(out_ptr.dtype.element_ty), mask=ok)


def w8a16_launch(n: int, k: int, block_k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, K splits, K blocks a split) for an [n, k] weight in bk = block_k columns: enough splits for
    ``PER_SM`` programs a multiprocessor, each at least two K blocks, at most ``MOST_SPLITS`` (the w8a8 GEMM's
    ``k_splits``), none empty."""
    tiles = -(-n // BLOCK_N)
    k_blocks = -(-k // block_k)
    splits = k_splits(tiles, k_blocks, sms, MOST_SPLITS, PER_SM)
    per_split = -(-k_blocks // splits)
    return BLOCK_N, -(-k_blocks // per_split), per_split


def supported(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFP8) -> bool:
    """What the kernel takes: 2-D bf16 / fp16 x of at most 16 rows (one MMA's narrow side), a contiguous e4m3
    weight with fp32 scales, bk a power of two >= 16 (one scale a K step)."""
    return (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and 0 < x.shape[0] <= 16
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and scale_inv.dtype == torch.float32
            and x.shape[1] == weight.shape[1] and fmt.block_k >= 16 and fmt.block_k & (fmt.block_k - 1) == 0)


def block_fp8_linear_w8a16_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                                  bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """x [M <= 16, K] (bf16 / fp16) @ (weight e4m3 [N, K] with scale_inv [ceil(N/bn), ceil(K/bk)])^T (+ bias)
    -> [M, N] in x's dtype; what it does not take goes to the dequantized reference."""
    if not supported(x, weight, scale_inv, fmt):
        return block_fp8_linear_reference(x, weight, scale_inv, bias, fmt)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, splits, per_split = w8a16_launch(n, k, fmt.block_k, _sm_count(x.device))
    tiles = -(-n // block_n)
    counters = arrival_counters(x.device, tiles) if splits > 1 else None
    if counters is None:
        splits, per_split = 1, -(-k // fmt.block_k)
    ws = torch.empty(splits, n, 16, dtype=torch.float32, device=x.device) if splits > 1 else out
    scale_inv = scale_inv.contiguous()
    _w8a16_kernel[(tiles, splits)](
        x, weight, scale_inv, bias if bias is not None else out, out, ws, counters if counters is not None else out,
        m, n, k, per_split, x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        GROUP_N=fmt.block_n, BLOCK_N=block_n, BLOCK_M=16, BLOCK_K=fmt.block_k, HAS_BIAS=bias is not None,
        DOT_FP32=_INTERPRET, SPLITS=splits, num_warps=WARPS, num_stages=STAGES)
    return out
