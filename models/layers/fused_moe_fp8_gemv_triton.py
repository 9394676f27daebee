"""One token's block-FP8 experts (gated SwiGLU) in two launches without tensor cores (GPU; CUDA-graph capturable).

Plain references: ``fused_moe.fused_experts_fp8_torch`` and the per-expert loop, both dequantizing; the general
path is ``fused_moe_fp8_triton`` (any batch). A batch-1 decode step routes its one token to k experts (DeepSeek-V3:
8 routed + the folded shared one), so every expert sees one row: each expert's matmuls are GEMVs. Here:

1. ``_gate_up_gemv_kernel``, a program per (slot, BLOCK_N intermediate columns): the slot's expert's gate and up
   rows, streamed as ``fp8_block_gemv_triton`` streams a dense weight (tiles converted to fp32 in registers,
   the block scale applied to x, the next tiles loaded while one is multiplied), silu(gate) * up stored as the
   slot's row of h [k, I] in x's dtype;
2. ``_down_gemv_kernel``, a program per BLOCK_N output features: over every slot in turn, its expert's down rows
   times the slot's row of h, scaled by the slot's routing weight, summed in fp32 registers and stored once in
   x's dtype.

Against the general path at one token this drops the expert grouping (``moe_align_fast``), both per-token-group
quantizations (of x and of h: the activations stay bf16 / fp16, so the sums are the dequantized model's products)
and the slot sum (``sum_slots``): two launches instead of six. A slot whose id is -1 (an expert of another rank)
reads nothing and adds nothing.

``TOKENS`` (0 or 1): ``fused_moe_fp8_triton`` takes this path for one token. The A/B:
``--set models.layers.fused_moe_fp8_gemv_triton.TOKENS=1``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_block import FP8_DTYPE, BlockFP8
from .fp8_block_gemv_triton import add_quad_products, block_k

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter runs no inline PTX
# Tokens up to which the fast set's FP8 fused MoE takes these kernels (only one is taken); 0: never.
TOKENS = 0
BLOCK_N = 8
WARPS = 8


@triton.jit
def _gate_up_gemv_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, K, INTER, stride_we, stride_wn, stride_se, stride_sn,
                         stride_hm, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NATIVE: tl.constexpr):
    """Program (slot, n): intermediate columns n * BLOCK_N.. of the slot's expert, gate rows and up rows (INTER
    further) together, all of K in BLOCK_K steps; ``w_ptr`` an int32 view of the e4m3 weights (strides in words)."""
    QUADS: tl.constexpr = BLOCK_K // 4
    slot = tl.program_id(0)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    if e < 0:
        return
    first = tl.program_id(1).to(tl.int64) * BLOCK_N
    rn = first + tl.arange(0, BLOCK_N)
    rq = tl.arange(0, QUADS)
    g_ptrs = w_ptr + e * stride_we + rn[:, None] * stride_wn + rq[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    sg_row = s_ptr + e * stride_se + (first // GROUP_N) * stride_sn
    su_row = s_ptr + e * stride_se + ((INTER + first) // GROUP_N) * stride_sn
    if EVEN_K:
        g = tl.load(g_ptrs)
        u = tl.load(u_ptrs)
    else:
        g = tl.load(g_ptrs, mask=4 * rq[None, :] < K, other=0)
        u = tl.load(u_ptrs, mask=4 * rq[None, :] < K, other=0)
    acc_g = tl.zeros((BLOCK_N, QUADS), tl.float32)
    acc_u = tl.zeros((BLOCK_N, QUADS), tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            g_next = tl.load(g_ptrs + k // 4)
            u_next = tl.load(u_ptrs + k // 4)
        else:
            g_next = tl.load(g_ptrs + k // 4, mask=4 * rq[None, :] + k < K, other=0)
            u_next = tl.load(u_ptrs + k // 4, mask=4 * rq[None, :] + k < K, other=0)
        acc_g = add_quad_products(acc_g, g, x_ptr, sg_row, k - BLOCK_K, rq, K, 1.0, GROUP_K, EVEN_K, NATIVE)
        acc_u = add_quad_products(acc_u, u, x_ptr, su_row, k - BLOCK_K, rq, K, 1.0, GROUP_K, EVEN_K, NATIVE)
        g = g_next
        u = u_next
    last = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
    gate = tl.sum(add_quad_products(acc_g, g, x_ptr, sg_row, last, rq, K, 1.0, GROUP_K, EVEN_K, NATIVE), axis=1)
    up = tl.sum(add_quad_products(acc_u, u, x_ptr, su_row, last, rq, K, 1.0, GROUP_K, EVEN_K, NATIVE), axis=1)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(h_ptr + slot.to(tl.int64) * stride_hm + rn, h.to(h_ptr.dtype.element_ty))


@triton.jit
def _down_gemv_kernel(h_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, y_ptr, K, SLOTS, stride_hm, stride_we, stride_wn,
                      stride_se, stride_sn, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):
    """Program n: output features n * BLOCK_N.. summed over the slots: step t covers slot t // steps, K columns
    (t % steps) * BLOCK_K.., the next step's tile loaded while one is multiplied; ``w_ptr`` an int32 view of the
    e4m3 weights (strides in words). A slot of another rank (-1) reads nothing: its columns are masked off."""
    QUADS: tl.constexpr = BLOCK_K // 4
    first = tl.program_id(0).to(tl.int64) * BLOCK_N
    rn = first + tl.arange(0, BLOCK_N)
    rq = tl.arange(0, QUADS)
    steps = tl.cdiv(K, BLOCK_K)
    rows = rn[:, None] * stride_wn + rq[None, :]
    e = tl.load(ids_ptr).to(tl.int64)
    v = tl.load(w_ptr + tl.maximum(e, 0) * stride_we + rows, mask=4 * rq[None, :] < tl.where(e >= 0, K, 0), other=0)
    acc = tl.zeros((BLOCK_N, QUADS), tl.float32)
    for t in range(1, SLOTS * steps):
        e_next = tl.load(ids_ptr + t // steps).to(tl.int64)
        k_next = (t % steps) * BLOCK_K
        v_next = tl.load(w_ptr + tl.maximum(e_next, 0) * stride_we + rows + k_next // 4,
                         mask=4 * rq[None, :] + k_next < tl.where(e_next >= 0, K, 0), other=0)
        acc = _add_slot(acc, v, h_ptr, ids_ptr, rw_ptr, s_ptr, t - 1, steps, first, rq, K, stride_hm, stride_se,
                        stride_sn, GROUP_N, GROUP_K, BLOCK_K, NATIVE)
        v = v_next
    acc = _add_slot(acc, v, h_ptr, ids_ptr, rw_ptr, s_ptr, SLOTS * steps - 1, steps, first, rq, K, stride_hm,
                    stride_se, stride_sn, GROUP_N, GROUP_K, BLOCK_K, NATIVE)
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


@triton.jit
def _add_slot(acc, v, h_ptr, ids_ptr, rw_ptr, s_ptr, t, steps, first, rq, K, stride_hm, stride_se, stride_sn,
              GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):
    """acc plus step t's products: its words v times the slot's h columns, block scales and routing weight (a slot
    of another rank: h's row, never written, read as 0)."""
    slot = t // steps
    e = tl.load(ids_ptr + slot).to(tl.int64)
    rw = tl.load(rw_ptr + slot).to(tl.float32)
    s_row = s_ptr + tl.maximum(e, 0) * stride_se + (first // GROUP_N) * stride_sn
    return add_quad_products(acc, v, h_ptr + slot.to(tl.int64) * stride_hm, s_row, (t % steps) * BLOCK_K, rq,
                             tl.where(e >= 0, K, 0), rw, GROUP_K, False, NATIVE)


def supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, fmt: BlockFP8) -> bool:
    """One contiguous bf16 / fp16 token; contiguous e4m3 experts whose output rows split into programs inside
    one scale row each (``BLOCK_N`` divides bn, the intermediate size and the hidden size)."""
    inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and gate_up.dtype == FP8_DTYPE and down.dtype == FP8_DTYPE and gate_up.is_contiguous()
            and down.is_contiguous() and fmt.block_n % BLOCK_N == 0 and inter % fmt.block_n == 0
            and hidden % BLOCK_N == 0 and down.shape[1] == hidden and down.shape[2] == inter
            and hidden % 4 == 0 and inter % 4 == 0 and fmt.block_k % 4 == 0)


def fused_experts_fp8_gemv_triton(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
                                  gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                                  down_scale: torch.Tensor, fmt: BlockFP8) -> torch.Tensor:
    """One token's routed-expert sum (``supported`` must hold). x: [1, in]; local_ids, weights: [1, k] (ids -1 =
    not here); gate_up: e4m3 [E, 2I, in], gate_up_scale [E, 2I/bn, in/bk]; down: e4m3 [E, in, I], down_scale
    [E, ceil(in/bn), I/bk] -> [1, in] in x's dtype."""
    slots = local_ids.shape[1]
    _, two_i, hidden = gate_up.shape
    inter = two_i // 2
    ids = local_ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).contiguous()
    gate_up_scale, down_scale = gate_up_scale.contiguous(), down_scale.contiguous()
    h = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    bk_up, bk_down = block_k(hidden), block_k(inter)
    _gate_up_gemv_kernel[(slots, inter // BLOCK_N)](
        x, ids, gate_up.view(torch.int32), gate_up_scale, h, hidden, inter, gate_up.stride(0) // 4,
        gate_up.stride(1) // 4,
        gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0),
        GROUP_N=fmt.block_n, GROUP_K=fmt.block_k, BLOCK_N=BLOCK_N, BLOCK_K=bk_up, EVEN_K=hidden % bk_up == 0,
        NATIVE=not _INTERPRET, num_warps=WARPS)
    y = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _down_gemv_kernel[(hidden // BLOCK_N,)](
        h, ids, rw, down.view(torch.int32), down_scale, y, inter, slots, h.stride(0), down.stride(0) // 4,
        down.stride(1) // 4,
        down_scale.stride(0), down_scale.stride(1),
        GROUP_N=fmt.block_n, GROUP_K=fmt.block_k, BLOCK_N=BLOCK_N, BLOCK_K=bk_down, NATIVE=not _INTERPRET,
        num_warps=WARPS)
    return y
