"""``TreeGrowth.build`` in one Triton launch (one program per sequence): the verified trees from the candidates.

The torch build (``device_tree.py``) is some thirty-five small kernels at the end of every tree chain (two sorts,
scatters, gathers, concatenations, an identity mask and one gather-or pass per draft step): on an H100 a
tree-s6-k4-t16 draft graph ran 151 kernels against a chain-7 graph's 75, and 380 us against 201
(bench/results/2026-12-07-tree-in-flight-smollm2-h100.json). Here, per sequence:

- the ``num_nodes - 1`` best candidates by score, ties to the lower index (``device_tree.best``'s stable-sort
  rule), as a rank count: how many candidates beat each one, over column blocks of ``BLOCK_J`` candidates;
- their node indices in candidate order (a running count of the chosen ones), so parents come first;
- each node's token, depth and parent (the parent candidate's node index; 0 for the root's children), the root
  (node 0: its token, parent -1, depth 0) first;
- each node's ancestor mask: itself, then its parent, grandparent ... (at most ``STEPS`` of them, the draft's
  depth), by walking the parents held in registers.

    tokens, parents, depths, mask = tree_build_triton(scores, tokens, parents, depths, roots, num_nodes, steps)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_build_kernel(scores_ptr, tokens_ptr, parents_ptr, depths_ptr, roots_ptr, out_tok_ptr, out_par_ptr,
                       out_dep_ptr, out_mask_ptr, C, N, STEPS: tl.constexpr, C_PAD: tl.constexpr,
                       N_PAD: tl.constexpr, BLOCK_J: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, C_PAD)
    valid = i < C
    s = tl.load(scores_ptr + b * C + i, mask=valid, other=0.0)
    rank = tl.zeros([C_PAD], dtype=tl.int32)  # candidates that beat candidate i: a higher score, or equal and earlier
    for j0 in range(0, C, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        live = j < C
        sj = tl.load(scores_ptr + b * C + j, mask=live, other=0.0)
        beats = ((sj[None, :] > s[:, None]) | ((sj[None, :] == s[:, None]) & (j[None, :] < i[:, None]))) & live[None, :]
        rank += tl.sum(beats.to(tl.int32), axis=1)
    chosen = (valid & (rank < N - 1)).to(tl.int32)
    node_of = tl.where(chosen != 0, tl.cumsum(chosen, axis=0), -1)  # 1 + chosen ones before: candidate order
    r = tl.arange(0, N_PAD)  # node index
    real = (r >= 1) & (r < N)
    hit = (chosen[None, :] != 0) & (node_of[None, :] == r[:, None])  # [N_PAD, C_PAD]: node r is candidate i
    cand = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
    tok = tl.load(tokens_ptr + b * C + cand, mask=real, other=0)
    dep = tl.load(depths_ptr + b * C + cand, mask=real, other=0)
    pc = tl.load(parents_ptr + b * C + cand, mask=real, other=-1)
    par = tl.sum(tl.where(i[None, :] == pc[:, None], node_of[None, :], 0), axis=1)  # the parent candidate's node
    par = tl.where(pc < 0, 0, par)  # a root child's
    root = tl.load(roots_ptr + b)
    tok = tl.where(r == 0, root, tok)
    par = tl.where(r == 0, -1, par)
    dep = tl.where(r == 0, 0, dep)
    keep = r < N
    tl.store(out_tok_ptr + b * N + r, tok.to(tl.int64), mask=keep)
    tl.store(out_par_ptr + b * N + r, par.to(tl.int64), mask=keep)
    tl.store(out_dep_ptr + b * N + r, dep.to(tl.int64), mask=keep)
    col = tl.arange(0, N_PAD)
    mask = col[None, :] == r[:, None]
    up = par  # each node's ancestor at the current step up, -1 past the root
    for _ in tl.static_range(STEPS):
        mask = mask | ((col[None, :] == up[:, None]) & (up[:, None] >= 0))
        nxt = tl.sum(tl.where(col[None, :] == up[:, None], par[None, :], 0), axis=1)  # par[up]
        up = tl.where(up >= 0, nxt, -1)
    tl.store(out_mask_ptr + (b * N + r)[:, None] * N + col[None, :], mask.to(tl.int8),
             mask=keep[:, None] & (col < N)[None, :])


def tree_build_triton(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                      roots: torch.Tensor, num_nodes: int, steps: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verified trees (``DeviceTree``'s fields: tokens, parents, depths [B, num_nodes] int64, masks
    [B, num_nodes, num_nodes] bool) from the candidates (``scores`` float64, ``tokens``, ``parents``, ``depths``
    [B, C]) and the roots' tokens [B]; ``steps``: the draft's steps (the deepest node)."""
    b, size = scores.shape
    if num_nodes - 1 > size or num_nodes < 1:
        raise ValueError(f"a tree of {num_nodes} nodes from {size} candidates")
    scores, tokens, parents, depths = (t.contiguous() for t in (scores, tokens, parents, depths))
    roots = roots.reshape(b).contiguous()
    dev = scores.device
    out = [torch.empty((b, num_nodes), dtype=torch.long, device=dev) for _ in range(3)]
    mask = torch.empty((b, num_nodes, num_nodes), dtype=torch.bool, device=dev)
    c_pad = triton.next_power_of_2(size)
    _tree_build_kernel[(b,)](scores, tokens, parents, depths, roots, *out, mask.view(torch.int8), size, num_nodes,
                             STEPS=steps, C_PAD=c_pad, N_PAD=triton.next_power_of_2(num_nodes),
                             BLOCK_J=max(1, min(c_pad, 4096 // c_pad)), num_warps=4 if c_pad <= 128 else 8)
    return out[0], out[1], out[2], mask
