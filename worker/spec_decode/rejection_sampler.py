"""Sampling verification of speculative drafts: the emitted tokens follow the target's distribution.

Chain (drafts sampled from the draft's distribution q): the standard rule (Leviathan et al.,
Chen et al.). Draft x at position i is accepted with probability min(1, p_i(x) / q_i(x)); at the
first rejection the position's token is drawn from normalize(max(0, p_i - q_i)) and the step
ends; when every draft is accepted the bonus token is drawn from p_{k+1}. A greedy request's q is
one-hot on the draft's argmax, and it verifies exactly (``accept_greedy``) instead.

Tree (deterministic candidates: the draft's top-k, i.e. q is a point mass on each candidate):
sglang's "target only" rule. At a node with children c_1..c_m, c_j is accepted with probability
p(c_j) / (mass of p left after removing c_1..c_{j-1}); an accepted child becomes the node; when
every child is rejected the token is drawn from p with the children removed. Each emitted token
is then exactly distributed as p (c_1 with probability p(c_1), c_2 with (1 - p(c_1)) *
p(c_2) / (1 - p(c_1)), ...), and the walk continues with the target's distribution at the
accepted child.

``p`` and ``q`` are the distributions after temperature, min-p, top-k and top-p (``Sampler.probs``).
Uniform numbers come from the request's own random stream, drawn on the device ahead of use
(``Uniforms``) and consumed in the rule's order: one per test, then one for the emitted token. The
host walks (``verify_chain_sampled``, ``verify_tree_sampled``: the reference, and what a tree or a
rank group takes) read back what they test once; ``accept_chains_sampled`` is the chain rule for a
batch on the device with nothing read back (the caller's one wait takes its result with the step's
other values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from ..engine.sampler import sample_from_probs
from ..executor.gpu_kernel import gpu_kernel
from ..executor.host_copy import to_device
from .draft_tree import Acceptance, DraftTree

Uniforms = Callable[[int], torch.Tensor]  # n uniform numbers in [0, 1) from the request's stream: [n] float64
# (logits, first_rows [S], temperatures [S], drafts [S, k], q [S, k, vocab], uniforms [S, k + 1])
#   -> (accepted drafts [S], emitted tokens [S], each chain's tokens after its root [S, k + 1] (``chain_rows``)):
#   ``accept_chains_at_temperature`` or its one-launch GPU kernel
ChainAcceptFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# (drafts [B, k], targets [B, k + 1], pick [S], count [S], token [S]) -> (counts [B], tokens [B, k + 1]):
#   ``chain_outcomes`` or its one-launch GPU kernel
ChainOutcomesFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                            torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def sample_token(probs: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse-CDF draw from one (unnormalised, non-negative) row. probs: [vocab]; u: [1] (a wait)"""
    return int(sample_from_probs(probs[None], u.to(probs.device))[0])


def verify_chain_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         uniforms: torch.Tensor) -> Acceptance:
    """drafts: k tokens, each drawn from its row of draft_probs [k, vocab]; target_probs: [k+1, vocab]
    (row i = the target after the root and drafts[:i]); uniforms: [k + 1]."""
    k = len(drafts)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1 or uniforms.shape != (k + 1,):
        raise ValueError(f"{k} drafts need {k} draft rows, {k + 1} target rows and {k + 1} uniform numbers, got "
                         f"{draft_probs.shape[0]}, {target_probs.shape[0]} and {tuple(uniforms.shape)}")
    p_all, q_all = target_probs.double(), draft_probs.double()
    ids = to_device(drafts, p_all.device)
    rows = torch.arange(k, device=p_all.device)
    values = torch.cat([p_all[rows, ids], q_all[rows, ids], uniforms.to(p_all.device).double()]).tolist()  # one wait
    p_hit, q_hit, u = values[:k], values[k:2 * k], values[2 * k:]
    for i in range(k):
        if not u[i] * q_hit[i] < p_hit[i]:  # rejected (also when q(x) = 0)
            residual = torch.clamp(p_all[i] - q_all[i], min=0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere: only rounding gets here
                residual = p_all[i]
            return Acceptance(tuple(range(1, i + 1)), (*drafts[:i], sample_token(residual, uniforms[i + 1:i + 2])))
    return Acceptance(tuple(range(1, k + 1)), (*drafts, sample_token(p_all[k], uniforms[k:])))


def verify_tree_sampled(tree: DraftTree, target_probs: torch.Tensor, uniforms: torch.Tensor) -> Acceptance:
    """target_probs: [num_nodes, vocab], row i = the target's distribution after node i; uniforms:
    [num_nodes] (a walk tests at most num_nodes - 1 children). Two waits: the rows' masses, the
    children's probabilities and the numbers; then the emitted token."""
    n = tree.num_nodes
    if target_probs.shape[0] != n or uniforms.shape != (n,):
        raise ValueError(f"{target_probs.shape[0]} target rows and {tuple(uniforms.shape)} uniform numbers for a "
                         f"tree of {n} nodes")
    p = target_probs.double()
    parents = to_device([max(a, 0) for a in tree.parents], p.device)
    values = torch.cat([p.sum(dim=-1), p[parents, to_device(list(tree.tokens), p.device)],
                        uniforms.to(p.device).double()]).tolist()
    mass_of, child_p, u = values[:n], values[n:2 * n], values[2 * n:]  # child_p[c]: p(token c) after c's parent
    path: list[int] = []
    used = 0
    node = 0
    while True:
        mass = mass_of[node]
        removed: list[int] = []
        accepted = None
        for child in tree.children(node):
            used += 1
            if u[used - 1] * mass < child_p[child]:
                accepted = child
                break
            mass -= child_p[child]
            removed.append(tree.tokens[child])
        if accepted is None:
            row = p[node]
            if removed and mass > 0.0:  # else the children held all the mass: only rounding gets here
                row = row.index_fill(0, to_device(removed, p.device), 0.0)
            bonus = sample_token(row, uniforms[used:used + 1])
            return Acceptance(tuple(path), (*(tree.tokens[i] for i in path), bonus))
        path.append(accepted)
        node = accepted


def accept_chains_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                          uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_chain_sampled`` for B chains of k drafts each, on the device without a wait.
    drafts: [B, k] token ids; draft_probs: [B, k, vocab] (each draft's q); target_probs: [B, k + 1, vocab];
    uniforms: [B, k + 1]. -> (accepted drafts [B] in 0..k, the emitted token after them [B]: drawn from the
    residual at the first rejection, else the bonus)"""
    b, k = drafts.shape
    if draft_probs.shape[:2] != (b, k) or target_probs.shape[:2] != (b, k + 1) or uniforms.shape != (b, k + 1):
        raise ValueError(f"{tuple(drafts.shape)} drafts need [{b}, {k}, vocab] draft rows, [{b}, {k + 1}, vocab] "
                         f"target rows and [{b}, {k + 1}] uniform numbers, got {tuple(draft_probs.shape)}, "
                         f"{tuple(target_probs.shape)} and {tuple(uniforms.shape)}")
    p, q = target_probs.double(), draft_probs.double()
    p_hit = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    q_hit = q.gather(-1, drafts[..., None])[..., 0]
    accepted = uniforms[:, :k].double() * q_hit < p_hit
    count = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]: drafts before the first rejection
    rows = torch.arange(b, device=drafts.device)
    at = count.clamp(max=k - 1)
    residual = torch.clamp(p[rows, at] - q[rows, at], min=0.0)
    residual = torch.where((residual.sum(dim=-1) > 0.0)[:, None], residual, p[rows, at])  # rounding only
    final = torch.where((count < k)[:, None], residual, p[:, k])
    u = uniforms.gather(-1, (count + 1).clamp(max=k)[:, None])[:, 0]  # the number after the last test
    return count, sample_from_probs(final, u)


def accept_chains_at_temperature(logits: torch.Tensor, first_rows: torch.Tensor, temperatures: torch.Tensor,
                                 drafts: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_chains_sampled`` for chains of requests that set nothing but a temperature, from the verify's raw
    logits: chain b's k + 1 rows start at ``first_rows[b]`` of logits [rows, vocab], its target distribution is
    their softmax at ``temperatures[b]`` (``Sampler.probs``). The plain reference of ``accept_chains_triton``.
    -> (accepted drafts [S], emitted tokens [S], each chain's tokens after its root [S, k + 1]: ``chain_rows``)"""
    k = int(drafts.shape[1])
    rows = first_rows[:, None] + torch.arange(k + 1, device=first_rows.device)
    scaled = logits.index_select(0, rows.reshape(-1)).float().view(len(first_rows), k + 1, -1) / temperatures[:, None, None]
    count, token = accept_chains_sampled(drafts, q, torch.softmax(scaled, dim=-1), uniforms)
    return count, token, chain_rows(drafts, count, token)


def chain_rows(drafts: torch.Tensor, count: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Sampled chains' tokens after their roots: drafts [S, k] with the emitted token [S] at each chain's count
    [S] and last (its accepted drafts, then the token emitted after them; the drafts past it left as they are)
    -> [S, k + 1]"""
    rows = torch.cat([drafts, token[:, None]], dim=1)
    return rows.scatter_(1, count[:, None], token[:, None])


def chain_acceptor(device: torch.device) -> ChainAcceptFn:
    """``accept_chains_triton`` where the hardware runs it (CUDA with Triton), else ``accept_chains_at_temperature``;
    chosen once."""
    fast = gpu_kernel(device, f"{__package__}.chain_accept_triton", "accept_chains_triton")
    return cast(ChainAcceptFn, fast or accept_chains_at_temperature)


def chain_outcomes(drafts: torch.Tensor, targets: torch.Tensor, pick: torch.Tensor | None,
                   count: torch.Tensor | None, token: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chain's outcome on the device: drafts [B, k]; the target's argmax of each sequence's k + 1 rows
    ``targets`` [B, k + 1]; the rows ``pick`` [S] accepted by the rejection rule as ``count`` [S] / ``token`` [S]
    (``accept_chains_sampled``) drew, the others by the greedy rule (drafts up to the first that differs from the
    argmax before it, then that argmax). The plain reference of ``chain_outcomes_triton``.
    -> (counts [B], the tokens after each root [B, k + 1]: its accepted drafts, then the token emitted after them)"""
    k = drafts.shape[1]
    counts = (drafts == targets[:, :k]).long().cumprod(dim=1).sum(dim=1)
    tokens = targets  # a greedy row's accepted drafts equal the argmax before them; then the argmax
    if pick is not None:
        assert count is not None and token is not None
        counts = counts.index_copy(0, pick, count)
        tokens = targets.index_copy(0, pick, chain_rows(drafts.index_select(0, pick), count, token))
    return counts, tokens


def chain_outcomes_fn(device: torch.device) -> ChainOutcomesFn:
    """``chain_outcomes_triton`` where the hardware runs it (CUDA with Triton), else ``chain_outcomes``; chosen
    once."""
    return cast(ChainOutcomesFn, gpu_kernel(device, f"{__package__}.chain_accept_triton", "chain_outcomes_triton")
                or chain_outcomes)
