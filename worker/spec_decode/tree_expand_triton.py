"""``TreeGrowth.expand`` in one Triton kernel per draft step (one program per sequence).

The torch expand (``device_tree.py``) is some twenty small kernels a step (gathers, float64 arithmetic,
two stable sorts, slice writes), ~0.9 ms of a seven-step tree's GPU time on an H200 at batch 1
(bench/results/2026-12-02-graph-launch-probe-tree-chain-metadata-smollm2-h200.json). Here one program
per sequence: the fed leaves' k x k children get their scores (the parent's plus its own log-probability,
kept at most the parent's, float64), are written as candidates, and the k best (ties to the lower index)
become the next leaves in candidate order, with their parents' output hidden states and ancestor masks.
The choice is a rank count over the k x k children (each child: how many others beat it), exactly
``device_tree.best``'s stable-sort rule for finite scores.

    new_leaves, new_hidden, new_mask = tree_expand_triton(top_tokens, top_logprobs, out_hidden, fed_mask,
                                                          scores, tokens, parents, depths, leaves, lo, depth)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["lo", "depth"])  # counts that change call to call: one compile for all
def _tree_expand_kernel(top_tok_ptr, top_lp_ptr, hid_ptr, fed_ptr, scores_ptr, tokens_ptr, parents_ptr,
                        depths_ptr, leaves_ptr, new_leaves_ptr, new_hid_ptr, new_mask_ptr,
                        C, H, W, lo, depth,
                        K: tl.constexpr, KK: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    i = tl.arange(0, KK)  # child i of fed leaf i // K, its (i % K)-th top-k entry
    valid = i < K * K
    row = i // K
    leaf = tl.load(leaves_ptr + b * K + row, mask=valid, other=0)
    base = tl.load(scores_ptr + b * C + leaf, mask=valid, other=0.0)
    lp = tl.load(top_lp_ptr + (b * K + row) * K + i % K, mask=valid, other=0.0).to(tl.float64)
    sc = tl.minimum(base, base + lp)
    tok = tl.load(top_tok_ptr + (b * K + row) * K + i % K, mask=valid, other=0)
    out = b * C + lo + i
    tl.store(tokens_ptr + out, tok, mask=valid)
    tl.store(parents_ptr + out, leaf, mask=valid)
    tl.store(depths_ptr + out, tl.zeros([KK], dtype=tl.int64) + depth, mask=valid)
    tl.store(scores_ptr + out, sc, mask=valid)
    # rank_i: the children that beat child i (a higher score, or the same at a lower index)
    si = sc[:, None]
    sj = sc[None, :]
    ii = i[:, None]
    jj = i[None, :]
    beats = ((sj > si) | ((sj == si) & (jj < ii))) & valid[None, :]
    rank = tl.sum(beats.to(tl.int32), axis=1)
    chosen = valid & (rank < K)
    # pos_i: chosen children before child i = child i's place among the new leaves (candidate order)
    before = chosen[None, :] & (jj < ii)
    pos = tl.sum(before.to(tl.int32), axis=1)
    r = tl.arange(0, KP)
    hit = chosen[None, :] & (pos[None, :] == r[:, None])  # [KP, KK]: new leaf r is child i
    child = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
    parent_row = child // K
    live = r < K
    tl.store(new_leaves_ptr + b * K + r, (lo + child).to(tl.int64), mask=live)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = live[:, None] & (h < H)[None, :]
        x = tl.load(hid_ptr + (b * K + parent_row)[:, None] * H + h[None, :], mask=m, other=0.0)
        tl.store(new_hid_ptr + (b * K + r)[:, None] * H + h[None, :], x, mask=m)
    w = tl.arange(0, BLOCK_W)
    m = live[:, None] & (w < W)[None, :]
    bits = tl.load(fed_ptr + (b * K + parent_row)[:, None] * W + w[None, :], mask=m, other=0)
    tl.store(new_mask_ptr + (b * K + r)[:, None] * W + w[None, :], bits, mask=m)


def tree_expand_triton(top_tokens: torch.Tensor, top_logprobs: torch.Tensor, out_hidden: torch.Tensor,
                       fed_mask: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       depths: torch.Tensor, leaves: torch.Tensor, lo: int, depth: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step's children into the candidate arrays (``scores``, ``tokens``, ``parents``, ``depths``
    [B, C], written at columns lo .. lo + k * k) and the next leaves. top_tokens, top_logprobs: [B * k, k];
    out_hidden: [B * k, H]; fed_mask: [B, k, W] bool (the fed leaves' masks); leaves: [B, k] (candidate
    indices of the fed leaves). -> new leaves [B, k], their hidden inputs [B, k, H], masks [B, k, W]."""
    b, k = leaves.shape
    hidden = out_hidden.shape[-1]
    width = fed_mask.shape[-1]
    size = scores.shape[1]
    for t in (scores, tokens, parents, depths):  # written in place
        if not t.is_contiguous():
            raise ValueError("tree_expand_triton writes contiguous candidate arrays")
    top_tokens, top_logprobs, out_hidden = top_tokens.contiguous(), top_logprobs.contiguous(), out_hidden.contiguous()
    fed_mask, leaves = fed_mask.contiguous(), leaves.contiguous()
    new_leaves = torch.empty_like(leaves)
    new_hidden = torch.empty((b, k, hidden), dtype=out_hidden.dtype, device=out_hidden.device)
    new_mask = torch.empty((b, k, width), dtype=torch.bool, device=fed_mask.device)
    kk = triton.next_power_of_2(k * k)
    _tree_expand_kernel[(b,)](top_tokens, top_logprobs, out_hidden, fed_mask.view(torch.int8), scores, tokens,
                              parents, depths, leaves, new_leaves, new_hidden, new_mask.view(torch.int8),
                              size, hidden, width, lo, depth, K=k, KK=kk, KP=triton.next_power_of_2(k),
                              BLOCK_H=min(triton.next_power_of_2(hidden), 256),
                              BLOCK_W=triton.next_power_of_2(max(width, 1)))
    return new_leaves, new_hidden, new_mask
