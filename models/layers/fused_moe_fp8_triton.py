"""Routed block-FP8 experts (gated SwiGLU) as Triton launches over expert blocks (GPU; CUDA-graph capturable).

The FP8 twin of ``fused_moe_triton.py``; plain references: ``fused_moe.fused_experts_fp8_torch``
(every expert dequantized, then the torch block computation) and the per-expert loop of
``RoutedExperts.forward``. ``moe_align_triton.moe_align_fast`` (one launch; ``fused_moe.moe_align``
for prefill) groups this rank's (token, slot) pairs by expert into blocks of 16 rows on the device;
then, as sglang's FP8 fused MoE does (w8a8, 1 x bk groups):

1. x quantized per token and bk columns (``fp8_block_triton.group_quant_triton``);
2. ``_gate_up_kernel``, a program per (block, BLOCK_N intermediate columns): the block's token rows
   (e4m3) times its expert's gate and up rows (e4m3), K in steps of bk, each partial product rescaled
   by the rows' activation scales and the columns' weight block scales; ``silu(gate) * up`` -> [rows, I]
   in x's dtype;
3. that quantized per row and bk columns;
4. ``_down_kernel``, a program per (block, BLOCK_N output features): times the expert's down rows
   (e4m3, rescaled the same way), scaled by each pair's routing weight, stored at the pair's row of an
   fp32 [n * k, in] buffer, summed over k afterwards (``moe_sum_triton.sum_slots``).

Unused blocks (``block_expert`` -1) return at once: a step streams only the experts it routes to. Up to
``W8A16_ROWS`` tokens, steps 1 and 3 are skipped: both kernels take bf16 / fp16 rows and convert the weights.
Shapes the tiles do not divide, or formats ``fp8_block_triton.supported`` refuses, go to the torch twin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_block import FP8_DTYPE, BlockFP8
from .fp8_block_triton import group_quant_triton, supported
from .fused_moe import BLOCK_M, fused_experts_fp8_torch
from .moe_align_triton import moe_align_fast
from .moe_sum_triton import sum_slots

_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter: dots in fp32 (exact for e4m3 values)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the two kernels: columns per program, warps, pipeline stages."""

    up_n: int = 64
    up_warps: int = 4
    up_stages: int = 3
    down_n: int = 64
    down_warps: int = 4
    down_stages: int = 3


# One launch shape at every batch: bench/moe_fp8_tiles_probe.py found it within 0.3-4.5 % of the best of its
# sweep at 1..16 tokens (2026-12-04-moe-fp8-tiles-h200.json); the probe swaps this for each candidate.
TILES = Tiles()
# Tokens up to which a step's experts take the activations as they are (bf16 / fp16), each weight tile converted in
# registers, instead of quantizing x and the SwiGLU output per token and bk group (two launches fewer; closer to the
# dequantized model): as ``fp8_block_w8a16_triton`` for the dense projections. 0: never (the A/B: --set
# models.layers.fused_moe_fp8_triton.W8A16_ROWS=16). Off: its gate_up took 240 vs 182 us a
# batch-1 step on an H100 (bench/results/2026-12-06-w8a16-decode-kernels-slice-h100.json).
W8A16_ROWS = 0


@triton.jit(do_not_specialize=["num_pairs"])  # counts that change call to call: one compile for all
def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, h_ptr, pairs_ptr, expert_ptr, K, INTER, top_k, num_pairs,
                    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
                    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_FP32: tl.constexpr, W8A16: tl.constexpr = False):
    """W8A16: x in its own dtype (no activation scales, ``xs_ptr`` unused), each weight tile converted to it
    (e4m3 values are exact in bf16 / fp16) and only the weight's block scales applied to the sums."""
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = tl.where(valid, pair // top_k, 0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + rk[None, :]
    xs_ptrs = xs_ptr + token * stride_xsm
    g_ptrs = w_ptr + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    gs_ptrs = ws_ptr + e * stride_wse + (rn // GROUP_N).to(tl.int64) * stride_wsn
    us_ptrs = ws_ptr + e * stride_wse + ((rn + INTER) // GROUP_N).to(tl.int64) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(K // BLOCK_K):
        x = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
        wg = tl.load(g_ptrs)
        wu = tl.load(u_ptrs)
        if DOT_FP32:
            pg = tl.dot(x.to(tl.float32), wg.to(tl.float32))
            pu = tl.dot(x.to(tl.float32), wu.to(tl.float32))
        elif W8A16:
            pg = tl.dot(x, wg.to(x_ptr.dtype.element_ty))
            pu = tl.dot(x, wu.to(x_ptr.dtype.element_ty))
        else:
            pg = tl.dot(x, wg)
            pu = tl.dot(x, wu)
        if W8A16:
            acc_g += pg * tl.load(gs_ptrs + kb)[None, :]
            acc_u += pu * tl.load(us_ptrs + kb)[None, :]
        else:
            x_s = tl.load(xs_ptrs + kb, mask=valid, other=0.0)
            acc_g += pg * x_s[:, None] * tl.load(gs_ptrs + kb)[None, :]
            acc_u += pu * x_s[:, None] * tl.load(us_ptrs + kb)[None, :]
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_hm + rn[None, :], h.to(h_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_pairs"])  # counts that change call to call: one compile for all
def _down_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, out_ptr, pairs_ptr, expert_ptr, rw_ptr, K, N, num_pairs,
                 stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                 GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, W8A16: tl.constexpr = False):
    """W8A16: h in its own dtype (``hs_ptr`` unused), as ``_gate_up_kernel``'s."""
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + rk[None, :]
    hs_ptrs = hs_ptr + rows.to(tl.int64) * stride_hsm
    w_ptrs = w_ptr + e * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_ptrs = ws_ptr + e * stride_wse + (rn // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(K // BLOCK_K):
        h = tl.load(h_ptrs, mask=valid[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        if DOT_FP32:
            part = tl.dot(h.to(tl.float32), w.to(tl.float32))
        elif W8A16:
            part = tl.dot(h, w.to(h_ptr.dtype.element_ty))
        else:
            part = tl.dot(h, w)
        if W8A16:
            acc += part * tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)[None, :]
        else:
            h_s = tl.load(hs_ptrs + kb, mask=valid, other=0.0)
            acc += part * h_s[:, None] * tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)[None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
    acc = acc * rw[:, None]
    safe = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_om + rn[None, :], acc, mask=valid[:, None] & n_ok[None, :])


def _tile(size: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if size % c == 0), None)


def fused_experts_fp8_triton(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                             gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                             fmt: BlockFP8) -> torch.Tensor:
    """This rank's routed-expert partial sum. x: [n, in]; local_ids, weights: [n, k] (ids -1 = not here);
    gate_up: e4m3 [E, 2I, in], gate_up_scale [E, 2I/bn, in/bk]; down: e4m3 [E, in, I], down_scale
    [E, ceil(in/bn), I/bk] -> [n, in] in x's dtype."""
    n, k = local_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    bk = fmt.block_k
    t = TILES
    bn_up = _tile(inter, tuple(c for c in (128, 64, 32, 16) if c <= t.up_n))
    if (bn_up is None or not supported(fmt) or hidden % bk or inter % bk or inter % fmt.block_n
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or gate_up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE or not gate_up.is_contiguous()
            or not down.is_contiguous() or x.stride(-1) != 1):
        return fused_experts_fp8_torch(x, local_ids, weights, gate_up, gate_up_scale, down, down_scale, fmt)
    if n == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)  # rows of other ranks' pairs: unwritten
    blk = moe_align_fast(local_ids, num_experts, BLOCK_M)
    w8a16 = n <= W8A16_ROWS and x.dtype in (torch.bfloat16, torch.float16)
    xq, xs = (x, x) if w8a16 else group_quant_triton(x, bk)  # w8a16: no scales (xs a placeholder, unread)
    gate_up_scale, down_scale = gate_up_scale.contiguous(), down_scale.contiguous()
    h = torch.empty(blk.max_blocks * BLOCK_M, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blk.max_blocks, inter // bn_up)](
        xq, xs, gate_up, gate_up_scale, h, blk.sorted_pairs, blk.block_expert, hidden, inter, k, blk.num_pairs,
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), h.stride(0),
        GROUP_N=fmt.block_n, BLOCK_M=BLOCK_M, BLOCK_N=bn_up, BLOCK_K=bk, DOT_FP32=_DOT_FP32, W8A16=w8a16,
        num_warps=t.up_warps, num_stages=t.up_stages)
    hq, hs = (h, h) if w8a16 else group_quant_triton(h, bk)
    rw = weights.reshape(-1).float().contiguous()
    bn_down = t.down_n
    _down_kernel[(blk.max_blocks, triton.cdiv(hidden, bn_down))](
        hq, hs, down, down_scale, out, blk.sorted_pairs, blk.block_expert, rw, inter, hidden, blk.num_pairs,
        hq.stride(0), hs.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        out.stride(0),
        GROUP_N=fmt.block_n, BLOCK_M=BLOCK_M, BLOCK_N=bn_down, BLOCK_K=bk, DOT_FP32=_DOT_FP32, W8A16=w8a16,
        num_warps=t.down_warps, num_stages=t.down_stages)
    return sum_slots(out, local_ids, num_experts, x.dtype)
