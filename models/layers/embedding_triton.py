"""A vocab shard's embedding rows in one Triton kernel (GPU): the fast set's ``embedding``.

Plain reference: ``vocab_embedding.embedding_lookup`` — each id's row of this rank's shard of the table, zeros
for ids another rank holds. Torch ran that as seven kernels and two device copies at the head of every step
(the shift, two compares and their or, the ids' masked fill, the gather, the rows' masked fill): 13.5 us of a
SmolLM2 decode step's critical path on an H100 (2026-12-06-verify-per-launch-attribution-smollm2-h100.json),
1.4-1.5 us as this kernel (2026-12-06-verify-stage-embedding-ab-smollm2-h100.json). Here a program per (row,
column block) reads the row's id and copies the shard's row or writes zeros. Launched with PDL where on: the ids come from the
step's inputs or a kernel before, so it waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open

BLOCK = 1024


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, start, rows, H, stride_w, stride_o, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + row).to(tl.int64) - start
    inside = (local >= 0) & (local < rows)
    v = tl.load(w_ptr + tl.where(inside, local, 0) * stride_w + cols, mask=cols < tl.where(inside, H, 0), other=0.0)
    tl.store(out_ptr + row * stride_o + cols, v, mask=cols < H)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [n] (any integer dtype); weight [rows, H], this rank's shard starting at vocab row ``start`` ->
    [n, H]: the shard's row for an id it holds, zeros otherwise; the reference for non-unit-stride tables."""
    from .vocab_embedding import embedding_lookup

    if ids.dim() != 1 or weight.stride(-1) != 1:
        return embedding_lookup(ids, weight, start)
    n, width = ids.shape[0], weight.shape[1]
    out = torch.empty((n, width), dtype=weight.dtype, device=weight.device)
    if n:
        block = min(BLOCK, triton.next_power_of_2(width))
        _embedding_kernel[(n, triton.cdiv(width, block))](ids.contiguous(), weight, out, start, weight.shape[0], width,
                                                          weight.stride(0), out.stride(0), BLOCK=block,
                                                          num_warps=4, **pdl_launch())
    return out
