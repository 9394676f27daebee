"""Draft trees grown on the device (``worker/spec_decode/device_tree.py``) equal the host's ``TreeBuilder``:
the same candidates from the same top-k, the same leaves fed at every step with the same masks, the same
verified tree — and through the engine the same tokens and acceptance as the host-grown path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.executor.step import ancestor_mask
from fusedserve.worker.spec_decode.config import SpeculativeConfig
from fusedserve.worker.spec_decode.decoder import SpecDecoder
from fusedserve.worker.spec_decode.device_tree import TreeGrowth
from fusedserve.worker.spec_decode.draft_tree import TreeBuilder, tree_depths
from fusedserve.worker.spec_decode.drafter import Drafter

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
PROMPTS = ["def fib(n):\n    ", "import os\nclass Foo:\n", "for i in range(10):"]


def host_tree(root: int, steps: list[tuple[torch.Tensor, torch.Tensor]], k: int, nodes: int
              ) -> tuple[tuple[int, ...], tuple[int, ...], list[list[tuple[int, ...]]]]:
    """The host's rule (``Drafter.propose``) on given top-k per step: (tokens, parents, each step's feed
    rows as (token, ancestor-slot set))."""
    b = TreeBuilder(root)
    tokens, lps = steps[0]
    leaves = b.add_children(-1, tokens[0].tolist(), lps[0].double().tolist())
    slot_of: dict[int, int] = {}
    feeds = []
    for j, (tokens, lps) in enumerate(steps[1:], start=1):
        for r, c in enumerate(leaves):
            slot_of[c] = (j - 1) * k + r
        rows = []
        for c in leaves:
            seen, a = [], c
            while a >= 0:
                seen.append(slot_of[a])
                a = b.parent(a)
            rows.append((b.token(c), tuple(sorted(seen))))
        feeds.append(rows)
        new = []
        for r, c in enumerate(leaves):
            new += b.add_children(c, tokens[r].tolist(), lps[r].double().tolist())
        leaves = b.best(new, k)
    t = b.build(nodes)
    return t.tokens, t.parents, feeds


@pytest.mark.parametrize("k,steps,nodes,ties", [(2, 3, 5, False), (4, 4, 12, False), (3, 4, 10, True),
                                                (8, 7, 64, False)])
def test_tree_growth_equals_the_host_builder(k: int, steps: int, nodes: int, ties: bool) -> None:
    g = torch.Generator().manual_seed(k * 10 + steps)
    vocab = 50

    def top(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(rows, vocab, generator=g)
        if ties:  # equal log-probabilities among siblings and across leaves
            logits = logits.round()
        lp, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return ids + 1000, lp

    first = top(1)
    growth = TreeGrowth(torch.tensor([7]), first[0], first[1], torch.zeros(1, 4), steps)
    per_step = [first]
    feeds = []
    for _ in range(1, steps):
        tokens, hidden, mask = growth.feed()
        feeds.append((tokens, mask))
        step = top(k)
        per_step.append(step)
        growth.expand(step[0], step[1], torch.zeros(k, 4))
    tree = growth.build(nodes)
    want_tokens, want_parents, want_feeds = host_tree(7, per_step, k, nodes)
    assert tuple(tree.tokens[0].tolist()) == want_tokens
    assert tuple(tree.parents[0].tolist()) == want_parents
    assert tuple(tree.depths[0].tolist()) == tree_depths(want_parents)
    n = len(want_parents)
    assert tuple(tree.mask[0].reshape(-1).tolist()) == ancestor_mask(want_parents)
    for (tokens, mask), rows in zip(feeds, want_feeds):
        assert [(int(t), tuple(torch.nonzero(m).view(-1).tolist())) for t, m in zip(tokens, mask)] == rows
    assert n == nodes


def test_tree_growth_batches_sequences_independently() -> None:
    g = torch.Generator().manual_seed(3)
    k, steps, nodes = 3, 3, 7
    tops = [torch.log_softmax(torch.randn(2 * (1 if j == 0 else k), 30, generator=g), -1).topk(k) for j in range(steps)]
    both = TreeGrowth(torch.tensor([1, 2]), tops[0].indices, tops[0].values, torch.zeros(2, 4), steps)
    alone = [TreeGrowth(torch.tensor([i + 1]), tops[0].indices[i:i + 1], tops[0].values[i:i + 1], torch.zeros(1, 4),
                        steps) for i in range(2)]
    for j in range(1, steps):
        both.feed()
        both.expand(tops[j].indices, tops[j].values, torch.zeros(2 * k, 4))
        for i, one in enumerate(alone):
            one.feed()
            one.expand(tops[j].indices[i * k:(i + 1) * k], tops[j].values[i * k:(i + 1) * k], torch.zeros(k, 4))
    tb = both.build(nodes)
    for i, one in enumerate(alone):
        t = one.build(nodes)
        assert torch.equal(tb.tokens[i], t.tokens[0]) and torch.equal(tb.parents[i], t.parents[0])
        assert torch.equal(tb.mask[i], t.mask[0])


def test_engine_trees_grown_on_the_device_equal_host_grown_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static-shape steps (CUDA graphs on a GPU, their padded forwards here): the same tokens and the same
    acceptance at every position whether the trees grow on the device or on the host — greedy, sampled (the
    tree's rejection rule, seeded) and with a penalty adjusting the target's logits; the device path ran
    (one read-back per step) and the host path did not, for every decoding step at batch 1."""
    spec = SpeculativeConfig(DRAFT, num_steps=4, topk=3, num_draft_tokens=8)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),  # tree rejection rule
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)]  # adjusted argmax
    calls = {"device": 0, "host": 0}
    on_device, propose = Drafter.tree_on_device, Drafter.propose

    def device(self, work):  # type: ignore[no-untyped-def]
        calls["device"] += 1
        return on_device(self, work)

    def host(self, work):  # type: ignore[no-untyped-def]
        calls["host"] += bool(work)  # a prefill step proposes for nobody
        return propose(self, work)

    monkeypatch.setattr(Drafter, "tree_on_device", device)
    monkeypatch.setattr(Drafter, "propose", host)
    runs = {}
    for name in ("device", "host"):
        if name == "host":
            monkeypatch.setattr(SpecDecoder, "_deferred_tree", lambda self, batch, work: None)
        calls.update(device=0, host=0)
        engine = Engine(TARGET, EngineConfig(num_blocks=24, block_size=4, max_num_seqs=1, speculative=spec,
                                             cuda_graphs=True, cuda_graph_batch_sizes=(1,)))
        outs = [c.token_ids for c in engine.generate(PROMPTS, params)]
        runs[name] = (outs, engine.stats().spec, dict(calls))
    assert runs["device"][0] == runs["host"][0]
    assert runs["device"][1] == runs["host"][1]
    stats = runs["device"][1]
    assert stats is not None and stats.accepted_tokens > 0
    assert runs["device"][2]["device"] > 0 and runs["device"][2]["host"] == 0, runs["device"][2]
    assert runs["host"][2]["host"] > 0


def test_device_positions_and_masks_need_a_captured_shape() -> None:
    from fusedserve.worker.executor.step import SeqRows, Step

    engine = Engine(TARGET, EngineConfig(num_blocks=8))  # no static shapes: eager forwards
    step = Step((SeqRows((0,), (5, 6), (0, 1), 2, 2, (True, False, True, True)),))
    with pytest.raises(ValueError, match="captured step shape"):
        engine.executor.run(step, positions=torch.tensor([0, 1]))


def test_padded_batch_of_device_trees_equals_host_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences decoding together at a captured batch of 4 (one padding sequence in the tree chain
    and the verify): the same greedy tokens and acceptance as trees grown on the host."""
    spec = SpeculativeConfig(DRAFT, num_steps=3, topk=2, num_draft_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    calls = {"device": 0}
    on_device = Drafter.tree_on_device

    def device(self, work):  # type: ignore[no-untyped-def]
        calls["device"] += len(work) == 3
        return on_device(self, work)

    monkeypatch.setattr(Drafter, "tree_on_device", device)
    runs = []
    for host in (False, True):
        if host:
            monkeypatch.setattr(SpecDecoder, "_deferred_tree", lambda self, batch, work: None)
        engine = Engine(TARGET, EngineConfig(num_blocks=48, block_size=4, max_num_seqs=3, speculative=spec,
                                             cuda_graphs=True, cuda_graph_batch_sizes=(4,)))
        runs.append(([c.token_ids for c in engine.generate(PROMPTS, [params] * 3)], engine.stats().spec))
    assert runs[0] == runs[1]
    assert calls["device"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_tree_expand_equals_torch_ops_on_gpu() -> None:
    """On a GPU the drafter grows trees with the fused start and steps (``tree_expand_triton``: each step's expand
    writes the next feed) and builds them in one launch (``tree_build_triton``): the same feeds, candidates, leaves,
    hidden inputs and built trees as the torch ops, ties included, at 7 steps x topK 8."""
    from fusedserve.worker.spec_decode.drafter import tree_kernels

    dev = torch.device("cuda")
    kernels = tree_kernels(dev)
    assert kernels is not None and kernels.build is not None
    g = torch.Generator(device=dev).manual_seed(0)
    b, k, steps, hidden = 5, 8, 7, 576
    first_lp = -torch.randint(0, 3, (b, k), generator=g, device=dev).float()
    args = (torch.arange(b, device=dev), torch.randint(0, 49152, (b, k), generator=g, device=dev), first_lp,
            torch.randn(b, hidden, generator=g, device=dev, dtype=torch.bfloat16), steps)
    grown = [TreeGrowth(*args), TreeGrowth(*args, kernels)]
    for j in range(1, steps):
        tops = torch.randint(0, 49152, (b * k, k), generator=g, device=dev)
        lps = -torch.randint(0, 5, (b * k, k), generator=g, device=dev).float() * 0.25
        out = torch.randn(b * k, hidden, generator=g, device=dev, dtype=torch.bfloat16)
        for x, y in zip(*(t.feed() for t in grown)):
            assert torch.equal(x, y)
        for t in grown:
            t.expand(tops, lps, out)
        assert torch.equal(grown[0].leaves, grown[1].leaves) and torch.equal(grown[0].leaf_hidden, grown[1].leaf_hidden)
        written = k + j * k * k  # the fused start leaves the later steps' columns for their expands
        for name in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(grown[0], name)[:, :written], getattr(grown[1], name)[:, :written]), name
    for nodes in (16, 64):
        trees = [t.build(nodes) for t in grown]
        for name in ("tokens", "parents", "depths", "mask"):
            assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), (nodes, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_top_k_kernel_equals_torch_on_gpu() -> None:
    """On a GPU the drafter's top-k is one kernel (``topk_logprobs_triton``): torch's log-softmax top-k,
    bf16 logits over the 32000-entry draft vocabulary, the indices through the draft's table (d2t) in the same
    launch."""
    from fusedserve.worker.spec_decode.drafter import top_k_kernel, top_k_torch
    from fusedserve.worker.spec_decode.topk_logprobs_triton import topk_logprobs_triton

    dev = torch.device("cuda")
    assert top_k_kernel(dev, 32000) is topk_logprobs_triton
    g = torch.Generator(device=dev).manual_seed(1)
    logits = (torch.randn(64, 32000, generator=g, device=dev) * 3).to(torch.bfloat16)
    values, indices = topk_logprobs_triton(logits, 8)
    table = torch.randperm(49152, generator=g, device=dev)[:32000]
    want_values, want_indices = top_k_torch(logits, 8, torch.arange(32000, device=dev))
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)
    mapped_values, mapped = topk_logprobs_triton(logits, 8, table)
    assert torch.equal(mapped_values, values) and torch.equal(mapped, table[indices])
    # bf16 logits tie often: the same set per row, and where torch's order differs only among equal values
    assert torch.equal(indices.sort(dim=1).values, want_indices.sort(dim=1).values) or torch.equal(
        logits.gather(1, indices), logits.gather(1, want_indices))


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "sibling-ties"])
def test_greedy_acceptance_on_the_device_equals_the_hosts(ties: bool) -> None:
    """``accept_greedy_on_device`` over a batch of random trees and target choices (a vocabulary of 3 makes
    siblings share tokens and long paths common) equals ``accept_greedy`` tree by tree: path, count, bonus and
    the tokens gained."""
    from fusedserve.worker.spec_decode.device_tree import accept_greedy_on_device
    from fusedserve.worker.spec_decode.draft_tree import DraftTree, accept_greedy

    g = torch.Generator().manual_seed(5 + ties)
    b, n, vocab = 64, 16, 3 if ties else 50
    parents = torch.full((b, n), -1, dtype=torch.long)
    for j in range(1, n):
        parents[:, j] = torch.randint(0, j, (b,), generator=g)
    tokens = torch.randint(0, vocab, (b, n), generator=g)
    argmax = torch.randint(0, vocab, (b, n), generator=g)
    # steer half the trees' choices toward their nodes' tokens (two in three) so some accept deep paths
    for i in range(0, b, 2):
        for j in range(1, n):
            if j % 3:
                argmax[i, parents[i, j]] = tokens[i, j]
    depth = max(max(tree_depths(tuple(parents[i].tolist()))) for i in range(b))
    got = accept_greedy_on_device(tokens, parents, argmax, depth)
    deepest = 0
    for i in range(b):
        want = accept_greedy(DraftTree(tuple(tokens[i].tolist()), tuple(parents[i].tolist())), argmax[i].tolist())
        c = int(got.count[i])
        deepest = max(deepest, c)
        assert c == want.num_accepted
        assert tuple(got.path[i, :c].tolist()) == want.path and (got.path[i, c:] == -1).all()
        assert tuple(got.tokens[i, :c + 1].tolist()) == want.tokens and int(got.bonus[i]) == want.tokens[-1]
    assert deepest >= 3  # the steered trees reach deep paths


def test_accepted_kv_moves_on_the_device_as_the_hosts_relocation() -> None:
    """``accepted_moves`` applied by ``apply_moves`` (a tree verify's program's moves) leave a cache as the host's
    ``relocation`` moves through ``copy_kv``'s read-then-write do, for trees whose accepted nodes sit past their depth (sequence 0: nodes 2, 5, 9 at depths 1-3), on the chain
    already (1: nodes 1, 2: nothing moves) and none accepted (2); ``accepted_node_rows`` lists the root, then them."""
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.worker.spec_decode.device_tree import accepted_moves, accepted_node_rows
    from fusedserve.worker.spec_decode.draft_tree import relocation
    from fusedserve.worker.spec_decode.tree_verify_program import apply_moves

    g = torch.Generator().manual_seed(3)
    block, n, depth = 4, 10, 3
    kv = KVCache.allocate({0: (2, 8), 1: (2, 8)}, 16, block, torch.float32)
    for t in kv.stored():
        t.copy_(torch.randn(t.shape, generator=g))
    paths = [(2, 5, 9), (1, 2), ()]
    starts = [5, 17, 40]
    slots = torch.tensor([[s + i for i in range(n)] for s in starts])  # contiguous pages: slot = index here
    ref = [t.clone() for t in kv.stored()]
    src, dst = [], []
    for s, p in zip(starts, paths):
        for a, b in relocation(p):
            src.append(s + a)
            dst.append(s + b)
    for t in ref:
        t[dst] = t[src].clone()
    path = torch.tensor([[*p, *[-1] * (depth - len(p))] for p in paths])
    apply_moves(kv, accepted_moves(slots, path))
    for got, want in zip(kv.stored(), ref):
        assert torch.equal(got, want)
    assert accepted_node_rows(path).tolist() == [[0, 2, 5, 9], [0, 1, 2, 0], [0, 0, 0, 0]]


def test_parents_read_off_the_masks_accept_as_the_host() -> None:
    """A grown batch's masks give back its parents (``parents_from_mask``, what a tree verify's program reads), and
    the greedy walk over the trees' tokens, those parents and random target choices is each tree's
    ``accept_greedy`` outcome."""
    from fusedserve.worker.spec_decode.device_tree import accept_greedy_on_device, parents_from_mask
    from fusedserve.worker.spec_decode.draft_tree import DraftTree, accept_greedy

    g = torch.Generator().manual_seed(11)
    b, k, steps, nodes, vocab = 8, 3, 4, 10, 4
    growth = TreeGrowth(torch.randint(0, vocab, (b,), generator=g), torch.randint(0, vocab, (b, k), generator=g),
                        -torch.rand(b, k, generator=g), torch.randn(b, 2, generator=g), steps)
    for _ in range(1, steps):
        growth.feed()
        growth.expand(torch.randint(0, vocab, (b * k, k), generator=g), -torch.rand(b * k, k, generator=g),
                      torch.randn(b * k, 2, generator=g))
    tree = growth.build(nodes)
    assert torch.equal(parents_from_mask(tree.mask), tree.parents)
    argmax = torch.randint(0, vocab, (b, nodes), generator=g)
    acc = accept_greedy_on_device(tree.tokens, parents_from_mask(tree.mask), argmax, steps)
    for i in range(b):
        want = accept_greedy(DraftTree(tuple(tree.tokens[i].tolist()), tuple(tree.parents[i].tolist())),
                             argmax[i].tolist())
        c = int(acc.count[i])
        assert c == want.num_accepted
        assert tuple(acc.tokens[i, :c + 1].tolist()) == want.tokens
        assert tuple(acc.path[i, :c].tolist()) == want.path
