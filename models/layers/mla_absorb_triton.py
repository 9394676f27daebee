"""MLA's absorbed products with W_UK and W_UV read from ``kv_b_proj``'s block-FP8 weight (GPU; CUDA-graph capturable).

Plain reference: ``mla.absorb_q`` / ``mla.absorb_v``, a bmm with W_UK / W_UV made once in the compute dtype
from the block-FP8 checkpoint (what sglang does by default). A decode step then reads those halves in bf16:
2 x heads x 128 x 512 x 2 bytes (33.5 MB a DeepSeek-V3 layer, both builds alike). Here, for up to ``ROWS`` rows (one),
each product reads the e4m3 weight and its block scales instead (16.8 MB), converted in registers (exact: the
e4m3 value times its block's scale in fp32), as sglang's optional FP8 bmm of these halves does:

- ``absorb_q_triton``: q_abs [n, h, r] = sum_i q_nope[n, h, i] W[h (nope + v) + i, r]; a program per head and
  ``Q_COLS`` columns of the rank reads its [nope, Q_COLS] tile once for all rows;
- ``absorb_v_triton``: o_v [n, h, j] = sum_r o[n, h, r] W[h (nope + v) + nope + j, r]; a program per head and
  ``V_ROWS`` of its v rows walks the rank in ``V_STEP`` columns, the next tile loaded while one is multiplied.

A program's columns never straddle two scale columns (``Q_COLS`` / ``V_STEP`` capped at the block's width, a power
of two), so each weight row takes one scale a tile.

Both read their first weight tile (and its scales) before the PDL wait (``pdl.py``). Other layers' weights and
more rows go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla import KVBFP8, absorb_q, absorb_v
from .pdl import pdl_launch, pdl_release, pdl_wait

# Rows (tokens) up to which the products read the FP8 weight (more: the reference's bmm); 0: never. In the H100's
# 2-layer slice (bench/fp8_slice.py, alternated a b a b; 2026-12-07-mla-absorb-fp8-slice-h100.json) at one row the
# two kernels took 10.1 + 11.3 us of the step's critical path against 16.2 + 16.2 for the bf16 bmm (the FP8 step
# -1.0 / -1.9 %), but at 4 rows 35.9 + 20.8 against 19.3 + 16.1 (each row re-reduces the weight tile), and the FP8
# step at 8 / 16 rows was 1-5 % slower with them: one row only.
ROWS = 1
# Rank columns a program of absorb_q; v rows a program of absorb_v and the rank columns of its steps; warps.
Q_COLS = 64
V_ROWS = 32
V_STEP = 128
WARPS = 4


@triton.jit
def _absorb_q_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, RANK, HEAD_ROWS, stride_xm, stride_xh, stride_ym, stride_yh,
                     stride_w, stride_s, NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """A program per (head, BLOCK_R rank columns inside one scale column: BLOCK_R divides BK)."""
    h = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BLOCK_R
    ri = tl.arange(0, NOPE_PAD)
    rr = c0 + tl.arange(0, BLOCK_R)
    rows = h * HEAD_ROWS + ri
    live_i = ri < NOPE
    w = tl.load(w_ptr + rows[:, None] * stride_w + rr[None, :], mask=live_i[:, None] & (rr[None, :] < RANK),
                other=0.0)
    s = tl.load(s_ptr + (rows // BN) * stride_s + c0 // BK, mask=live_i, other=0.0)  # [NOPE_PAD]: a scale a row
    pdl_release(PDL)
    pdl_wait(PDL)
    wf = w.to(tl.float32) * s[:, None]  # [NOPE_PAD, BLOCK_R]
    for m in tl.static_range(BLOCK_M):
        x = tl.load(x_ptr + m * stride_xm + h * stride_xh + ri, mask=live_i & (ri * 0 + m < M),
                    other=0.0).to(tl.float32)
        y = tl.sum(wf * x[:, None], axis=0)  # [BLOCK_R]
        tl.store(y_ptr + m * stride_ym + h * stride_yh + rr, y.to(y_ptr.dtype.element_ty),
                 mask=(rr < RANK) & (rr * 0 + m < M))


@triton.jit
def _absorb_v_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, RANK, HEAD_ROWS, NOPE, V, stride_xm, stride_xh, stride_ym,
                     stride_yh, stride_w, stride_s, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """A program per (head, BLOCK_J of its v rows), over the rank in steps of BLOCK_R inside one scale column
    (BLOCK_R divides BK)."""
    h = tl.program_id(0).to(tl.int64)
    rj = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    rk = tl.arange(0, BLOCK_R)
    rm = tl.arange(0, BLOCK_M)
    rows = h * HEAD_ROWS + NOPE + rj
    live_j = rj < V
    w_ptrs = w_ptr + rows[:, None] * stride_w + rk[None, :]
    s_ptrs = s_ptr + (rows // BN) * stride_s
    w = tl.load(w_ptrs, mask=live_j[:, None] & (rk[None, :] < RANK), other=0.0)
    s = tl.load(s_ptrs, mask=live_j, other=0.0)  # [BLOCK_J]: a scale a row
    pdl_release(PDL)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    for k in range(0, RANK, BLOCK_R):
        wf = w.to(tl.float32) * s[:, None]  # [BLOCK_J, BLOCK_R]
        if k + BLOCK_R < RANK:  # the next tile loaded while this one is multiplied
            w = tl.load(w_ptrs + k + BLOCK_R, mask=live_j[:, None] & (rk[None, :] + k + BLOCK_R < RANK), other=0.0)
            s = tl.load(s_ptrs + (k + BLOCK_R) // BK, mask=live_j, other=0.0)
        for m in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + m * stride_xm + h * stride_xh + k + rk, mask=(rk + k < RANK) & (rk * 0 + m < M),
                        other=0.0).to(tl.float32)
            row = tl.sum(wf * x[None, :], axis=1)  # [BLOCK_J]
            acc += tl.where(rm[:, None] == m, row[None, :], 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + h * stride_yh + rj[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rj[None, :] < V))


def _takes(x: torch.Tensor, fp8: KVBFP8 | None) -> bool:
    """A few rows of unit column stride, and a contiguous e4m3 weight whose scale columns are a power of two wide
    (a step then stays inside one)."""
    bk = 0 if fp8 is None else fp8.fmt.block_k
    return (fp8 is not None and 1 <= x.shape[0] <= ROWS and x.stride(-1) == 1 and fp8.weight.is_contiguous()
            and fp8.scale_inv.dtype == torch.float32 and bk & (bk - 1) == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def absorb_q_triton(q_nope: torch.Tensor, w_uk: torch.Tensor, fp8: KVBFP8 | None = None) -> torch.Tensor:
    """As ``mla.absorb_q`` ([n, heads, nope] -> [n, heads, rank]), from kv_b's block-FP8 weight for up to ``ROWS``
    rows; the reference otherwise."""
    if fp8 is None or not _takes(q_nope, fp8):
        return absorb_q(q_nope, w_uk, fp8)
    n, heads, nope = q_nope.shape
    rank = fp8.weight.shape[1]
    y = torch.empty(n, heads, rank, dtype=q_nope.dtype, device=q_nope.device)
    scale = fp8.scale_inv.contiguous()
    cols = min(Q_COLS, fp8.fmt.block_k)
    _absorb_q_kernel[(heads, triton.cdiv(rank, cols))](
        q_nope, fp8.weight, scale, y, n, rank, fp8.nope + fp8.v, q_nope.stride(0), q_nope.stride(1), y.stride(0),
        y.stride(1), fp8.weight.stride(0), scale.stride(0), NOPE=nope, NOPE_PAD=triton.next_power_of_2(nope),
        BLOCK_R=cols, BN=fp8.fmt.block_n, BK=fp8.fmt.block_k, BLOCK_M=triton.next_power_of_2(n), num_warps=WARPS,
        **pdl_launch())
    return y


def absorb_v_triton(o: torch.Tensor, w_uv: torch.Tensor, fp8: KVBFP8 | None = None) -> torch.Tensor:
    """As ``mla.absorb_v`` ([n, heads, rank] -> [n, heads, v]), from kv_b's block-FP8 weight for up to ``ROWS``
    rows; the reference otherwise."""
    if fp8 is None or not _takes(o, fp8):
        return absorb_v(o, w_uv, fp8)
    n, heads, rank = o.shape
    y = torch.empty(n, heads, fp8.v, dtype=o.dtype, device=o.device)
    scale = fp8.scale_inv.contiguous()
    _absorb_v_kernel[(heads, triton.cdiv(fp8.v, V_ROWS))](
        o, fp8.weight, scale, y, n, rank, fp8.nope + fp8.v, fp8.nope, fp8.v, o.stride(0), o.stride(1), y.stride(0),
        y.stride(1), fp8.weight.stride(0), scale.stride(0), BLOCK_J=V_ROWS, BLOCK_R=min(V_STEP, fp8.fmt.block_k),
        BN=fp8.fmt.block_n, BK=fp8.fmt.block_k, BLOCK_M=triton.next_power_of_2(n), num_warps=WARPS, **pdl_launch())
    return y
