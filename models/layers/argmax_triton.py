"""The greedy choice of each logits row as Triton kernels (GPU): the fast set's ``argmax``.

Plain reference: ``torch.argmax(logits, dim=-1)``, the first index of the largest value. torch's reduction
gives a decode step's one or few rows of a 128k vocabulary to a handful of blocks: 27 us for one row and
39 us for 64 on an H200, beside a 24 us float32 copy of the logits before it (2026-12-03-decode-rows-
profile-nopdl-h200.json). Here each row is cut into ``BLOCK``-wide chunks, one program each (the row's
chunks spread over the GPU), every program keeps its chunk's largest value and first index, and a second
small kernel picks per row the largest of those, the first chunk on ties: the same index as torch's for
rows without NaN, read in the logits' own dtype (no float32 copy). Both launched with PDL where on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open

BLOCK = 4096


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
def _rows_argmax_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS, C_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    vals = tl.load(val_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    _, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + at))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] (any float dtype, unit stride along the vocabulary) -> [n] int64, the first index
    of each row's largest value; torch.argmax where the rows are not unit-stride."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1 or not n or not vocab:
        return logits.argmax(dim=-1)
    chunks = triton.cdiv(vocab, BLOCK)
    vals = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, chunks), dtype=torch.int64, device=logits.device)
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(n, chunks)](logits, vals, idx, vocab, logits.stride(0), chunks, BLOCK=BLOCK, num_warps=8,
                                      **pdl_launch())
    _rows_argmax_kernel[(n,)](vals, idx, out, chunks, C_PAD=max(2, triton.next_power_of_2(chunks)), num_warps=1,
                              **pdl_launch())
    return out
