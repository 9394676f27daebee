"""An EAGLE3 draft step's input row in one Triton kernel (GPU): the fast set's ``draft_input``.

Plain reference: ``draft_input.draft_input`` — the token's embedding row and the hidden state, each
RMS-normed with its own weight, side by side ([n, 2H]). Torch ran it as four kernels a draft step (the
embedding's gather, two norms, the concatenation; 2026-12-05-spec-staged-round-smollm2-h200.json's draft
graphs); here one program per row does all of it, rounding as ``rms_norm_triton`` does (the normed row
rounded to the input dtype, then times the weight). Launched with PDL where on: the norm weights are read
before the wait (no kernel writes them), the token ids and hidden states after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_release, pdl_wait


@triton.jit
def _normed(x, w, n_cols, eps):
    xf = x.to(tl.float32)
    h = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    return (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype)


@triton.jit
def _draft_input_kernel(ids_ptr, table_ptr, hidden_ptr, we_ptr, wh_ptr, out_ptr, stride_t, stride_h, stride_o, n_cols,
                        eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    we = tl.load(we_ptr + cols, mask=mask, other=0.0)
    wh = tl.load(wh_ptr + cols, mask=mask, other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    e = tl.load(table_ptr + tok * stride_t + cols, mask=mask, other=0.0)
    h = tl.load(hidden_ptr + row * stride_h + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _normed(e, we, n_cols, eps), mask=mask)
    tl.store(out_ptr + row * stride_o + n_cols + cols, _normed(h, wh, n_cols, eps), mask=mask)


def draft_input_triton(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                       w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """ids [n]; table [vocab, H]; hidden [n, H] (its dtype the table's) -> [n, 2H]; the reference where the rows
    are not unit-stride or the dtypes differ."""
    from .draft_input import draft_input

    n, width = hidden.shape
    if (table.stride(-1) != 1 or hidden.stride(-1) != 1 or hidden.dtype != table.dtype or table.shape[1] != width
            or ids.dim() != 1 or ids.shape[0] != n):
        return draft_input(ids, table, hidden, w_embed, w_hidden, eps)
    ids = ids.contiguous()  # read at unit stride (a chain's column of drafts would not be)
    out = torch.empty((n, 2 * width), dtype=hidden.dtype, device=hidden.device)
    if n:
        block = triton.next_power_of_2(width)
        _draft_input_kernel[(n,)](ids, table, hidden, w_embed, w_hidden, out, table.stride(0), hidden.stride(0),
                                  out.stride(0), width, eps, BLOCK=block, num_warps=8 if block >= 4096 else 4,
                                  **pdl_launch())
    return out
