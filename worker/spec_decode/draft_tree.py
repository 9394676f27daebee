"""A speculative draft tree: which tokens one verify forward checks, and how they attend (pure).

Node 0 is the root: the sequence's last known token (not yet in the cache). Every other node is
a draft token whose parent is an earlier node, so a chain of k drafts is ``parents = (-1, 0, 1,
.., k-1)``. Nodes are ordered parents-first; a node's depth is its distance from the root and
its RoPE position is ``num_cached + depth`` (siblings share a position), while its K/V slot is
``num_cached + index`` (the verify batch writes the nodes one after another).

Example, topk 2, root "a" with children "b", "c" and "b" with child "d"::

    tokens  = (a, b, c, d)
    parents = (-1, 0, 0, 1)
    depths  = (0, 1, 1, 2)
    mask (cached tokens all True, then the nodes):  a: a    b: a b    c: a c    d: a b d

``TreeBuilder`` grows the candidates the way sglang's EAGLE drafting does: each draft step
expands the ``topk`` best leaves (by cumulative draft log-probability) into ``topk`` children
each; the verified tree is the root plus the ``num_draft_tokens - 1`` best candidates overall.
A child's score never exceeds its parent's and ties go to the earlier candidate, so the chosen
set always contains every chosen node's parent.

``accept_greedy`` walks the tree with the target's argmax tokens: a child is accepted while its
token is the target's choice at its parent; the target's choice after the last accepted node is
the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node 0 = the root (last known token)
    parents: tuple[int, ...]  # parents[0] = -1; parents[i] < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError(f"a draft tree needs one parent per token: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"draft tree parents must name an earlier node (root first): {self.parents}")

    @staticmethod
    def chain(root: int, drafts: list[int]) -> DraftTree:
        return DraftTree((root, *drafts), tuple(range(-1, len(drafts))))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it (causal attention, consecutive positions)."""
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    @property
    def depths(self) -> tuple[int, ...]:
        return tree_depths(self.parents)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]


def tree_depths(parents: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return tuple(depths)


def tree_positions(parents: tuple[int, ...] | list[int], num_cached: int) -> tuple[int, ...]:
    """RoPE positions of the nodes: the root sits at ``num_cached``, a node at root + depth."""
    return tuple(num_cached + d for d in tree_depths(parents))


def tree_attention_mask(parents: tuple[int, ...] | list[int], num_cached: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Who each node may attend to: every cached token, its ancestors and itself.
    -> [num_nodes, num_cached + num_nodes] bool"""
    n = len(parents)
    mask = torch.zeros((n, num_cached + n), dtype=torch.bool)
    mask[:, :num_cached] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i, num_cached: num_cached + n] = mask[p, num_cached: num_cached + n]
        mask[i, num_cached + i] = True
    return mask.to(device) if device is not None else mask


@dataclass(frozen=True)
class Acceptance:
    """A verify outcome: the accepted draft nodes (root excluded, root to leaf) and the tokens the
    sequence gains (their tokens, then the bonus token)."""

    path: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @staticmethod
    def chain(drafts: list[int], count: int, token: int) -> Acceptance:
        """A chain's outcome decided elsewhere (on the device): its first ``count`` drafts, then ``token``."""
        return Acceptance(tuple(range(1, count + 1)), (*drafts[:count], token))


def accept_greedy(tree: DraftTree, target_argmax: list[int]) -> Acceptance:
    """Greedy verification. target_argmax[i]: the target's choice after node i (one per node)."""
    if len(target_argmax) != tree.num_nodes:
        raise ValueError(f"{len(target_argmax)} target tokens for a tree of {tree.num_nodes} nodes")
    path: list[int] = []
    node = 0
    while True:
        choice = target_argmax[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == choice), None)
        if nxt is None:
            tokens = [tree.tokens[i] for i in path] + [choice]
            return Acceptance(tuple(path), tuple(tokens))
        path.append(nxt)
        node = nxt


def relocation(path: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(from, to) node offsets that move the accepted nodes' K/V to their sequence positions:
    the k-th accepted node (1-based) belongs at offset k after the root."""
    return [(node, k) for k, node in enumerate(path, start=1) if node != k]


class TreeBuilder:
    """Candidates of one sequence's draft, grown step by step; ``build`` picks the verified tree. A
    candidate is an index into three parallel lists (token, parent candidate or -1 = the root, cumulative
    draft log-probability): a 64-node tree of 7 steps adds ~400 of them per engine step, on the host
    between two draft forwards."""

    def __init__(self, root_token: int) -> None:
        self.root_token = root_token
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._scores: list[float] = []

    @property
    def num_candidates(self) -> int:
        return len(self._tokens)

    def token(self, cand: int) -> int:
        return self._tokens[cand]

    def parent(self, cand: int) -> int:
        """The candidate's parent candidate; -1 = the root."""
        return self._parents[cand]

    def add_children(self, parent: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Candidates for ``tokens`` below ``parent`` (-1 = root); returns their indices."""
        base = 0.0 if parent < 0 else self._scores[parent]
        first = len(self._tokens)
        self._tokens += [int(t) for t in tokens]
        self._scores += [min(base, base + float(lp)) for lp in logprobs]
        self._parents += [parent] * (len(self._tokens) - first)
        return list(range(first, len(self._tokens)))

    def best(self, cands: list[int], k: int) -> list[int]:
        """The ``k`` best of ``cands`` by score (earlier first on ties), in candidate order."""
        score = self._scores
        ranked = sorted(cands, key=lambda c: (-score[c], c))[:k]
        return sorted(ranked)

    def build(self, num_nodes: int) -> DraftTree:
        """The root and the ``num_nodes - 1`` best candidates, parents first."""
        chosen = self.best(list(range(len(self._tokens))), num_nodes - 1)
        index = {c: i + 1 for i, c in enumerate(chosen)}
        parents = [-1]
        for c in chosen:
            p = self._parents[c]
            if p >= 0 and p not in index:
                raise RuntimeError(f"draft tree candidate {c} chosen without its parent {p}")
            parents.append(0 if p < 0 else index[p])
        return DraftTree((self.root_token, *(self._tokens[c] for c in chosen)), tuple(parents))
