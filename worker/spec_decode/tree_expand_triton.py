"""``TreeGrowth.expand`` in one Triton kernel per draft step (one program per sequence).

The torch expand (``device_tree.py``) is some twenty small kernels a step (gathers, float64 arithmetic,
two stable sorts, slice writes), ~0.9 ms of a seven-step tree's GPU time on an H200 at batch 1
(bench/results/2026-12-02-graph-launch-probe-tree-chain-metadata-smollm2-h200.json). Here one program
per sequence: the fed leaves' k x k children get their scores (the parent's plus its own log-probability,
kept at most the parent's, float64), are written as candidates, and the k best (ties to the lower index)
become the next leaves in candidate order, with their parents' output hidden states and ancestor masks.
The choice is a rank count over the k x k children (each child: how many others beat it), exactly
``device_tree.best``'s stable-sort rule for finite scores. The same launch writes the next step's feed: the new
leaves' tokens and their masks with their own slot set, so ``TreeGrowth.feed`` launches nothing.
``tree_start_triton`` makes the candidate arrays and the first feed in one launch (some seventeen torch kernels).

    tokens, parents, depths, scores, leaves, fed_mask = tree_start_triton(top_tokens, top_logprobs, size, width)
    leaves, hidden, fed_mask, fed_tokens = tree_expand_triton(top_tokens, top_logprobs, out_hidden, fed_mask,
                                                              scores, tokens, parents, depths, leaves, lo, depth)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["lo", "depth"])  # counts that change call to call: one compile for all
def _tree_expand_kernel(top_tok_ptr, top_lp_ptr, hid_ptr, fed_ptr, scores_ptr, tokens_ptr, parents_ptr,
                        depths_ptr, leaves_ptr, new_leaves_ptr, new_hid_ptr, new_mask_ptr, new_tok_ptr,
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
    tl.store(new_tok_ptr + b * K + r, tl.sum(tl.where(hit, tok[None, :], 0), axis=1).to(tl.int64), mask=live)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = live[:, None] & (h < H)[None, :]
        x = tl.load(hid_ptr + (b * K + parent_row)[:, None] * H + h[None, :], mask=m, other=0.0)
        tl.store(new_hid_ptr + (b * K + r)[:, None] * H + h[None, :], x, mask=m)
    w = tl.arange(0, BLOCK_W)
    m = live[:, None] & (w < W)[None, :]
    bits = tl.load(fed_ptr + (b * K + parent_row)[:, None] * W + w[None, :], mask=m, other=0)
    own = w[None, :] == (depth - 1) * K + r[:, None]  # the new leaf's own slot at the next step (none past the last)
    tl.store(new_mask_ptr + (b * K + r)[:, None] * W + w[None, :], tl.where(own, 1, bits).to(tl.int8), mask=m)


@triton.jit
def _tree_start_kernel(top_tok_ptr, top_lp_ptr, tokens_ptr, parents_ptr, depths_ptr, scores_ptr, leaves_ptr,
                       mask_ptr, C, W, K: tl.constexpr, KP: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, KP)
    live = r < K
    tl.store(tokens_ptr + b * C + r, tl.load(top_tok_ptr + b * K + r, mask=live, other=0).to(tl.int64), mask=live)
    tl.store(parents_ptr + b * C + r, tl.zeros([KP], dtype=tl.int64) - 1, mask=live)
    tl.store(depths_ptr + b * C + r, tl.zeros([KP], dtype=tl.int64) + 1, mask=live)
    lp = tl.load(top_lp_ptr + b * K + r, mask=live, other=0.0).to(tl.float64)
    tl.store(scores_ptr + b * C + r, tl.minimum(lp, 0.0), mask=live)
    tl.store(leaves_ptr + b * K + r, r.to(tl.int64), mask=live)
    w = tl.arange(0, BLOCK_W)
    tl.store(mask_ptr + (b * K + r)[:, None] * W + w[None, :], (w[None, :] == r[:, None]).to(tl.int8),
             mask=live[:, None] & (w < W)[None, :])


def tree_expand_triton(top_tokens: torch.Tensor, top_logprobs: torch.Tensor, out_hidden: torch.Tensor,
                       fed_mask: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       depths: torch.Tensor, leaves: torch.Tensor, lo: int, depth: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step's children into the candidate arrays (``scores``, ``tokens``, ``parents``, ``depths``
    [B, C], written at columns lo .. lo + k * k) and the next leaves. top_tokens, top_logprobs: [B * k, k];
    out_hidden: [B * k, H]; fed_mask: [B, k, W] bool (the fed leaves' masks, each with its own slot); leaves:
    [B, k] (candidate indices of the fed leaves); ``depth``: the new leaves' (the step that feeds them). -> new
    leaves [B, k], their hidden inputs [B, k, H], masks [B, k, W] (their ancestors' slots and their own at that
    step: column (depth - 1) k + r, none past the last step) and tokens [B, k]: the next feed."""
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
    new_tokens = torch.empty_like(leaves)
    kk = triton.next_power_of_2(k * k)
    _tree_expand_kernel[(b,)](top_tokens, top_logprobs, out_hidden, fed_mask.view(torch.int8), scores, tokens,
                              parents, depths, leaves, new_leaves, new_hidden, new_mask.view(torch.int8), new_tokens,
                              size, hidden, width, lo, depth, K=k, KK=kk, KP=triton.next_power_of_2(k),
                              BLOCK_H=min(triton.next_power_of_2(hidden), 256),
                              BLOCK_W=triton.next_power_of_2(max(width, 1)))
    return new_leaves, new_hidden, new_mask, new_tokens


def tree_start_triton(top_tokens: torch.Tensor, top_logprobs: torch.Tensor, size: int, width: int
                      ) -> tuple[torch.Tensor, ...]:
    """A growth's candidate arrays and first feed in one launch: the root's children (the first pass's top-k:
    ``top_tokens``, ``top_logprobs`` [B, k]) as candidates 0 .. k - 1 (parent -1, depth 1, score the log-probability
    kept at most 0, float64); the later columns are left for the expands to write. -> tokens, parents, depths,
    scores [B, size], the leaves fed first [B, k] (candidates 0 .. k - 1) and their masks [B, k, width] (each its own
    slot, column r)."""
    b, k = top_tokens.shape
    dev = top_tokens.device
    tokens, parents, depths = (torch.empty((b, size), dtype=torch.long, device=dev) for _ in range(3))
    scores = torch.empty((b, size), dtype=torch.float64, device=dev)
    leaves = torch.empty((b, k), dtype=torch.long, device=dev)
    mask = torch.empty((b, k, width), dtype=torch.bool, device=dev)
    _tree_start_kernel[(b,)](top_tokens.contiguous(), top_logprobs.contiguous(), tokens, parents, depths, scores,
                             leaves, mask.view(torch.int8), size, width, K=k, KP=triton.next_power_of_2(k),
                             BLOCK_W=triton.next_power_of_2(max(width, 1)))
    return tokens, parents, depths, scores, leaves, mask
