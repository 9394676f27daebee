"""A chain's first pass layout and its one-row steps' in one Triton launch (GPU): ``chain_layout.first_pass``'s
result, which in a capture is some 25 small torch kernels (gathers, adds, a block-table gather, a where). One
program per sequence: its ``q`` packed rows (ids, positions, slots, causal limits and hidden inputs from the
source rows ``s * q + max(r - drop, 0)``), its context length less ``drop``, and every chain step's position,
limit, context length and slot after its last row (through its block table; a padding row keeps the pad
slot); or (``leaves`` > 1) a draft tree's steps after it, ``leaves`` rows a step. Launched with PDL (``pdl.py``): it
waits before its first read. Reference and CPU path: ``chain_layout.first_pass``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.pdl import pdl_launch, pdl_open
from .chain_layout import ChainSteps, FirstPass


@triton.jit
def _first_pass_kernel(ids_ptr, pos_ptr, slots_ptr, index_ptr, ctx_ptr, hidden_ptr, drop_ptr, tables_ptr,
                       o_ids_ptr, o_pos_ptr, o_slots_ptr, o_index_ptr, o_ctx_ptr, o_hidden_ptr,
                       s_pos_ptr, s_index_ptr, s_ctx_ptr, s_slots_ptr, batch, width, stride_h, stride_oh, stride_t,
                       pad_slot, Q: tl.constexpr, Q_PAD: tl.constexpr, CHAIN: tl.constexpr, CHAIN_PAD: tl.constexpr,
                       H: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
                       LEAVES: tl.constexpr = 1, L_PAD: tl.constexpr = 1):
    pdl_open(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.load(drop_ptr + s)
    r = tl.arange(0, Q_PAD)
    ok = r < Q
    src = s * Q + tl.maximum(r - d, 0)
    dst = s * Q + r
    tl.store(o_ids_ptr + dst, tl.load(ids_ptr + src, mask=ok), mask=ok)
    tl.store(o_pos_ptr + dst, tl.load(pos_ptr + src, mask=ok), mask=ok)
    tl.store(o_slots_ptr + dst, tl.load(slots_ptr + src, mask=ok), mask=ok)
    tl.store(o_index_ptr + dst, tl.load(index_ptr + src, mask=ok), mask=ok)
    for h0 in tl.static_range(0, H, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        m = ok[:, None] & (c < H)[None, :]
        vals = tl.load(hidden_ptr + src[:, None] * stride_h + c[None, :], mask=m)
        tl.store(o_hidden_ptr + dst[:, None] * stride_oh + c[None, :], vals, mask=m)
    ctx = tl.load(ctx_ptr + s) - d
    tl.store(o_ctx_ptr + s, ctx)
    last = s * Q + tl.maximum(Q - 1 - d, 0)  # the source of the sequence's last packed row
    p = tl.load(pos_ptr + last)
    i = tl.load(index_ptr + last)
    slot = tl.load(slots_ptr + last)
    j = tl.arange(0, CHAIN_PAD)[:, None]  # [CHAIN_PAD, L_PAD]: step j's leaf r
    r = tl.arange(0, L_PAD)[None, :]
    on = (j < CHAIN) & (r < LEAVES)
    nxt = i + 1 + j * LEAVES + r  # each step's causal limits
    at = j * (batch * LEAVES) + s * LEAVES + r
    tl.store(s_pos_ptr + at, p + 1 + j + r * 0, mask=on)
    tl.store(s_index_ptr + at, nxt, mask=on)
    k = tl.arange(0, CHAIN_PAD)
    tl.store(s_ctx_ptr + k * batch + s, ctx + (k + 1) * LEAVES, mask=k < CHAIN)
    page = nxt // PAGE
    block = tl.load(tables_ptr + s * stride_t + page, mask=on & (page < width), other=0)
    tl.store(s_slots_ptr + at, tl.where(slot != pad_slot, block * PAGE + nxt % PAGE, pad_slot), mask=on)


def first_pass_triton(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
                      context_lens: torch.Tensor, hidden: torch.Tensor, drop: torch.Tensor, tables: torch.Tensor,
                      q: int, chain: int, block_size: int, pad_slot: int,
                      consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, leaves: int = 1
                      ) -> FirstPass:
    """``chain_layout.first_pass`` in one launch (same arguments and result, ``consts`` not needed; int64 index
    tensors, contiguous rows; ``hidden`` rows at unit stride)."""
    b = context_lens.shape[0]
    width = hidden.shape[1]
    o_hidden = torch.empty((b * q, width), dtype=hidden.dtype, device=hidden.device)
    rows = [torch.empty(b * q, dtype=t.dtype, device=t.device) for t in (ids, positions, slots, index)]
    o_ctx = torch.empty_like(context_lens)
    steps = [torch.empty((chain, b * n), dtype=t.dtype, device=t.device)
             for t, n in ((positions, leaves), (index, leaves), (context_lens, 1), (slots, leaves))]
    _first_pass_kernel[(b,)](
        ids, positions, slots, index, context_lens, hidden, drop, tables, *rows, o_ctx, o_hidden, *steps, b,
        tables.shape[1], hidden.stride(0), o_hidden.stride(0), tables.stride(0), pad_slot, Q=q,
        Q_PAD=triton.next_power_of_2(q), CHAIN=chain, CHAIN_PAD=triton.next_power_of_2(max(chain, 1)), H=width,
        BLOCK_H=min(1024, triton.next_power_of_2(width)), PAGE=block_size, LEAVES=leaves,
        L_PAD=triton.next_power_of_2(leaves), num_warps=4, **pdl_launch())
    return FirstPass(rows[0], rows[1], rows[2], rows[3], o_hidden, o_ctx, ChainSteps(*steps))
