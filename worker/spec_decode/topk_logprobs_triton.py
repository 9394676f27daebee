"""The draft's top-k log-probabilities per row in one Triton kernel: ``log_softmax(x.float()).topk(k)``.

torch's top-k over a [rows, 32000] row is a radix select of some fifteen kernels, and the log-softmax two
more: ~38 us a draft step on an H200 at batch 1 of a topK-8 tree, the largest share of a tree round's
growth left after ``tree_expand_triton`` (bench/results/2026-12-02-tree-growth-gpu-h200.json). Here one
program holds a whole row (the draft vocabulary: at most ``MAX_VOCAB`` entries), takes its log-sum-exp and
then the k best, one reduction each, ties to the lower index; values as torch's (x - max) - log(sum).

    top_lp, top_ids = topk_logprobs_triton(logits, 8)  # [rows, 8] fp32 log-probabilities, int64 indices
    top_lp, targets = topk_logprobs_triton(logits, 8, d2t)  # the indices through a table, in the same launch
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_VOCAB = 65536  # one row in one program's registers (16 warps: at most 128 values a thread)


@triton.jit
def _topk_logprobs_kernel(x_ptr, vals_ptr, idx_ptr, table_ptr, V, stride, K: tl.constexpr, BLOCK: tl.constexpr,
                          MAPPED: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=0)
    log_sum = tl.log(tl.sum(tl.exp(x - mx), axis=0))
    for t in tl.static_range(K):
        v = tl.max(x, axis=0)
        i = tl.minimum(tl.min(tl.where(x == v, offs, BLOCK), axis=0), V - 1)  # lowest index; a NaN row: the last
        tl.store(vals_ptr + r * K + t, (v - mx) - log_sum)
        if MAPPED:  # the index through the table (a draft vocabulary's target ids)
            tl.store(idx_ptr + r * K + t, tl.load(table_ptr + i).to(tl.int64))
        else:
            tl.store(idx_ptr + r * K + t, i.to(tl.int64))
        x = tl.where(offs == i, float("-inf"), x)


def topk_logprobs_triton(logits: torch.Tensor, k: int, table: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [rows, V] (V <= MAX_VOCAB, rows contiguous) -> (log-probabilities [rows, k] fp32, descending,
    indices [rows, k] int64: ``table[index]`` where a table [V] is given, in the same launch)."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB or k > vocab:
        raise ValueError(f"top-{k} of a {vocab}-entry row: at most {MAX_VOCAB} entries and k <= entries")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    vals = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    if rows:
        block = triton.next_power_of_2(vocab)
        _topk_logprobs_kernel[(rows,)](logits, vals, idx, idx if table is None else table, vocab, logits.stride(0),
                                       K=k, BLOCK=block, MAPPED=table is not None,
                                       num_warps=16 if block >= 16384 else 4)
    return vals, idx
