"""The routed experts' per-slot outputs summed per token, in one Triton launch (GPU; CUDA-graph capturable).

The expert kernels store each routed (token, slot) pair's weighted output at row ``token * k + slot`` of an
fp32 buffer. Plain reference: zero the buffer first, then ``buf.view(n, k, hidden).sum(1).to(dtype)`` (a
memset, a reduction and a cast). Here a program per (token, column block) adds the token's slots whose
local expert is on this rank (the others were never written, so the buffer needs no zeroing) and stores the sum
in the activations' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sum_kernel(buf_ptr, ids_ptr, out_ptr, hidden, num_experts, stride_b, stride_o, K: tl.constexpr,
                BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(K):
        e = tl.load(ids_ptr + t * K + s)
        if (e >= 0) & (e < num_experts):
            acc += tl.load(buf_ptr + (t * K + s) * stride_b + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slots(buf: torch.Tensor, local_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """buf: fp32 [n * k, hidden], the rows of pairs whose local id is outside [0, num_experts) unwritten;
    local_ids: [n, k] -> [n, hidden] in ``dtype``."""
    n, k = local_ids.shape
    hidden = buf.shape[1]
    out = torch.empty(n, hidden, dtype=dtype, device=buf.device)
    if n:
        _sum_kernel[(n, triton.cdiv(hidden, BLOCK))](buf, local_ids.contiguous(), out, hidden, num_experts,
                                                      buf.stride(0), out.stride(0), K=k, BLOCK=BLOCK, num_warps=4)
    return out
