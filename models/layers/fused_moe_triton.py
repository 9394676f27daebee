"""Routed gated (SwiGLU) experts as two Triton launches over expert blocks (GPU; CUDA-graph capturable).

Plain reference: ``fused_moe.fused_experts_torch`` (same blocks, torch ops) and the per-expert
loop of ``RoutedExperts.forward``. ``moe_align_triton.moe_align_fast`` (one launch;
``fused_moe.moe_align`` for prefill) groups this rank's (token, slot) pairs by expert into
blocks of 16 rows on the device; then

1. ``_gate_up_kernel``, a program per (block, BLOCK_N columns of the intermediate): the
   block's token rows times its expert's gate and up rows, ``silu(gate) * up`` -> [rows, I];
2. ``_down_kernel``, a program per (block, BLOCK_N output features): that times the expert's
   down rows, scaled by each pair's routing weight, stored at the pair's row of an fp32
   [n * k, in] buffer (pairs of other ranks are not written), summed over k afterwards by
   ``moe_sum_triton.sum_slots``.

A program whose block is unused (``block_expert`` -1) returns at once, so each step streams
only the experts the batch routes to (once per block of 16 rows: decode batches have one
block per routed expert). Shapes the tiles do not divide, or non-bf16/fp16 weights, go to
the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fused_moe import BLOCK_M, fused_experts_torch
from .moe_align_triton import moe_align_fast
from .moe_sum_triton import sum_slots

_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter mis-multiplies bf16 matrices
STAGES = 4


@triton.jit(do_not_specialize=["num_pairs"])  # counts that change call to call: one compile for all
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, pairs_ptr, expert_ptr, K, INTER, top_k, num_pairs,
                    stride_xm, stride_we, stride_wn, stride_hm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = tl.where(valid, pair // top_k, 0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + rk[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(K // BLOCK_K):
        x = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
        wg = tl.load(g_ptrs)
        wu = tl.load(u_ptrs)
        if DOT_FP32:
            acc_g += tl.dot(x.to(tl.float32), tl.trans(wg.to(tl.float32)))
            acc_u += tl.dot(x.to(tl.float32), tl.trans(wu.to(tl.float32)))
        else:
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_hm + rn[None, :], h.to(h_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_pairs"])  # counts that change call to call: one compile for all
def _down_kernel(h_ptr, w_ptr, out_ptr, pairs_ptr, expert_ptr, rw_ptr, K, num_pairs,
                 stride_hm, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(expert_ptr + blk)
    if e < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + rk[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(K // BLOCK_K):
        h = tl.load(h_ptrs)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(h, tl.trans(w))
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
    acc = acc * rw[:, None]
    safe = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_om + rn[None, :], acc, mask=valid[:, None])


def _tile(size: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if size % c == 0), None)


def fused_experts_triton(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor) -> torch.Tensor:
    """This rank's routed-expert partial sum. x: [n, in]; local_ids, weights: [n, k] (ids -1 = not
    here); gate_up: [E, 2I, in]; down: [E, in, I] -> [n, in] in x's dtype."""
    n, k = local_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    bk_up, bk_down = _tile(hidden, (128, 64, 32, 16)), _tile(inter, (128, 64, 32, 16))
    bn_up, bn_down = _tile(inter, (32, 16)), _tile(hidden, (64, 32, 16))
    if (bk_up is None or bk_down is None or bn_up is None or bn_down is None
            or x.dtype not in (torch.bfloat16, torch.float16)
            or gate_up.dtype != x.dtype or down.dtype != x.dtype or not gate_up.is_contiguous()
            or not down.is_contiguous() or x.stride(-1) != 1):
        return fused_experts_torch(x, local_ids, weights, gate_up, down)
    if n == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)  # rows of other ranks' pairs: unwritten
    blk = moe_align_fast(local_ids, num_experts, BLOCK_M)
    h = torch.empty(blk.max_blocks * BLOCK_M, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blk.max_blocks, inter // bn_up)](
        x, gate_up, h, blk.sorted_pairs, blk.block_expert, hidden, inter, k, blk.num_pairs,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn_up, BLOCK_K=bk_up, DOT_FP32=_DOT_FP32, num_warps=4, num_stages=STAGES)
    rw = weights.reshape(-1).float().contiguous()
    _down_kernel[(blk.max_blocks, hidden // bn_down)](
        h, down, out, blk.sorted_pairs, blk.block_expert, rw, inter, blk.num_pairs,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn_down, BLOCK_K=bk_down, DOT_FP32=_DOT_FP32, num_warps=4, num_stages=STAGES)
    return sum_slots(out, local_ids, num_experts, x.dtype)
