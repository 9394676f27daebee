"""``TreeVerifyProgram``'s acceptance, moves and staging in one Triton kernel (GPU): a program per verified node
(and per staged row, where a tree has fewer nodes than the draft's depth + 1);
each walks its sequence's tree (a few dozen lanes: cheaper than waiting on another launch) and copies its node's
aux states, the first ``depth + 1`` also the accepted node's at their depth into the draft's hidden input, and a
sequence's first program does the rest.

The torch program (``tree_verify_program.py``, the reference and the CPU path) is some 120 small kernels behind a
tree verify's forward at depth 6: the parents read off the masks, a dozen per level of the greedy walk, the
verdict's and the moves' concatenations, the draft's staged first pass and the next verify's inputs. Here, per
sequence of ``N`` nodes: parents (each node's nearest ancestor in its mask row), the walk from the root (a child is
accepted while its token is the target's argmax at its parent, the lowest such index), the verdict (tokens, parents,
argmax, count), the moves (an accepted node's verify slot to the slot of its depth; the rest, and padding sequences,
to themselves), and, staging the draft's first pass (``STAGE``): the tokens gained (accepted, then the argmax after
them) at RoPE positions after the root, the slots and causal indices from the root's on, context root + depth + 1,
the block table row and the rows to drop (``depth - count``; 0 for padding: a sequence whose last node writes
``pad_slot``); and (``NEXT``, where the inputs give the block size) the verify's own inputs for the round after it,
as ``verify_program.stage_next_verify`` writes them. Launched with PDL where on (it reads the argmax kernel's
output: it waits first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.pdl import pdl_launch, pdl_open
from ..executor.step_graphs import StaticInputs
from .verify_stage_triton import copy_parts, stage_arguments


@triton.jit
def _tree_stage_kernel(argmax_ptr, ids_ptr, pos_ptr, slots_ptr, index_ptr, ctx_ptr, tables_ptr, tail_ptr, h0_ptr,
                       h1_ptr, h2_ptr, aux_ptr, verdict_ptr, moves_ptr, d_ids_ptr, d_pos_ptr, d_slots_ptr, d_index_ptr,
                       d_ctx_ptr, d_tables_ptr, d_hidden_ptr, d_drop_ptr, stride_h0, stride_h1, stride_h2, stride_aux,
                       stride_dh, W, DW, H, pad_slot, bs, N: tl.constexpr, N_PAD: tl.constexpr, DEPTH: tl.constexpr,
                       MOVES: tl.constexpr, D_PAD: tl.constexpr, PARTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
                       STAGE: tl.constexpr, NEXT: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    s = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p < N:
        copy_parts(h0_ptr, stride_h0, h1_ptr, stride_h1, h2_ptr, stride_h2, s * N + p, aux_ptr, stride_aux, s * N + p,
                   aux_ptr, stride_aux, 0, H, PARTS, BLOCK_H, False)
    if p > DEPTH:  # a node's aux copy only
        return
    if p > 0 and not STAGE:
        return
    # the greedy walk (every staging program makes it: the first program changes the ids' root only, which the
    # walk does not read, and nothing else it reads)
    j = tl.arange(0, N_PAD)
    valid = j < N
    tokens = tl.load(ids_ptr + s * N + j, mask=valid & (j > 0), other=-1)
    target = tl.load(argmax_ptr + s * N + j, mask=valid, other=0)
    m = tl.load(tail_ptr + (s * N + j[:, None]) * N + j[None, :], mask=valid[:, None] & valid[None, :], other=0)
    below = (m != 0) & (j[None, :] < j[:, None])
    parents = tl.max(tl.where(below, j[None, :], -1), axis=1)
    d = tl.arange(0, D_PAD)
    node = 0
    live = 1
    count = 0
    path = tl.full((D_PAD,), -1, tl.int64)
    gained = tl.zeros((D_PAD,), tl.int64)
    for level in tl.static_range(DEPTH):
        choice = tl.sum(tl.where(j == node, target, 0), axis=0)
        match = (parents == node) & (tokens == choice) & valid & (j > 0)
        nxt = tl.min(tl.where(match, j, N_PAD), axis=0)
        live = live * (nxt < N).to(tl.int32)
        node = tl.where(live > 0, nxt, node)
        path = tl.where(d == level, tl.where(live > 0, nxt, -1), path)
        gained = tl.where(d == level, tl.where(live > 0, choice, 0), gained)
        count += live
    bonus = tl.sum(tl.where(j == node, target, 0), axis=0)
    gained = tl.where(d == count, bonus, gained)
    if STAGE:  # the accepted node at depth p (the root at 0; past the count the root again) into the draft's row p
        at = tl.sum(tl.where(d == p - 1, path, 0), axis=0)
        src = tl.where((p > 0) & (at >= 0), at, 0)
        copy_parts(h0_ptr, stride_h0, h1_ptr, stride_h1, h2_ptr, stride_h2, s * N + src, d_hidden_ptr, stride_dh,
                   s * (DEPTH + 1) + p, d_hidden_ptr, stride_dh, 0, H, PARTS, BLOCK_H, False)
    if p > 0:
        return
    slots = tl.load(slots_ptr + s * N + j, mask=valid, other=0)
    real = tl.load(slots_ptr + s * N + N - 1) != pad_slot
    root_ids = tl.load(ids_ptr + s * N + j, mask=valid, other=0)
    v = verdict_ptr + s * (3 * N + 1)
    tl.store(v + j, root_ids, mask=valid)
    tl.store(v + N + j, parents.to(tl.int64), mask=valid)
    tl.store(v + 2 * N + j, target, mask=valid)
    tl.store(v + 3 * N, count)  # (stored as the pointer's int64)
    depth_row = d < MOVES
    dst = tl.sum(tl.where(j[None, :] == d[:, None] + 1, slots[None, :], 0), axis=1)  # [D_PAD]: slot of node d + 1
    from_slot = tl.sum(tl.where(j[None, :] == path[:, None], slots[None, :], 0), axis=1)
    src_slots = tl.where(real & (path >= 0), from_slot, dst)
    tl.store(moves_ptr + s * (2 * MOVES) + d, src_slots, mask=depth_row)
    tl.store(moves_ptr + s * (2 * MOVES) + MOVES + d, dst, mask=depth_row)
    root_pos = tl.load(pos_ptr + s * N)
    root_index = tl.load(index_ptr + s * N)
    ctx = tl.load(ctx_ptr + s)
    if STAGE:
        Q: tl.constexpr = DEPTH + 1
        rows = d < Q
        r = s * Q + d
        idx = root_index + d
        block = tl.load(tables_ptr + s * W + tl.minimum(idx // bs, W - 1), mask=rows, other=0)
        tl.store(d_ids_ptr + r, gained, mask=rows)
        tl.store(d_pos_ptr + r, root_pos + 1 + d, mask=rows)
        tl.store(d_index_ptr + r, tl.where(real, idx, root_index), mask=rows)  # padding: its root's index
        tl.store(d_slots_ptr + r, tl.where(real, block * bs + idx % bs, pad_slot), mask=rows)
        tl.store(d_ctx_ptr + s, tl.where(real, root_index + Q, ctx))
        w = tl.arange(0, BLOCK_W)
        for w0 in range(0, W, BLOCK_W):
            mw = w0 + w < W
            tl.store(d_tables_ptr + s * DW + w0 + w, tl.load(tables_ptr + s * W + w0 + w, mask=mw), mask=mw)
        tl.store(d_drop_ptr + s, tl.where(real, DEPTH - count, 0).to(tl.int64))
    if NEXT:  # the verify's own inputs for the round after it (``stage_next_verify``), over this round's
        pos = tl.load(pos_ptr + s * N + j, mask=valid)
        idx_n = tl.load(index_ptr + s * N + j, mask=valid)
        shift = tl.where(real, count + 1, 0).to(tl.int64)
        nidx = idx_n + shift
        block_n = tl.load(tables_ptr + s * W + tl.minimum(nidx // bs, W - 1), mask=valid, other=0)
        new_slots = tl.where(real, block_n * bs + nidx % bs, slots)
        old_root = tl.load(ids_ptr + s * N)
        tl.debug_barrier()  # every read of this round's inputs before they change
        tl.store(ids_ptr + s * N, tl.where(real, bonus, old_root))
        tl.store(pos_ptr + s * N + j, pos + shift, mask=valid)
        tl.store(index_ptr + s * N + j, nidx, mask=valid)
        tl.store(slots_ptr + s * N + j, new_slots, mask=valid)
        tl.store(ctx_ptr + s, ctx + shift)


def tree_stage_triton(argmax: torch.Tensor, inputs: StaticInputs, hidden: tuple[torch.Tensor, ...], batch: int,
                      n: int, depth: int, draft: StaticInputs | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(aux [rows, parts * H], verdict [batch, 3n + 1], moves [batch, 2 * min(depth, n - 1)]) int64, the draft's first pass
    staged into ``draft`` when given; None where the kernel does not take the inputs (the torch program then runs):
    other than 1-3 aux parts of one width and dtype with unit-stride rows, int64 contiguous metadata and masks, or
    staged inputs of other shapes."""
    rows = batch * n
    q = depth + 1
    tail = inputs.tail
    if tail is None or tail.shape != (rows, n):
        return None
    stage = draft is not None and draft.hidden is not None and draft.drop is not None and inputs.block_size > 0
    taken = stage_arguments(argmax, inputs, hidden, rows, batch * q, draft if stage else None, (tail,))
    if taken is None:
        return None
    width, staged = taken
    aux = torch.empty((rows, len(hidden) * width), dtype=hidden[0].dtype, device=argmax.device)
    verdict = torch.empty((batch, 3 * n + 1), dtype=torch.int64, device=argmax.device)
    moved = min(depth, n - 1)  # the deepest node of a tree of n
    moves = torch.empty((batch, 2 * moved), dtype=torch.int64, device=argmax.device)
    d_hidden = draft.hidden if draft is not None and draft.hidden is not None and stage else aux
    h = (*hidden, *[hidden[0]] * (3 - len(hidden)))
    tables = inputs.tables
    _tree_stage_kernel[(batch, max(n, q))](
        argmax, inputs.ids, inputs.positions, inputs.slots, inputs.index, inputs.context_lens, tables, tail, h[0],
        h[1], h[2], aux, verdict, moves, *staged[:6], d_hidden, staged[6], h[0].stride(0), h[1].stride(0),
        h[2].stride(0), aux.stride(0), d_hidden.stride(0), tables.shape[1], staged[5].shape[-1], width,
        inputs.pad_slot, max(inputs.block_size, 1), N=n, N_PAD=triton.next_power_of_2(n), DEPTH=depth,
        MOVES=moved, D_PAD=triton.next_power_of_2(q), PARTS=len(hidden), BLOCK_H=min(1024, triton.next_power_of_2(width)),
        BLOCK_W=min(1024, triton.next_power_of_2(max(1, tables.shape[1]))), STAGE=stage, NEXT=inputs.block_size > 0,
        num_warps=4, **pdl_launch())
    return aux, verdict, moves
