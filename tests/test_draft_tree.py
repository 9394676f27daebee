"""Draft trees, verification and acceptance counters on hand-made values (pure, no model).

The sampling tests check the property that matters: whatever the draft proposes, the emitted
tokens follow the target's distribution (a tiny Markov "model" over 3 tokens, many seeds).
"""

from __future__ import annotations

import pytest
import torch

from fusedserve.worker.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from fusedserve.worker.spec_decode.draft_tree import (
    DraftTree,
    TreeBuilder,
    accept_greedy,
    relocation,
    tree_attention_mask,
    tree_depths,
    tree_positions,
)
from fusedserve.worker.spec_decode.rejection_sampler import (
    accept_chains_sampled,
    sample_token,
    verify_chain_sampled,
    verify_tree_sampled,
)
from fusedserve.worker.spec_decode.stats import SpecDecodeCounters

# --- tree structure ---------------------------------------------------------------------------


def test_tree_mask_positions_and_depths_of_the_docstring_example() -> None:
    parents = (-1, 0, 0, 1)  # a; b, c under a; d under b
    assert tree_depths(parents) == (0, 1, 1, 2)
    assert tree_positions(parents, 5) == (5, 6, 6, 7)
    mask = tree_attention_mask(parents, 2)
    assert mask.shape == (4, 6)
    assert mask[:, :2].all()
    assert mask[:, 2:].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    chain = DraftTree.chain(7, [1, 2, 3])
    assert chain.parents == (-1, 0, 1, 2) and chain.is_chain and not DraftTree((1, 2, 3), (-1, 0, 0)).is_chain
    assert torch.equal(tree_attention_mask(chain.parents, 0), torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_rejects_parents_that_are_not_earlier_nodes() -> None:
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2, 3), (-1, 2, 0))
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree((1, 2), (-1,))


def test_builder_keeps_the_best_cumulative_candidates_parents_first() -> None:
    import math

    b = TreeBuilder(root_token=100)
    l1 = b.add_children(-1, [10, 11], [math.log(0.6), math.log(0.3)])  # candidates 0, 1
    # expand both leaves (topk 2): children of 10 score .6*.5, .6*.4; of 11: .3*.9, .3*.05
    kids = b.add_children(l1[0], [20, 21], [math.log(0.5), math.log(0.4)])
    kids += b.add_children(l1[1], [22, 23], [math.log(0.9), math.log(0.05)])
    assert b.best(kids, 2) == [2, 4]  # .30 (20 under 10) and .27 (22 under 11)
    tree = b.build(5)  # root + the 4 best: 10 (.6), 11 (.3), 20 (.30), 22 (.27)
    assert tree.tokens == (100, 10, 11, 20, 22)
    assert tree.parents == (-1, 0, 0, 1, 2)
    # a child never outranks its parent, even with log-prob 0 (ties go to the earlier candidate)
    b2 = TreeBuilder(0)
    [a] = b2.add_children(-1, [1], [0.0])
    b2.add_children(a, [2], [0.0])
    assert b2.build(2).tokens == (0, 1) and b2.build(3).parents == (-1, 0, 1)


def test_greedy_acceptance_walks_matching_children() -> None:
    tree = DraftTree((100, 10, 11, 20, 22), (-1, 0, 0, 1, 2))
    # target after root: 11 (second child), after 11: 22 (accepted), after 22: 7 (bonus)
    acc = accept_greedy(tree, [11, 0, 22, 0, 7])
    assert acc.path == (2, 4) and acc.tokens == (11, 22, 7) and acc.num_accepted == 2
    assert relocation(acc.path) == [(2, 1), (4, 2)]
    none = accept_greedy(tree, [55, 0, 0, 0, 0])
    assert none.path == () and none.tokens == (55,)
    chain = accept_greedy(DraftTree.chain(1, [2, 3, 4]), [2, 3, 4, 9])
    assert chain.tokens == (2, 3, 4, 9) and relocation(chain.path) == []


# --- sampling verification ----------------------------------------------------------------------

# A tiny "language model": the next-token distribution depends on the last token only.
P = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)  # target
Q = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)  # draft


def _uniforms(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64)


def _first_two(verify_step, trials: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Empirical joint distribution of the first two tokens after token 0, one seed per trial."""
    counts = torch.zeros(3, 3, dtype=torch.float64)
    for seed in range(trials):
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while len(out) < 2:
            out += verify_step(out[-1] if out else 0, g)
        counts[out[0], out[1]] += 1
    return counts / trials


def _sampled_drafts(last: int, g: torch.Generator) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    drafts, q_rows, ctx = [], [], last
    for _ in range(2):  # two drafts, each sampled from the draft's q
        tok = sample_token(Q[ctx], _uniforms(g, 1))
        drafts.append(tok)
        q_rows.append(Q[ctx])
        ctx = tok
    return drafts, torch.stack(q_rows), torch.stack([P[t] for t in [last, *drafts]])


def _chain_step(last: int, g: torch.Generator) -> list[int]:
    drafts, q_rows, p_rows = _sampled_drafts(last, g)
    return list(verify_chain_sampled(drafts, q_rows, p_rows, _uniforms(g, 3)).tokens)


def _device_chain_step(last: int, g: torch.Generator) -> list[int]:
    drafts, q_rows, p_rows = _sampled_drafts(last, g)
    count, token = accept_chains_sampled(torch.tensor([drafts]), q_rows[None], p_rows[None], _uniforms(g, 3)[None])
    return [*drafts[:int(count[0])], int(token[0])]


def _tree_step(last: int, g: torch.Generator) -> list[int]:
    # deterministic candidates: the draft's top-2 below the root and below each of them
    tokens, parents = [last], [-1]
    for parent in (0,):
        for c in Q[last].topk(2).indices.tolist():
            tokens.append(c)
            parents.append(parent)
    for node in (1, 2):
        for c in Q[tokens[node]].topk(2).indices.tolist():
            tokens.append(c)
            parents.append(node)
    tree = DraftTree(tuple(tokens), tuple(parents))
    p_rows = torch.stack([P[t] for t in tokens])
    return list(verify_tree_sampled(tree, p_rows, _uniforms(g, tree.num_nodes)).tokens)


@pytest.mark.parametrize("step", [_chain_step, _device_chain_step, _tree_step], ids=["chain", "device-chain", "tree"])
def test_sampled_verification_emits_the_target_distribution(step) -> None:  # type: ignore[no-untyped-def]
    exact = P[0][:, None] * P  # p(a | 0) * p(b | a)
    empirical = _first_two(step, 4000)
    assert float((empirical - exact).abs().max()) < 0.035  # ~4 sigma at 4000 trials


def test_chain_with_draft_equal_to_target_accepts_everything() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 50, generator=g), dim=-1)
    for seed in range(200):
        gs = torch.Generator().manual_seed(seed)
        drafts = [sample_token(probs[i], _uniforms(gs, 1)) for i in range(4)]
        acc = verify_chain_sampled(drafts, probs[:4], probs, _uniforms(gs, 5))
        assert acc.path == (1, 2, 3, 4) and acc.tokens[:4] == tuple(drafts)


def test_rejected_draft_is_never_the_replacement_when_target_dominates_nothing() -> None:
    # q puts its mass on token 0, p never picks token 0: every draft is rejected and replaced from
    # max(0, p - q), which excludes token 0
    q = torch.tensor([[1.0, 0.0, 0.0]])
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]])
    for seed in range(50):
        acc = verify_chain_sampled([0], q, p, _uniforms(torch.Generator().manual_seed(seed), 2))
        assert acc.path == () and acc.tokens[0] in (1, 2)


def test_device_chains_equal_the_host_rule_given_the_same_numbers() -> None:
    """``accept_chains_sampled`` is ``verify_chain_sampled`` for a batch: fed the same uniform numbers, every
    row gives the same accepted drafts and emitted token (peaked and flat rows; drafts the target favours,
    ignores or rules out; a draft equal to the target; a greedy-like one-hot q)."""
    g = torch.Generator().manual_seed(0)
    b, k, vocab = 64, 4, 40
    scale = torch.tensor([0.3, 1.0, 4.0, 12.0]).repeat(b // 4)[:, None, None]
    p = torch.softmax(torch.randn(b, k + 1, vocab, generator=g) * scale, dim=-1)
    q = torch.softmax(torch.randn(b, k, vocab, generator=g) * scale, dim=-1)
    p[::5, :, 7] = 0.0  # some rows rule token 7 out (drafted below: always rejected there)
    q[3] = p[3, :k]  # row 3: the draft is the target
    q[6] = torch.nn.functional.one_hot(q[6].argmax(dim=-1), vocab).float()  # row 6: the draft's argmax
    drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[:, 0] for i in range(b)])
    drafts[::5, 1] = 7
    q[::5, 1, 7] = 0.5
    uniforms = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    count, token = accept_chains_sampled(drafts, q, p, uniforms)
    seen = set()
    for i in range(b):
        acc = verify_chain_sampled(drafts[i].tolist(), q[i], p[i], uniforms[i])
        assert (int(count[i]), int(token[i])) == (acc.num_accepted, acc.tokens[-1]), i
        seen.add(acc.num_accepted)
    assert int(count[3]) == k and seen >= {0, 1, k} and all(int(count[i]) <= 1 for i in range(0, b, 5))
    with pytest.raises(ValueError, match="uniform numbers"):
        accept_chains_sampled(drafts, q, p, uniforms[:, :k])


# --- accounting and configuration ---------------------------------------------------------------


def test_counters_follow_vllm_convention() -> None:
    c = SpecDecodeCounters(max_depth=3)
    for accepted in (0, 3, 1, 2, 3):
        c.record(3, accepted)
    s = c.snapshot()
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (5, 15, 9)
    assert s.accepted_per_position == (4, 3, 2)
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert s.accepted_per_step == (1, 1, 1, 2)
    assert s.acceptance_length == pytest.approx(1 + 9 / 5)
    assert s.acceptance_rate == pytest.approx(9 / 15)
    with pytest.raises(ValueError):
        c.record(3, 4)


def test_speculative_config_rules() -> None:
    chain = SpeculativeConfig("d", num_steps=3)
    assert chain.num_draft_tokens == 4 and chain.is_chain
    assert chain.lookahead_tokens == 3 + 4  # the verify's 3 drafts, then the next round's verify run ahead
    assert SpeculativeConfig("d", num_steps=3, num_draft_tokens=9).num_draft_tokens == 4  # sglang adjusts
    with pytest.raises(SpeculativeConfigError, match="at least num_steps \\+ 1 = 4"):
        SpeculativeConfig("d", num_steps=3, num_draft_tokens=3)
    with pytest.raises(SpeculativeConfigError, match="needs num_draft_tokens"):
        SpeculativeConfig("d", num_steps=3, topk=4)
    with pytest.raises(SpeculativeConfigError, match=r"in \[2, 21\]"):
        SpeculativeConfig("d", num_steps=2, topk=4, num_draft_tokens=22)
    with pytest.raises(SpeculativeConfigError, match="num_steps must be a positive integer"):
        SpeculativeConfig("d", num_steps=0)
    with pytest.raises(SpeculativeConfigError, match="draft model"):
        SpeculativeConfig("", num_steps=2)
    tree = SpeculativeConfig("d", num_steps=4, topk=4, num_draft_tokens=8)
    # the next tree, drafted behind the verify: its root up to 5 further, its draft steps 1..3 then hold 4 nodes each
    assert tree.verify_tokens == 8 and tree.lookahead_tokens == 4 + 3 * 4
    assert tree.in_flight_reach == 2 * 5 + 12 and chain.in_flight_reach == 3 * chain.verify_tokens
