"""The engine's padded static-shape step forwards (``worker/executor/step_graphs.py``; CUDA graphs on a
GPU) give the eager engine's greedy outputs: decode, chain and tree verify, draft first pass and
steps. On CPU they run eagerly on the same static buffers (``cuda_graphs=True``), which checks
the packing, the padding rows and the tree masks as device tensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
from fusedserve.models.layers.attention import paged_attention_reference
from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.executor.step import ancestor_mask
from fusedserve.worker.executor.step_shape import StepShape
from fusedserve.worker.spec_decode.config import SpeculativeConfig
from fusedserve.worker.spec_decode.draft_tree import tree_attention_mask

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
PROMPTS = ["def fib(n):\n    ", "import os\nclass Foo:\n", "for i in range(10):"]


def test_tail_mask_attention_equals_reference_tree_mask() -> None:
    g = torch.Generator().manual_seed(0)
    parents = (-1, 0, 0, 1, 2)
    cached, n = 6, len(parents)
    kv = KVCache.allocate({0: (2, 8)}, 4, 4, torch.float32)
    kv.k[0].normal_(generator=g)
    kv.v[0].normal_(generator=g)
    table = [2, 0, 3]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(cached, cached + n)])
    q = torch.randn(n, 4, 8, generator=g)
    k, v = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    ids, pos = torch.zeros(n, dtype=torch.long), torch.tensor([cached + 0, cached + 1, cached + 1, cached + 2, cached + 2])
    ref = paged_attention_reference(q, k, v, 0, ForwardBatch(ids, pos, [n], [cached + n], slots, [table], kv,
                                                               attn_masks=[tree_attention_mask(parents, cached)]), 0.3)
    meta = PagedAttentionMetadata.from_lists([n], [cached + n], [table], max_blocks=4)
    meta.tail_mask = torch.tensor(ancestor_mask(parents)).view(n, n)
    assert torch.equal(meta.tail_mask, tree_attention_mask(parents, cached)[:, cached:])
    got = paged_attention_torch(q, k, v, 0, ForwardBatch(ids, pos, [n], [cached + n], slots, [table], kv, paged=meta),
                                0.3)
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(DRAFT, num_steps=3),
                                  SpeculativeConfig(DRAFT, num_steps=3, topk=3, num_draft_tokens=6)],
                         ids=["none", "chain", "tree"])
def test_static_shape_steps_equal_eager(spec: SpeculativeConfig | None) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        engine = Engine(TARGET, EngineConfig(num_blocks=12, max_num_seqs=2, speculative=spec, cuda_graphs=graphs,
                                             cuda_graph_batch_sizes=(1, 2)))
        outputs[graphs] = [c.token_ids for c in engine.generate(PROMPTS, params)]
        if graphs:
            assert engine.executor.graphs is not None and engine.executor.graphs.runs > 0
            assert engine.executor.num_blocks == engine.executor.kv_cache.num_blocks - 1 == 12
            if engine.speculator is not None:
                assert engine.speculator.draft.graphs is not None and engine.speculator.draft.graphs.runs > 0
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(DRAFT, num_steps=3)], ids=["none", "chain"])
def test_prefill_graphs_equal_eager_prefills(monkeypatch: pytest.MonkeyPatch, spec: SpeculativeConfig | None) -> None:
    """``prefill_graph_tokens``: a prompt alone prefills at the captured length it fits, padded in front (the
    target's, and with a draft its pass over the prompt), a longer one eagerly; the tokens equal those of an
    engine whose prefills all run eagerly."""
    from fusedserve.worker.executor.step_graphs import StepGraphs

    ran: list[StepShape] = []
    run = StepGraphs.run

    def logged(self: StepGraphs, shape: StepShape, *args: object, **kwargs: object) -> list[torch.Tensor]:
        ran.append(shape)
        return run(self, shape, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StepGraphs, "run", logged)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PROMPTS + ["x = [1, 2, 3]\n" * 6]  # the last one longer than the largest captured length
    outputs = {}
    for lengths in ((), (8, 32, 16)):
        engine = Engine(TARGET, EngineConfig(num_blocks=24, max_num_seqs=1, speculative=spec, cuda_graphs=True,
                                             cuda_graph_batch_sizes=(1,), prefill_graph_tokens=lengths))
        tok = engine.tokenizer
        assert tok is not None and len(tok.encode(prompts[-1])) > 32 and len(tok.encode(prompts[0])) <= 32
        ran.clear()
        outputs[lengths] = [c.token_ids for p in prompts for c in engine.generate([p], params)]
        prefills = [s for s in ran if s.last_only and s.chain == 0 and s.tokens > (3 + 1 if spec else 0)]
        if lengths:
            assert {s.tokens for s in prefills if s.hidden == 0} <= {8, 16, 32} and len(
                [s for s in prefills if s.hidden == 0]) == len(prompts) - 1  # the long prompt eagerly
            if spec is not None:
                assert [s for s in prefills if s.hidden > 0]  # the draft's pass over a prompt
        else:
            assert not prefills
    assert outputs[(8, 32, 16)] == outputs[()]


def test_prefill_graph_tokens_are_checked() -> None:
    from fusedserve.worker.engine.config import EngineConfigError

    for bad in ((1,), (8, 8), (4096,)):
        with pytest.raises(EngineConfigError, match="prefill_graph_tokens"):
            EngineConfig(prefill_graph_tokens=bad)


def test_prefill_graph_lengths_default_to_a_gpu_and_one_rank() -> None:
    """None: PREFILL_GRAPH_TOKENS on a CUDA device with one rank, cut to what a step and the model length
    take; off CUDA and on several ranks none; given lengths as given (sorted), () none."""
    from fusedserve.worker.engine.config import PREFILL_GRAPH_TOKENS

    default = EngineConfig()
    assert default.prefill_graph_lengths("cuda", 8192, True) == list(PREFILL_GRAPH_TOKENS)
    assert default.prefill_graph_lengths("cuda", 100, True) == [n for n in PREFILL_GRAPH_TOKENS if n <= 100]
    assert EngineConfig(max_batch_tokens=128).prefill_graph_lengths("cuda", 8192, True)[-1] == 128
    assert default.prefill_graph_lengths("cpu", 8192, True) == default.prefill_graph_lengths("cuda", 8192, False) == []
    assert EngineConfig(prefill_graph_tokens=(64, 32)).prefill_graph_lengths("cpu", 8192, False) == [32, 64]
    assert EngineConfig(prefill_graph_tokens=()).prefill_graph_lengths("cuda", 8192, True) == []


MODES = ("staged", "ahead", "fused", "chained", "step-by-step")


def _spec_engine(monkeypatch: pytest.MonkeyPatch, mode: str, spec: SpeculativeConfig) -> tuple[Engine, list[int]]:
    """An engine whose draft runs a chain as ``mode`` says: "staged" (the default: a greedy round's acceptance
    computed inside the verify's graph, which stages the next round's chain, replayed right behind it), "ahead"
    (that chain drafted behind each verify from the acceptance made by host ops), "fused" (first pass and steps
    in one replay), "chained" (the first pass, then the steps in one replay), "step-by-step" (no chained
    shapes); and counters of the fused replays that ran, of the steps that used a chain drafted ahead and of
    the staged replays."""
    from fusedserve.worker.executor.executor import StepExecutor
    from fusedserve.worker.spec_decode.decoder import SpecDecoder
    from fusedserve.worker.spec_decode.drafter import Drafter

    counts = [0, 0, 0]
    run_first_chain, chain, staged = StepExecutor.run_first_chain, Drafter.chain, Drafter.chain_after_staged

    def staged_counted(self: Drafter, *args: object) -> bool:
        ran = staged(self, *args)  # type: ignore[arg-type]
        counts[2] += ran
        return ran

    monkeypatch.setattr(Drafter, "chain_after_staged", staged_counted)
    if mode != "staged":
        monkeypatch.setattr(SpecDecoder, "_greedy_round", lambda self, *a, **k: None)

    def counted(self: StepExecutor, *args: object, **kwargs: object) -> object:
        out = run_first_chain(self, *args, **kwargs)  # type: ignore[arg-type]
        counts[0] += out is not None
        return out

    def chain_counted(self: Drafter, work: list) -> object:  # type: ignore[type-arg]
        counts[1] += all(w.state.ahead is not None and w.state.ahead.start == w.entry.start for w in work)
        return chain(self, work)

    monkeypatch.setattr(StepExecutor, "run_first_chain", counted)
    monkeypatch.setattr(Drafter, "chain", chain_counted)
    if mode not in ("staged", "ahead"):
        monkeypatch.setattr(Drafter, "chain_after", lambda self, *a, **k: False)
    if mode not in ("staged", "ahead", "fused"):
        monkeypatch.setattr(StepExecutor, "first_chain_shape", lambda self, *a, **k: None)
    if mode == "step-by-step":
        monkeypatch.setattr(StepExecutor, "chainable", lambda self: False)
    engine = Engine(TARGET, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=3, speculative=spec,
                                         cuda_graphs=True, cuda_graph_batch_sizes=(1, 2, 4)))
    return engine, counts


def _runs(monkeypatch: pytest.MonkeyPatch, spec: SpeculativeConfig, batches: list[list[SamplingParams]],
          chained: Callable[[StepShape], bool]) -> dict[str, tuple[list[list[list[int]]], object, int, list[int]]]:
    """Per mode (``MODES``): every batch's tokens (one generate each, on one engine), the speculation stats, and
    after the first batch the draft's replays and ``_spec_engine``'s counters. Checks that the draft captured a
    shape ``chained`` picks in every mode but step-by-step."""
    out = {}
    for mode in MODES:
        with monkeypatch.context() as patch:
            engine, counts = _spec_engine(patch, mode, spec)
            assert engine.speculator is not None
            graphs = engine.speculator.draft.graphs
            assert graphs is not None and any(chained(s) for s in graphs.captured) == (mode != "step-by-step")
            tokens = [[c.token_ids for c in engine.generate(PROMPTS, params)] for params in batches[:1]]
            replays, first = graphs.runs, list(counts)
            tokens += [[c.token_ids for c in engine.generate(PROMPTS, params)] for params in batches[1:]]
        out[mode] = (tokens, engine.stats().spec, replays, first)
    return out


def _agree(runs: dict[str, tuple[list[list[list[int]]], object, int, list[int]]], drafted_ahead: bool,
           staged_rounds: bool) -> None:
    """Every mode gave the same tokens and acceptance; each used its path (``drafted_ahead``: "staged" and
    "ahead" took chains drafted ahead; ``staged_rounds``: "staged" ran greedy rounds staged by the verify); each
    chained replay stood for the 4 step replays of the step-by-step path, a fused one also for the first pass
    ("ahead" also drafts after a sequence's last round)."""
    for mode, (_, _, _, (fused, ahead, staged)) in runs.items():
        # (staged rounds draft ahead by the staged replay, the first pass after a prompt's prefill eagerly)
        assert (fused > 0) == (mode in ("ahead", "fused") or mode == "staged" and not staged_rounds), (mode, fused)
        assert (ahead > 0) == (mode in ("staged", "ahead") and drafted_ahead), (mode, ahead)
        assert (staged > 0) == (mode == "staged" and staged_rounds), (mode, staged)
    assert (runs["staged"][:2] == runs["ahead"][:2] == runs["fused"][:2] == runs["chained"][:2]
            == runs["step-by-step"][:2])
    stats = runs["chained"][1]
    assert stats is not None and stats.accepted_tokens > 0  # type: ignore[attr-defined]
    replays = {mode: run[2] for mode, run in runs.items()}
    saved = replays["step-by-step"] - replays["chained"]
    assert saved > 0 and saved % 3 == 0, replays
    assert replays["fused"] < replays["chained"], replays


@pytest.mark.parametrize("penalty", [1.0, 1.6], ids=["raw", "repetition-penalty"])
def test_chained_greedy_drafts_equal_step_by_step(monkeypatch: pytest.MonkeyPatch, penalty: float) -> None:
    """A greedy chain's draft steps as one chained replay (device-side feedback of token, hidden
    state, position and slot, across a block boundary: block size 4, 5 steps), with the first pass in
    the same replay (its last row's draft and hidden state fed to step 1 on the device), and drafted ahead
    behind the verify from the device's acceptance, propose exactly the step-by-step drafts: same tokens,
    same acceptance at every position. The chained step verifies with the verify's raw argmax read back
    beside the drafts; a request whose logits a penalty adjusts must verify against the adjusted ones
    instead, as the step-by-step path does (and is not drafted ahead)."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=penalty)
    runs = _runs(monkeypatch, SpeculativeConfig(DRAFT, num_steps=5), [[params] * len(PROMPTS)], lambda s: s.chain == 4)
    # a penalty adjusts the logits: the device's raw acceptance cannot stand in for the host's
    _agree(runs, drafted_ahead=penalty == 1.0, staged_rounds=penalty == 1.0)


def test_chained_sampled_drafts_equal_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled chain's draft steps as one chained replay (each draft drawn inside it at the request's
    temperature with its uniform numbers, the distributions returned for the rejection rule), with the
    first pass's draw in the same replay, and drafted ahead, give the step-by-step path's tokens and
    acceptance for seeded requests; a batch mixing greedy, temperature-only and top-p requests takes the
    step-by-step draw (top-p is not drawn in the replay) and agrees too."""
    mixed = [SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
             SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_tokens=14, ignore_eos=True)]
    drawn = [SamplingParams(temperature=t, seed=i, max_tokens=14, ignore_eos=True)
             for i, t in enumerate((0.8, 1.0, 0.0))]
    runs = _runs(monkeypatch, SpeculativeConfig(DRAFT, num_steps=5), [drawn, mixed], lambda s: s.sampled)
    _agree(runs, drafted_ahead=True, staged_rounds=False)


def test_chained_shape_needs_device_metadata_attention() -> None:
    from fusedserve.worker.executor.step_shape import StepShape

    with pytest.raises(ValueError, match="one row per sequence"):
        StepShape(2, 3, hidden=8, chain=2)
    with pytest.raises(ValueError, match="draws its drafts"):
        StepShape(2, 1, hidden=8, sampled=True)


def test_tree_chain_shape_masks_every_step_over_its_scratch_slots() -> None:
    from fusedserve.worker.executor.step_shape import StepShape

    tree = StepShape(2, 3, 6, hidden=8, chain=2)  # 3 leaves a step, 2 steps: a mask over 2 * 3 slots
    assert tree.is_tree_chain and not StepShape(2, 1, hidden=8, chain=2).is_tree_chain
    first = StepShape(2, 4, last_only=True, hidden=24, chain=2)  # a first pass of 4 rows, then 2 one-row steps
    assert first.has_first_pass and not first.is_tree_chain and not tree.has_first_pass
    after = StepShape(2, 4, 6, last_only=True, hidden=24, chain=2)  # a first pass of 4 rows, then 2 steps of 3 leaves
    assert after.has_first_pass and after.is_tree_chain and after.leaves == 3 and tree.leaves == 3 and first.leaves == 1
    for bad in [dict(tokens=3, tail=3), dict(tokens=1, tail=2), dict(tokens=3, tail=3, last_only=True),
                dict(tokens=3, tail=2, last_only=True)]:
        with pytest.raises(ValueError, match="chained shape"):
            StepShape(2, hidden=8, chain=2, **bad)  # type: ignore[arg-type]
