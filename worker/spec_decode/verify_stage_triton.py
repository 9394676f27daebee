"""``VerifyProgram``'s acceptance and staging in one Triton kernel (GPU; a program per verified row: each copies its
row's aux states, a sequence's first also does the rest).

The torch program (``verify_program.py``, the reference and the CPU path) is some twenty small kernels
behind a chain verify's forward: the aux states' concatenation, the acceptance count (compare, scan, sum),
the verdict's concatenation, and seven copies and a ``where`` into the draft's static inputs (ten
device-to-device copies and about a dozen elementwise kernels in the verify graph's profile on an H200,
2026-12-05-spec-staged-round-smollm2-h200.json's kernels). Here, per sequence of ``Q`` rows: its drafts (the
verify's input ids after the root), the target's argmax of its rows, the greedy count (drafts matching the
argmax before them, up to the first that differs) into ``verdict``; its rows' aux states side by side into
``aux``; and, staging the draft's first pass (``STAGE``): ids = the argmax, RoPE positions one further, slots,
causal index, context length, block table row, hidden = the aux row, and the rows to drop (``Q - 1 -`` count
for a real sequence, one whose last row does not write ``pad_slot``; 0 for padding); and (``NEXT``, where the
inputs give the block size) the verify's own inputs for the round after it, as ``stage_next_verify`` writes them.
Launched with PDL where on (it reads the argmax kernel's output: it waits first).

``restage_triton`` is ``verify_program.restage_sampled`` in one launch (one program per sequence): the next
verify's inputs moved from the greedy rule's outcome to a sampled round's, and the next chain's drafts copied
in — some thirty torch kernels and views between two replays of a sampled round in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.pdl import pdl_launch, pdl_open
from ..executor.step_graphs import StaticInputs


@triton.jit
def copy_parts(h0_ptr, stride_h0, h1_ptr, stride_h1, h2_ptr, stride_h2, src, a_ptr, stride_a, a_row, d_ptr, stride_d,
               d_row, H, PARTS: tl.constexpr, BLOCK_H: tl.constexpr, SECOND: tl.constexpr):
    """Row ``src`` of the aux parts side by side into row ``a_row`` of ``a_ptr`` (and, with ``SECOND``, row ``d_row``
    of ``d_ptr``: the draft's hidden input): each chunk's parts all loaded before any is stored, so their reads wait
    on memory once, not once a part."""
    c = tl.arange(0, BLOCK_H)
    for c0 in range(0, H, BLOCK_H):
        m = c0 + c < H
        v0 = tl.load(h0_ptr + src * stride_h0 + c0 + c, mask=m)
        if PARTS > 1:
            v1 = tl.load(h1_ptr + src * stride_h1 + c0 + c, mask=m)
        if PARTS > 2:
            v2 = tl.load(h2_ptr + src * stride_h2 + c0 + c, mask=m)
        tl.store(a_ptr + a_row * stride_a + c0 + c, v0, mask=m)
        if SECOND:
            tl.store(d_ptr + d_row * stride_d + c0 + c, v0, mask=m)
        if PARTS > 1:
            tl.store(a_ptr + a_row * stride_a + H + c0 + c, v1, mask=m)
            if SECOND:
                tl.store(d_ptr + d_row * stride_d + H + c0 + c, v1, mask=m)
        if PARTS > 2:
            tl.store(a_ptr + a_row * stride_a + 2 * H + c0 + c, v2, mask=m)
            if SECOND:
                tl.store(d_ptr + d_row * stride_d + 2 * H + c0 + c, v2, mask=m)


@triton.jit
def _verify_stage_kernel(argmax_ptr, ids_ptr, pos_ptr, slots_ptr, index_ptr, ctx_ptr, tables_ptr, h0_ptr, h1_ptr,
                         h2_ptr, aux_ptr, verdict_ptr, d_ids_ptr, d_pos_ptr, d_slots_ptr, d_index_ptr, d_ctx_ptr,
                         d_tables_ptr, d_hidden_ptr, d_drop_ptr, stride_h0, stride_h1, stride_h2, stride_aux,
                         stride_dh, W, DW, H, pad_slot, bs, Q: tl.constexpr, Q_PAD: tl.constexpr,
                         PARTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, STAGE: tl.constexpr,
                         NEXT: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    s = tl.program_id(0).to(tl.int64)
    row = s * Q + tl.program_id(1)
    copy_parts(h0_ptr, stride_h0, h1_ptr, stride_h1, h2_ptr, stride_h2, row, aux_ptr, stride_aux, row, d_hidden_ptr,
               stride_dh, row, H, PARTS, BLOCK_H, STAGE)
    if tl.program_id(1) > 0:  # a row's copy only: the verdict and the staging are the sequence's first program's
        return
    j = tl.arange(0, Q_PAD)
    rows = j < Q
    r = s * Q + j
    target = tl.load(argmax_ptr + r, mask=rows, other=0)
    is_draft = j < Q - 1
    drafts = tl.load(ids_ptr + s * Q + 1 + j, mask=is_draft, other=0)
    count = tl.min(tl.where(is_draft & (drafts != target), j, Q - 1), axis=0)
    v = verdict_ptr + s * (2 * Q)
    tl.store(v + j, drafts, mask=is_draft)
    tl.store(v + Q - 1 + j, target, mask=rows)
    tl.store(v + 2 * Q - 1, count.to(tl.int64))
    if STAGE:
        tl.store(d_ids_ptr + r, target, mask=rows)
        tl.store(d_pos_ptr + r, tl.load(pos_ptr + r, mask=rows) + 1, mask=rows)
        slots = tl.load(slots_ptr + r, mask=rows)
        tl.store(d_slots_ptr + r, slots, mask=rows)
        tl.store(d_index_ptr + r, tl.load(index_ptr + r, mask=rows), mask=rows)
        tl.store(d_ctx_ptr + s, tl.load(ctx_ptr + s))
        w = tl.arange(0, BLOCK_W)
        for w0 in range(0, W, BLOCK_W):
            m = w0 + w < W
            tl.store(d_tables_ptr + s * DW + w0 + w, tl.load(tables_ptr + s * W + w0 + w, mask=m), mask=m)
        last = tl.load(slots_ptr + s * Q + Q - 1)
        tl.store(d_drop_ptr + s, tl.where(last != pad_slot, Q - 1 - count, 0).to(tl.int64))
    if NEXT:  # the verify's own inputs for the round after it (``stage_next_verify``), over this round's
        pos = tl.load(pos_ptr + r, mask=rows)
        idx = tl.load(index_ptr + r, mask=rows)
        old_slots = tl.load(slots_ptr + r, mask=rows)
        ctx = tl.load(ctx_ptr + s)
        old_root = tl.load(ids_ptr + s * Q)
        real = tl.load(slots_ptr + s * Q + Q - 1) != pad_slot
        root = tl.sum(tl.where(j == count, target, 0), axis=0)
        shift = tl.where(real, count + 1, 0).to(tl.int64)
        nidx = idx + shift
        block = tl.load(tables_ptr + s * W + tl.minimum(nidx // bs, W - 1), mask=rows, other=0)
        new_slots = tl.where(real, block * bs + nidx % bs, old_slots)
        tl.debug_barrier()  # every read of this round's inputs (the draft's staging's too) before they change
        tl.store(ids_ptr + s * Q, tl.where(real, root, old_root))
        tl.store(pos_ptr + r, pos + shift, mask=rows)
        tl.store(index_ptr + r, nidx, mask=rows)
        tl.store(slots_ptr + r, new_slots, mask=rows)
        tl.store(ctx_ptr + s, ctx + shift)


def stage_arguments(argmax: torch.Tensor, inputs: StaticInputs, hidden: tuple[torch.Tensor, ...], rows: int,
                    staged_rows: int, draft: StaticInputs | None, extra: tuple[torch.Tensor, ...] = ()
                    ) -> tuple[int, tuple[torch.Tensor, ...]] | None:
    """What a verify's stage kernel (this one, ``tree_stage_triton``) takes: 1-3 aux parts of one width and dtype with
    unit-stride rows over ``rows`` rows, int64 contiguous metadata (``extra`` too), and ``draft``'s inputs to stage
    (``staged_rows`` of them: of the verify's shapes) -> (the aux width, the draft's ids, positions, slots, index,
    context lengths, tables and drop as the launch's pointers: the argmax and the verify's tables, never touched,
    without ``draft``), or None where the kernel does not take these inputs (the torch program then runs)."""
    width = hidden[0].shape[-1] if hidden else 0
    meta = (argmax, inputs.ids, inputs.positions, inputs.slots, inputs.index, inputs.context_lens, inputs.tables, *extra)
    if (not 1 <= len(hidden) <= 3 or any(h.shape[-1] != width or h.dtype != hidden[0].dtype or h.stride(-1) != 1
                                          or h.shape[0] < rows for h in hidden)
            or any(t.dtype != torch.int64 or not t.is_contiguous() for t in meta)):
        return None
    if draft is None or draft.hidden is None or draft.drop is None:
        return width, (argmax,) * 5 + (inputs.tables, argmax)
    staged = (draft.ids, draft.positions, draft.slots, draft.index, draft.context_lens, draft.tables, draft.drop)
    if (any(t.dtype != torch.int64 or not t.is_contiguous() for t in staged)
            or draft.tables.shape != inputs.tables.shape or draft.context_lens.shape != inputs.context_lens.shape
            or draft.hidden.dtype != hidden[0].dtype or draft.hidden.shape[-1] != len(hidden) * width
            or draft.hidden.stride(-1) != 1 or draft.hidden.shape[0] < staged_rows or draft.ids.shape[0] < staged_rows):
        return None
    return width, staged


def verify_stage_triton(argmax: torch.Tensor, inputs: StaticInputs, hidden: tuple[torch.Tensor, ...], batch: int,
                        q: int, draft: StaticInputs | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(aux [rows, parts * H], verdict [batch, 2q] int64), the draft's first pass staged into ``draft`` when given;
    None where the kernel does not take the inputs (the torch program then runs): other than 1-3 aux parts of
    one width and dtype with unit-stride rows, int64 contiguous metadata, or staged inputs of other shapes."""
    rows = batch * q
    stage = draft is not None and draft.hidden is not None and draft.drop is not None
    taken = stage_arguments(argmax, inputs, hidden, rows, rows, draft if stage else None)
    if taken is None:
        return None
    width, staged = taken
    aux = torch.empty((rows, len(hidden) * width), dtype=hidden[0].dtype, device=argmax.device)
    verdict = torch.empty((batch, 2 * q), dtype=torch.int64, device=argmax.device)
    d_hidden = draft.hidden if draft is not None and draft.hidden is not None and stage else aux
    h = (*hidden, *[hidden[0]] * (3 - len(hidden)))
    tables = inputs.tables
    _verify_stage_kernel[(batch, q)](
        argmax, inputs.ids, inputs.positions, inputs.slots, inputs.index, inputs.context_lens, tables, h[0], h[1],
        h[2], aux, verdict, *staged[:6], d_hidden, staged[6], h[0].stride(0), h[1].stride(0), h[2].stride(0),
        aux.stride(0), d_hidden.stride(0), tables.shape[1], staged[5].shape[-1], width, inputs.pad_slot,
        max(inputs.block_size, 1), Q=q, Q_PAD=triton.next_power_of_2(q), PARTS=len(hidden),
        BLOCK_H=min(1024, triton.next_power_of_2(width)), BLOCK_W=min(1024, triton.next_power_of_2(max(1, tables.shape[1]))),
        STAGE=stage, NEXT=inputs.block_size > 0, num_warps=4, **pdl_launch())
    return aux, verdict


@triton.jit
def _restage_kernel(ids_ptr, pos_ptr, slots_ptr, index_ptr, ctx_ptr, tables_ptr, counts_ptr, g_ptr, stride_g,
                    tok_ptr, stride_tok, nxt_ptr, stride_nxt, W, bs, Q: tl.constexpr, Q_PAD: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, Q_PAD)
    rows = j < Q
    r = s * Q + j
    count = tl.load(counts_ptr + s)
    shift = count - tl.load(g_ptr + s * stride_g)
    root = tl.load(tok_ptr + s * stride_tok + count)
    idx = tl.load(index_ptr + r, mask=rows) + shift
    block = tl.load(tables_ptr + s * W + tl.minimum(idx // bs, W - 1), mask=rows, other=0)
    drafts = tl.load(nxt_ptr + s * stride_nxt + j - 1, mask=rows & (j > 0), other=0)
    tl.store(pos_ptr + r, tl.load(pos_ptr + r, mask=rows) + shift, mask=rows)
    tl.store(index_ptr + r, idx, mask=rows)
    tl.store(slots_ptr + r, block * bs + idx % bs, mask=rows)
    tl.store(ctx_ptr + s, tl.load(ctx_ptr + s) + shift)
    tl.store(ids_ptr + r, tl.where(j == 0, root, drafts), mask=rows)


def restage_triton(inputs: StaticInputs, counts: torch.Tensor, greedy_counts: torch.Tensor, tokens: torch.Tensor,
                   next_drafts: torch.Tensor, n: int, q: int) -> None:
    """``verify_program.restage_sampled`` in one launch (the inputs' int64 contiguous metadata, as the verify's
    static inputs are; the counts, tokens and drafts int64 with unit stride along a row)."""
    if not n:
        return
    counts = counts.contiguous()
    if greedy_counts.dim() != 1:
        greedy_counts = greedy_counts.reshape(-1)
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    if next_drafts.stride(-1) != 1:
        next_drafts = next_drafts.contiguous()
    tables = inputs.tables
    _restage_kernel[(n,)](inputs.ids, inputs.positions, inputs.slots, inputs.index, inputs.context_lens, tables,
                          counts, greedy_counts, greedy_counts.stride(0), tokens, tokens.stride(0), next_drafts,
                          next_drafts.stride(0), tables.shape[1], inputs.block_size, Q=q,
                          Q_PAD=triton.next_power_of_2(q), num_warps=1)
