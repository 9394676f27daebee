"""The greedy choice of each logits row as Triton kernels (GPU): the fast set's ``argmax``.

Plain reference: ``torch.argmax(logits, dim=-1)``, the first index of the largest value. torch's reduction
gives a decode step's one or few rows of a 128k vocabulary to a handful of blocks: 27 us for one row and
39 us for 64 on an H200, beside a 24 us float32 copy of the logits before it (2026-12-03-decode-rows-
profile-nopdl-h200.json). Here each row is cut into ``BLOCK``-wide chunks, one program each (the row's
chunks spread over the GPU), every program keeps its chunk's largest value and first index, and a second
small kernel picks per row the largest of those, the first chunk on ties: the same index as torch's for
rows without NaN, read in the logits' own dtype (no float32 copy). Both launched with PDL where on.

``argmax_to_triton(logits, table)``: ``table[argmax(row)]`` (an EAGLE3 draft's greedy choice as target ids;
reference ``draft_input.argmax_to``), torch's reduction and gather were two kernels a draft step. A vocabulary
of at most ``ONE_PROGRAM`` (a draft's: 16 384 for SmolLM2's, 32 000 for Llama-3's) is one program per row,
table read and all: one launch; a larger one the two kernels above, the second reading the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open

BLOCK = 4096
ONE_PROGRAM = 32768


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * CHUNKS + chunk, best)
    tl.store(idx_ptr + row * CHUNKS + chunk, (chunk * BLOCK + at).to(tl.int64))


@triton.jit
def _rows_argmax_kernel(val_ptr, idx_ptr, out_ptr, table_ptr, CHUNKS, C_PAD: tl.constexpr, HAS_TABLE: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    vals = tl.load(val_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    _, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best = tl.load(idx_ptr + row * CHUNKS + at)
    if HAS_TABLE:
        best = tl.load(table_ptr + best)
    tl.store(out_ptr + row, best)


@triton.jit
def _row_argmax_to_kernel(x_ptr, table_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the row's first largest index, through the table."""
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    _, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(table_ptr + at.to(tl.int64)))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] (any float dtype, unit stride along the vocabulary) -> [n] int64, the first index
    of each row's largest value; torch.argmax where the rows are not unit-stride."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1 or not n or not vocab:
        return logits.argmax(dim=-1)
    return _argmax(logits, None)


def _argmax(logits: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """The chunked argmax (two launches), through ``table`` when given."""
    n, vocab = logits.shape
    chunks = triton.cdiv(vocab, BLOCK)
    vals = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, chunks), dtype=torch.int64, device=logits.device)
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(n, chunks)](logits, vals, idx, vocab, logits.stride(0), chunks, BLOCK=BLOCK, num_warps=8,
                                      **pdl_launch())
    _rows_argmax_kernel[(n,)](vals, idx, out, table if table is not None else idx, chunks,
                              C_PAD=max(2, triton.next_power_of_2(chunks)), HAS_TABLE=table is not None, num_warps=1,
                              **pdl_launch())
    return out


def argmax_to_triton(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab]; table: [vocab] int64 -> [n] int64, table[argmax(row)] (the first largest index)."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1 or not n or not vocab or table.dtype != torch.int64 or table.stride(-1) != 1:
        return table[logits.argmax(dim=-1)]
    if vocab > ONE_PROGRAM:
        return _argmax(logits, table)
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    _row_argmax_to_kernel[(n,)](logits, table, out, vocab, logits.stride(0), BLOCK=triton.next_power_of_2(vocab),
                                num_warps=8, **pdl_launch())
    return out
