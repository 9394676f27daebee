"""A batch's EAGLE draft trees grown on the device: ``TreeBuilder``'s rule in fixed-shape tensor ops.

The host builder (``draft_tree.TreeBuilder``) reads every draft step's top-k back to grow its
candidate lists, a wait per step. ``TreeGrowth`` keeps the same candidates as tensors, so the draft
steps and the verify are queued back to back and the step waits once, for the verified tree and the
target's choices together. Per sequence (B of them), ``k`` = topk, ``S`` = draft steps:

- candidates ``[B, C]``, C = k + (S - 1) k²: the root's k children (from the first pass), then the k
  children of each of the k leaves fed at steps 1 .. S - 1; each has a token (target id), a parent
  candidate (-1 = the root), a depth (1 = a root child) and a score: the parent's plus its own
  draft log-probability (kept at most the parent's, as the host's), in float64 as the host's Python
  floats, so both rank alike;
- the leaves fed at step j: the k best of step j - 1's new candidates (all k root children at j = 1),
  in candidate order, at RoPE ``n + j`` and cache slots ``n + (j - 1) k + r``; each attends to the
  bases, the slots of its ancestors (fed leaves all) and its own (``feed``);
- ``build``: the root and the ``num_nodes - 1`` best candidates in candidate order (parents first),
  their parents as node indices, depths, and each node's ancestor mask over the tree's nodes.

"Best" is by score, ties to the earlier candidate (a stable sort), as ``TreeBuilder.best``; a child
never outranks its parent, so a chosen node's parent is chosen too.

Behind a tree's verify (``tree_verify_program.py``, the torch reference of its one-launch kernel), in the same
fixed-shape ops: the parents read off the verify's masks (``parents_from_mask``), the greedy walk
(``accept_greedy_on_device``: ``draft_tree.accept_greedy``), the accepted nodes' rows as a prefix
(``accepted_node_rows``) and where their K/V go (``accepted_moves``: ``draft_tree.relocation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

# (top_tokens, top_logprobs, size, width) -> (tokens, parents, depths, scores, leaves, fed mask): the candidate arrays
# and the first feed in one launch (``tree_expand_triton.tree_start_triton``)
StartKernel = Callable[..., tuple[torch.Tensor, ...]]
# (top_tokens, top_logprobs, out_hidden, fed_mask, scores, tokens, parents, depths, leaves, lo, depth)
#   -> (new leaves, their hidden inputs, their fed masks, their tokens): one step's expand and the next feed on the
#   device (``tree_expand_triton``)
ExpandKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
# (scores, tokens, parents, depths, roots, num_nodes, steps) -> the verified trees' tokens, parents, depths, masks:
# ``build`` in one launch (``tree_build_triton``)
BuildKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class TreeKernels(NamedTuple):
    """A growth's fused kernels (GPU): the start and each step's expand, and the build (None: the torch build)."""

    start: StartKernel
    expand: ExpandKernel
    build: BuildKernel | None = None


@dataclass(frozen=True)
class DeviceTree:
    """Verified trees of a batch, on the device (node 0 = the root)."""

    tokens: torch.Tensor  # [B, N] target ids
    parents: torch.Tensor  # [B, N] node indices, -1 for the root
    depths: torch.Tensor  # [B, N]
    mask: torch.Tensor  # [B, N, N] bool: each node's ancestors and itself


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` best of each row ([B, M] -> [B, k]) by score, ties to the lower index,
    in ascending index order."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values


class TreeGrowth:
    """One batch's candidates, grown step by step on the device (``feed``, then ``expand``)."""

    def __init__(self, root_tokens: torch.Tensor, top_tokens: torch.Tensor, top_logprobs: torch.Tensor,
                 root_hidden: torch.Tensor, num_steps: int, kernels: TreeKernels | None = None) -> None:
        """The root's children. root_tokens: [B]; top_tokens, top_logprobs: [B, k] (the first pass's
        top-k, target ids); root_hidden: [B, H] (what the root's children are fed). ``kernels``: the start,
        each step's expand (with the next feed) and the build in a launch each (``tree_expand_triton``,
        ``tree_build_triton``, on a GPU); None = the torch ops here."""
        self._kernels = kernels
        self.build = self._build_torch if kernels is None or kernels.build is None else self._build_fused
        b, k = top_tokens.shape
        dev = top_tokens.device
        self.k, self.num_steps = k, num_steps
        size = k + (num_steps - 1) * k * k
        width = max(num_steps - 1, 1) * k
        self.root_tokens = root_tokens
        self.leaf_hidden = root_hidden[:, None, :].expand(b, k, root_hidden.shape[-1]).contiguous()
        self.step = 1
        if kernels is not None:  # the fed leaves' tokens and masks (own slot set) come from the start, then each expand
            self.feed, self.expand = self._feed_fused, self._expand_fused
            (self.tokens, self.parents, self.depths, self.scores, self.leaves,
             self._fed_mask) = kernels.start(top_tokens, top_logprobs, size, width)
            self._fed_tokens = top_tokens
            return
        self.feed, self.expand = self._feed_torch, self._expand_torch
        self.tokens = torch.zeros((b, size), dtype=torch.long, device=dev)
        self.parents = torch.full((b, size), -1, dtype=torch.long, device=dev)
        self.depths = torch.ones((b, size), dtype=torch.long, device=dev)
        self.scores = torch.full((b, size), float("-inf"), dtype=torch.float64, device=dev)
        self.tokens[:, :k] = top_tokens
        self.scores[:, :k] = top_logprobs.double().clamp(max=0.0)
        self.leaves = torch.arange(k, device=dev).expand(b, k).contiguous()  # candidate indices, fed next
        self.leaf_mask = torch.zeros((b, k, width), dtype=torch.bool, device=dev)  # ancestors' scratch slots
        # the slot of the r-th leaf fed at step j, as a mask row [k, width] per step (made once)
        # (made with device ops alone: this also runs inside a CUDA graph capture)
        own_col = torch.arange(max(num_steps - 1, 1), device=dev)[:, None] * k + torch.arange(k, device=dev)
        self._own = own_col[:, :, None] == torch.arange(width, device=dev)  # [steps - 1, k, width]

    def _feed_torch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``self.step``'s inputs (``feed``): tokens [B * k], hidden [B * k, H], mask rows [B * k, step * k]
        over the scratch slots (ancestors' and its own)."""
        j, k = self.step, self.k
        b = self.leaves.shape[0]
        tokens = self.tokens.gather(1, self.leaves)
        self._fed_mask = self.leaf_mask | self._own[j - 1]  # each fed leaf's ancestors and itself
        rows = self._fed_mask[:, :, : j * k]
        return tokens.reshape(b * k), self.leaf_hidden.reshape(b * k, -1), rows.reshape(b * k, j * k)

    def _feed_fused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``feed`` from what the start or the last expand wrote: views, no launch (the mask rows a strided view of
        the fed masks' first ``step * k`` columns)."""
        j, k = self.step, self.k
        b = self.leaves.shape[0]
        return (self._fed_tokens.reshape(b * k), self.leaf_hidden.reshape(b * k, -1),
                self._fed_mask.view(b * k, -1)[:, : j * k])

    def _expand_fused(self, top_tokens: torch.Tensor, top_logprobs: torch.Tensor, out_hidden: torch.Tensor) -> None:
        """``expand`` in one kernel: the same candidates, leaves and hidden inputs, and the next feed's tokens and
        masks."""
        j, k = self.step, self.k
        assert self._kernels is not None
        self.leaves, self.leaf_hidden, self._fed_mask, self._fed_tokens = self._kernels.expand(
            top_tokens, top_logprobs, out_hidden, self._fed_mask, self.scores, self.tokens, self.parents,
            self.depths, self.leaves, k + (j - 1) * k * k, j + 1)
        self.step += 1

    def _expand_torch(self, top_tokens: torch.Tensor, top_logprobs: torch.Tensor, out_hidden: torch.Tensor) -> None:
        """The fed leaves' children (``expand``). top_tokens, top_logprobs: [B * k, k] (each fed leaf's top-k,
        target ids); out_hidden: [B * k, H] (the draft's output per fed leaf: its children's hidden input)."""
        j, k = self.step, self.k
        b = self.leaves.shape[0]
        base = self.scores.gather(1, self.leaves)[:, :, None]  # [B, k, 1]
        lp = top_logprobs.view(b, k, k).double()
        scores = torch.minimum(base, base + lp).reshape(b, k * k)
        lo = k + (j - 1) * k * k
        self.tokens[:, lo: lo + k * k] = top_tokens.view(b, k * k)
        self.parents[:, lo: lo + k * k] = self.leaves[:, :, None].expand(b, k, k).reshape(b, k * k)
        self.depths[:, lo: lo + k * k] = j + 1
        self.scores[:, lo: lo + k * k] = scores
        chosen = best(scores, k)  # [B, k] among the k * k new ones
        parent_row = chosen // k  # which fed leaf each new leaf hangs under
        self.leaves = lo + chosen
        h = out_hidden.view(b, k, -1)
        self.leaf_hidden = h.gather(1, parent_row[:, :, None].expand(b, k, h.shape[-1]))
        self.leaf_mask = self._fed_mask.gather(1, parent_row[:, :, None].expand(b, k, self._fed_mask.shape[-1]))
        self.step += 1

    def _build_fused(self, num_nodes: int) -> DeviceTree:
        """``build`` in one kernel: the same trees."""
        assert self._kernels is not None and self._kernels.build is not None
        return DeviceTree(*self._kernels.build(self.scores, self.tokens, self.parents, self.depths, self.root_tokens,
                                              num_nodes, self.num_steps))

    def _build_torch(self, num_nodes: int) -> DeviceTree:
        """The verified trees (``build``): the root and the ``num_nodes - 1`` best candidates."""
        b, size = self.tokens.shape
        dev = self.tokens.device
        chosen = best(self.scores, num_nodes - 1)  # [B, N - 1], candidate order = parents first
        node_of = torch.full((b, size), -1, dtype=torch.long, device=dev)
        node_of.scatter_(1, chosen, torch.arange(1, num_nodes, device=dev).expand(b, num_nodes - 1).contiguous())
        parent_cand = self.parents.gather(1, chosen)
        parents = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
        minus_one = torch.full((b, 1), -1, dtype=torch.long, device=dev)
        parents = torch.cat([minus_one, parents], dim=1)
        tokens = torch.cat([self.root_tokens.view(b, 1).long(), self.tokens.gather(1, chosen)], dim=1)
        depths = torch.cat([torch.zeros((b, 1), dtype=torch.long, device=dev), self.depths.gather(1, chosen)], dim=1)
        mask = torch.eye(num_nodes, dtype=torch.bool, device=dev).expand(b, num_nodes, num_nodes).contiguous()
        up = parents.clamp(min=0)[:, :, None].expand(b, num_nodes, num_nodes)
        for _ in range(self.num_steps):  # depth <= num_steps: each pass adds one more generation of ancestors
            mask = mask | mask.gather(1, up)
        return DeviceTree(tokens, parents, depths, mask)


@dataclass(frozen=True)
class DeviceAcceptance:
    """Greedy acceptance of a batch's trees, on the device (``accept_greedy_on_device``)."""

    path: torch.Tensor  # [B, depth] the accepted nodes, root to leaf, then -1
    count: torch.Tensor  # [B] how many
    bonus: torch.Tensor  # [B] the target's choice after the last accepted node
    tokens: torch.Tensor  # [B, depth + 1] the tokens gained: the accepted nodes', then the bonus, then 0


def accept_greedy_on_device(tokens: torch.Tensor, parents: torch.Tensor, argmax: torch.Tensor, depth: int
                            ) -> DeviceAcceptance:
    """``draft_tree.accept_greedy`` for a batch of trees in fixed-shape tensor ops (CUDA-graph capturable, nothing
    read back): from the root, a child is accepted while its token is the target's choice at its parent, the
    first such child (lowest node index) where siblings share a token, at most ``depth`` levels. tokens, parents,
    argmax: [B, N] (node 0 the root, ``argmax[:, i]`` the target's choice after node i)."""
    b, n = tokens.shape
    dev = tokens.device
    node = torch.zeros(b, dtype=torch.long, device=dev)
    live = torch.ones(b, dtype=torch.bool, device=dev)
    ids = torch.arange(n, device=dev).expand(b, n)
    path = torch.full((b, depth), -1, dtype=torch.long, device=dev)
    gained = torch.zeros((b, depth + 1), dtype=torch.long, device=dev)
    count = torch.zeros(b, dtype=torch.long, device=dev)
    for d in range(depth):
        choice = argmax.gather(1, node[:, None])  # [B, 1]
        match = (parents == node[:, None]) & (tokens == choice)
        nxt = torch.where(match, ids, n).min(dim=1).values  # the first matching child, n for none
        live = live & (nxt < n)
        node = torch.where(live, nxt, node)
        path[:, d] = torch.where(live, nxt, -1)
        gained[:, d] = torch.where(live, choice[:, 0], 0)
        count = count + live.long()
    bonus = argmax.gather(1, node[:, None])[:, 0]
    gained.scatter_(1, count[:, None], bonus[:, None])
    return DeviceAcceptance(path, count, bonus, gained)


def accepted_node_rows(path: torch.Tensor) -> torch.Tensor:
    """Each sequence's accepted nodes as verify rows in root-to-leaf order, the root first: [B, depth] ->
    [B, depth + 1] node indices (past a sequence's count, the root again: rows a staged first pass drops). Gathering
    a verify's per-node rows (aux states, argmax) by them makes a tree's accepted rows a prefix, as a chain's are."""
    root = torch.zeros((path.shape[0], 1), dtype=torch.long, device=path.device)
    return torch.cat([root, path.clamp(min=0)], dim=1)


def accepted_moves(slots: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """Where the accepted nodes' K/V go (``draft_tree.relocation``'s moves, without a read-back): the node at depth d
    (``path[:, d - 1]``, -1 past a sequence's count) from its verify slot to the slot of node index d, the slots the
    verify gave each node (``slots`` [B, N]); past the count a slot to itself. -> [B, 2 * depth]: sources, then
    destinations (``tree_verify_program.apply_moves`` reads every source before it writes any destination: a node's
    index is at least its depth, so a move may read a slot another writes)."""
    depth = path.shape[1]
    dst = slots[:, 1:depth + 1]
    return torch.cat([torch.where(path >= 0, slots.gather(1, path.clamp(min=0)), dst), dst], dim=1)


def parents_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Each node's parent from the trees' ancestor masks (``DeviceTree.mask``, what a tree verify's static inputs
    hold as its tail mask): the nearest ancestor, the one of highest index below the node's own (-1 for the root).
    mask: [B, N, N] bool -> [B, N]"""
    n = mask.shape[-1]
    j = torch.arange(n, device=mask.device)
    below = mask & (j[None, None, :] < j[None, :, None])
    return torch.where(below, j, -1).max(dim=-1).values

