"""Block-scaled FP8 linear in Triton (Hopper / Ada; CUDA-graph capturable): two launches.

Plain references: ``fp8_block.block_fp8_linear_w8a8_reference`` (same maths) and
``block_fp8_linear_reference`` (the dequantized model). For y = x @ W^T with W [N, K] in e4m3 and
its scales [ceil(N/bn), ceil(K/bk)]:

1. ``_group_quant_kernel``, a program per row and ~1024 of its columns (before: per group of bk): s =
   max(|x|, 1e-10 x 448) / 448, q = x / s in e4m3 -> q [M, K], s [M, ceil(K/bk)] (sglang's per-token-group
   quantization). Quantizing inside the GEMM instead (each output tile its own rows at each K step) was
   slower on the H200 wherever it was tried — q_b_proj (384 column tiles) 16.6 against 12.2 us at one row,
   o_proj 86 against 60, the DeepSeek-V3 slice's decode 0.5-1 % slower even when kept to GEMMs of at most
   32 tiles (2026-12-04-fp8-split-combine-h200.json) — and is not here;
2. ``_gemm_kernel``, a program per (BLOCK_M rows, BLOCK_N columns) and K split, grouped along M for
   L2 reuse: K in steps of bk (one activation scale per row and one weight scale per column in each
   step), acc += dot(q, W^T tile) * s[:, None] * scale_inv[n // bn][None, :], in fp32; bias added,
   stored in x's dtype. Decode-sized products with few column tiles (kv_a_proj_with_mqa: 576 columns
   = 9 tiles for 132 SMs) split K over up to 8 programs per tile; the tile's last program to finish
   adds their fp32 partials in split order with the bias (``arrival_counters``; before: torch's sum, add and
   cast, kernels after the GEMM: q_a_proj 13.0 -> ~10 us, kv_a_proj_with_mqa 11.9 -> ~9 at one row).

Tiles by rows: M <= 16 (decode) BLOCK_M 16 x BLOCK_N 32 / 64 / 128 by the shape (``_tiles``), up to 64
rows 32/64 x 64, larger 64/128 x 128 (sglang's untuned defaults are of this kind). The weight scale of a column is looked up per
column, so BLOCK_N need not divide bn. bk must be a power of two >= 32 (the K of an e4m3 tl.dot on
Hopper: 16 compiles in the CPU interpreter and fails on the H200, "K >= 32"); other
formats, non-2-D inputs or non-contiguous weights go to the w8a8 torch reference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .arrival_counters import arrival_counters
from .fp8_block import ACT_SCALE_MIN, FP8_DTYPE, FP8_MAX, BlockFP8, block_fp8_linear_w8a8_reference

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter: dots in fp32 (exact for e4m3 values)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, groups, stride_xm, stride_qm, stride_sm, fp8_max, eps,
                        GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (cols < K) & (g < groups)[:, None]
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1) / fp8_max, eps)
    q = tl.clamp(x / s[:, None], -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, s, mask=g < groups)


@triton.jit(do_not_specialize=["M"])  # counts that change call to call: one compile for all
def _gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, cnt_ptr, M, N, K, k_blocks_per_split,
                 stride_am, stride_bn, stride_cs, stride_cm, stride_asm, stride_bsn, stride_om,
                 GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, SPLITS: tl.constexpr):
    """SPLITS > 1: program (tile, s) stores its fp32 partial in ``c`` [SPLITS, M, N]; the tile's last program
    to finish (an arrival count per tile in ``cnt``, reset by it) adds them in split order, adds the bias and
    stores ``out``; SPLITS = 1: c is the output."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    kb_first = split * k_blocks_per_split
    kb_last = tl.minimum(kb_first + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] + kb_first * BLOCK_K
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] + kb_first * BLOCK_K
    as_ptrs = as_ptr + rm.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (rn // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(kb_first, kb_last):
        k_ok = rk + kb * BLOCK_K < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=ok)
    else:
        parts = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(parts + split.to(tl.int64) * stride_cs, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(parts + s * stride_cs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=ok)


# Rows up to which K may split (decode batches, verifies).
SPLIT_ROWS = 64


def supported(fmt: BlockFP8) -> bool:
    """Formats the kernels take: bk a power of two >= 32 (one activation scale per K tile, and an e4m3
    tl.dot needs K >= 32)."""
    return fmt.block_k >= 32 and fmt.block_k & (fmt.block_k - 1) == 0


def group_quant_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (e4m3 [M, K], scales fp32 [M, ceil(K/group)]); as
    ``fp8_block.quantize_activation``. ``group``: a power of two."""
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        per = min(triton.next_power_of_2(groups), max(1, 1024 // group))  # ~1024 values a program
        _group_quant_kernel[(m, triton.cdiv(groups, per))](x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0),
                                                           FP8_MAX, ACT_SCALE_MIN, GROUP=group, GROUPS_PER_PROGRAM=per,
                                                           num_warps=4)
    return q, s


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU (the interpreter: an H200's 132, to run the same splits)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


# Programs per multiprocessor the decode K splits aim at (``k_splits``). At one, a long-K matmul runs about one
# program an SM, each streaming its K range alone: o_proj (K 16 384) 56 tiles of 128 columns split 2 ways, 112
# programs on 132 SMs, 43-59 us for 28 us of bytes at 1..16 rows (2026-12-04-fp8-gemm-tiles-h200.json: no launch
# there could split more, the most splits capped by this). On an H100 (bench/fp8_gemm_tiles_probe.py --per-sm 1 2 4,
# 2026-12-06-fp8-gemm-per-sm-h100.json) two a SM made o_proj 49.1 / 50.5 / 51.5 us at 1 / 8 / 16 rows against
# 51.4 / 52.9 / 55.6 (scaled_mm, which the engine takes for it: 57.5 / 54.9 / 55.3) but the fused q_a + kv_a
# slower (12.5 / 13.3 / 14.4 against 11.6 / 12.3 / 12.7), so one global value does not serve both; 1 stays.
SPLITS_PER_SM = 1


def k_splits(tiles: int, k_blocks: int, sms: int, most: int = 8, per_sm: int = 1) -> int:
    """K splits per output tile: enough programs for per_sm a multiprocessor, each at least two K blocks, at most
    ``most``."""
    return max(1, min(most, k_blocks // 2, per_sm * sms // max(tiles, 1)))


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, most K splits) by rows and shape. Decode rows (<= 16), from
    bench/fp8_gemm_tiles_probe.py on an H200 (2026-12-04-fp8-gemm-tiles-h200.json; each a call with the
    quantization): long rows of many columns take 128-column tiles of 8 warps split up to 16 ways (q_a_proj
    10.9 -> 9.4 us, the shared experts' gate/up 17.8 -> 14.8 us at one row); up to 8192 columns, 32-column
    tiles up to 16 ways (kv_a_proj_with_mqa 7.8 -> 7.4, the shared down 11.2 -> 10.2); wider (q_b_proj) 64."""
    if m <= 16:
        if k >= 4096 and n >= 1024:
            return 16, 128, 8, 4, 16
        if n <= 8192:
            return 16, 32, 4, 4, 16
        return 16, 64, 4, 4, 8
    if m <= 32:
        return 32, 64, 4, 4, 8
    if m <= 64:
        return 64, 64, 4, 3, 8
    if m <= 256:
        return 64, 128, 4, 3, 8
    return 128, 128, 8, 3, 8


def block_fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """x [M, K] @ (weight e4m3 [N, K] with scale_inv [ceil(N/bn), ceil(K/bk)])^T (+ bias) -> [M, N] in x's dtype."""
    if (x.dim() != 2 or not supported(fmt) or weight.dtype != FP8_DTYPE or not weight.is_contiguous()
            or scale_inv.dtype != torch.float32 or x.shape[1] != weight.shape[1]):
        return block_fp8_linear_w8a8_reference(x, weight, scale_inv, bias, fmt)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, warps, stages, most = _tiles(m, n, k)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, fmt.block_k)
    split = k_splits(tiles, k_blocks, _sm_count(x.device), most, SPLITS_PER_SM) if m <= SPLIT_ROWS else 1
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)  # no empty split
    counters = arrival_counters(x.device, tiles) if split > 1 else None
    if counters is None:
        split, per_split = 1, k_blocks
    q, qs = group_quant_triton(x, fmt.block_k)
    dest = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    scale_inv = scale_inv.contiguous()
    _gemm_kernel[(tiles, split)](
        q, weight, dest, qs, scale_inv, bias if bias is not None else out, out, counters if counters is not None else qs,
        m, n, k, per_split, q.stride(0), weight.stride(0), dest.stride(0) if split > 1 else 0, dest.stride(-2),
        qs.stride(0), scale_inv.stride(0), out.stride(0), GROUP_N=fmt.block_n, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=fmt.block_k, GROUP_M=8, HAS_BIAS=bias is not None, DOT_FP32=_INTERPRET, SPLITS=split,
        num_warps=warps, num_stages=stages)
    return out
