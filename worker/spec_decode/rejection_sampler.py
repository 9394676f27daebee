"""Sampling verification of speculative drafts: the emitted tokens follow the target's distribution.

Chain (drafts sampled from the draft's distribution q): the standard rule (Leviathan et al.,
Chen et al.). Draft x at position i is accepted with probability min(1, p_i(x) / q_i(x)); at the
first rejection the position's token is drawn from normalize(max(0, p_i - q_i)) and the step
ends; when every draft is accepted the bonus token is drawn from p_{k+1}.

Tree (deterministic candidates: the draft's top-k, i.e. q is a point mass on each candidate):
sglang's "target only" rule. At a node with children c_1..c_m, c_j is accepted with probability
p(c_j) / (mass of p left after removing c_1..c_{j-1}); an accepted child becomes the node; when
every child is rejected the token is drawn from p with the children removed. Each emitted token
is then exactly distributed as p (c_1 with probability p(c_1), c_2 with (1 - p(c_1)) *
p(c_2) / (1 - p(c_1)), ...), and the walk continues with the target's distribution at the
accepted child.

``p`` and ``q`` are the distributions after temperature, top-k and top-p (``Sampler.probs``).
Uniform numbers come from ``draw``: the request's own random stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engine.sampler import sample_from_probs
from ..executor.host_copy import to_device
from .draft_tree import Acceptance, DraftTree

Draw = Callable[[], float]  # one uniform number in [0, 1) from the request's stream


def sample_token(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from one (unnormalised, non-negative) row. probs: [vocab]"""
    return int(sample_from_probs(probs[None], to_device([u], probs.device, torch.float64))[0])


def verify_chain_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         draw: Draw) -> Acceptance:
    """drafts: k tokens, each drawn from its row of draft_probs [k, vocab]; target_probs: [k+1, vocab]
    (row i = the target after the root and drafts[:i])."""
    k = len(drafts)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k} draft rows and {k + 1} target rows, got "
                         f"{draft_probs.shape[0]} and {target_probs.shape[0]}")
    p_all, q_all = target_probs.double(), draft_probs.double()
    for i, x in enumerate(drafts):
        p, q = p_all[i], q_all[i]
        if not draw() * float(q[x]) < float(p[x]):  # rejected (also when q(x) = 0)
            residual = torch.clamp(p - q, min=0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere: only rounding gets here
                residual = p
            token = sample_token(residual, draw())
            return Acceptance(tuple(range(1, i + 1)), (*drafts[:i], token))
    return Acceptance(tuple(range(1, k + 1)), (*drafts, sample_token(p_all[k], draw())))


def verify_tree_sampled(tree: DraftTree, target_probs: torch.Tensor, draw: Draw) -> Acceptance:
    """target_probs: [num_nodes, vocab], row i = the target's distribution after node i."""
    if target_probs.shape[0] != tree.num_nodes:
        raise ValueError(f"{target_probs.shape[0]} target rows for a tree of {tree.num_nodes} nodes")
    path: list[int] = []
    node = 0
    while True:
        p = target_probs[node].double().clone()
        accepted = None
        for child in tree.children(node):
            token = tree.tokens[child]
            if draw() * float(p.sum()) < float(p[token]):
                accepted = child
                break
            p[token] = 0.0
        if accepted is None:
            if float(p.sum()) <= 0.0:  # the children held all the mass: only rounding gets here
                p = target_probs[node].double()
            bonus = sample_token(p, draw())
            return Acceptance(tuple(path), (*(tree.tokens[i] for i in path), bonus))
        path.append(accepted)
        node = accepted
