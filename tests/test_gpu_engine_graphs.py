"""GPU (-m gpu): the engine with CUDA graphs (decode, verify and draft steps replayed at padded
batch sizes) gives the eager engine's greedy outputs, with and without EAGLE3 speculation
(tiny-code + tiny-code-eagle3, float32: the GPU's kernel set for fp32 is the Triton one).

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_engine_graphs.py -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
PROMPTS = ["def fib(n):\n    ", "import os\nclass Foo:\n    def __init__(self", "for i in range(10):",
           "x = [", "with open(path) as f:\n", "    return self."]


def _generate(spec: object, graphs: bool) -> tuple[list[list[int]], object]:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, speculative=spec,  # type: ignore[arg-type]
                                         device="cuda", cuda_graphs=graphs))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)], engine


def _count_follows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rounds were launched before the one ahead of them was read back (``SpecDecoder._follow``)."""
    from fusedserve.worker.spec_decode.decoder import SpecDecoder

    followed = [0]
    follow = SpecDecoder._follow

    def counted(self: SpecDecoder, *args: object) -> object:
        nxt = follow(self, *args)  # type: ignore[arg-type]
        followed[0] += nxt is not None
        return nxt

    monkeypatch.setattr(SpecDecoder, "_follow", counted)
    return followed


@needs_gpu
def test_graph_engine_equals_eager_engine() -> None:
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    specs = {"none": None, "chain-3": SpeculativeConfig(DRAFT, num_steps=3),
             "tree-topk4-steps4-tokens8": SpeculativeConfig(DRAFT, num_steps=4, topk=4, num_draft_tokens=8)}
    baseline = None
    for name, spec in specs.items():
        eager, _ = _generate(spec, False)
        graphed, engine = _generate(spec, True)
        runner = engine.executor  # type: ignore[attr-defined]
        assert runner.graphs is not None and runner.graphs.use_graphs and runner.graphs.runs > 0, name
        if engine.speculator is not None:  # type: ignore[attr-defined]
            draft = engine.speculator.draft  # type: ignore[attr-defined]
            assert draft.graphs is not None and draft.graphs.use_graphs and draft.graphs.runs > 0, name
        assert graphed == eager, name
        baseline = baseline if baseline is not None else eager
        assert graphed == baseline, f"{name}: speculation changed the greedy output"


@needs_gpu
@pytest.mark.parametrize("spec_steps", [0, 3], ids=["none", "chain-3"])
def test_prefill_graphs_equal_eager_prefills_on_the_gpu(spec_steps: int) -> None:
    """``prefill_graph_tokens``: each prompt alone, prefilled as a captured replay where it fits a length (the
    target's and the draft's pass over it), gives the greedy tokens of an engine whose prefills run eagerly."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig(DRAFT, num_steps=spec_steps) if spec_steps else None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for lengths in ((), (8, 16, 32)):
        engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=1, speculative=spec, device="cuda",
                                             cuda_graphs=True, prefill_graph_tokens=lengths))
        outputs[lengths] = [c.token_ids for p in PROMPTS for c in engine.generate([p], params)]
    assert outputs[(8, 16, 32)] == outputs[()]


@needs_gpu
def test_overlapped_steps_equal_read_back_steps_on_the_gpu() -> None:
    """Overlapped steps (on by default here) against every step read back, with graphs: greedy and seeded
    sampling, stop tokens found while the next step runs."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=24 + 5 * i,
                             stop_token_ids=(13,) if i % 3 == 0 else ()) for i in range(len(PROMPTS))]
    runs = {}
    for overlap in (None, False):
        engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda",
                                             overlap_scheduling=overlap))
        assert engine.overlap is (overlap is None)
        runs[overlap] = [(c.token_ids, c.finish_reason) for c in engine.generate(PROMPTS, params)]
    assert runs[None] == runs[False]


@needs_gpu
def test_sampled_chains_under_graphs_keep_greedy_rows_and_reproduce() -> None:
    """chain-3 under graphs on a batch mixing greedy and seeded sampled requests: the sampled rows draw
    their drafts from the draft's q and are accepted on the device (the step's one read-back), the greedy
    rows still give plain greedy decoding's tokens, and the same batch again gives the same tokens."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    plain, _ = _generate(None, True)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda", cuda_graphs=True,
                                             speculative=SpeculativeConfig(DRAFT, num_steps=3)))
        runs.append([c.token_ids for c in engine.generate(PROMPTS, params)])
        stats = engine.stats().spec
        assert stats is not None and stats.drafts > 0 and stats.accepted_tokens > 0
    assert runs[0] == runs[1]
    assert all(runs[0][i] == plain[i] for i in range(1, len(PROMPTS), 2))
    assert any(runs[0][i] != plain[i] for i in range(0, len(PROMPTS), 2))  # the sampled rows sampled


@needs_gpu
def test_chains_drafted_ahead_equal_chains_drafted_after_the_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graphs the next round's chain, drafted on the device behind each verify (its first pass laid out
    as if every draft were accepted, the rejected rows dropped on the device, the replay's output buffers reused
    by the next round's replay), gives the tokens of drafting after the read-back: greedy and seeded sampled
    requests in one batch, chain-3 and chain-5; and it is taken on most rounds."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig
    from fusedserve.worker.spec_decode.drafter import Drafter

    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(len(PROMPTS))]
    taken = [0, 0]
    chain = Drafter.chain

    def counted(self: Drafter, work: list) -> object:  # type: ignore[type-arg]
        taken[0] += 1
        taken[1] += all(w.state.ahead is not None and w.state.ahead.start == w.entry.start for w in work)
        return chain(self, work)

    for steps in (3, 5):
        runs = {}
        for ahead in (True, False):
            with monkeypatch.context() as patch:
                patch.setattr(Drafter, "chain", counted)
                if not ahead:
                    patch.setattr(Drafter, "chain_after", lambda self, *a, **k: False)
                taken[:] = [0, 0]
                engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda", cuda_graphs=True,
                                                     overlap_scheduling=False,  # each round read back: its chain
                                                     speculative=SpeculativeConfig(DRAFT, num_steps=steps)))
                runs[ahead] = [c.token_ids for c in engine.generate(PROMPTS, params)]
                if ahead:
                    assert taken[1] >= taken[0] // 2, taken
                else:
                    assert taken[1] == 0
        assert runs[True] == runs[False], steps


@needs_gpu
def test_greedy_rounds_staged_by_the_verify_equal_the_host_op_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graphs a greedy chain round whose verify graph computes the acceptance and stages the next chain's
    first pass (``verify_program.py``; the host only replays it) gives the tokens and acceptance of the round made
    by host ops (``_deferred_verify``), at batch 1 and 4 (padded), chain-3 and chain-7; and it ran."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig
    from fusedserve.worker.spec_decode.decoder import SpecDecoder
    from fusedserve.worker.spec_decode.drafter import Drafter

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    staged = [0]
    chain_after_staged = Drafter.chain_after_staged

    def counted(self: Drafter, *args: object) -> bool:
        ran = chain_after_staged(self, *args)  # type: ignore[arg-type]
        staged[0] += ran
        return ran

    for steps in (3, 7):
        for prompts in (PROMPTS[:1], PROMPTS[:3]):
            runs = {}
            for on in (True, False):
                with monkeypatch.context() as patch:
                    patch.setattr(Drafter, "chain_after_staged", counted)
                    if not on:
                        patch.setattr(SpecDecoder, "_greedy_round", lambda self, *a, **k: None)
                    staged[0] = 0
                    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda",
                                                         cuda_graphs=True, overlap_scheduling=False,
                                                         speculative=SpeculativeConfig(DRAFT, num_steps=steps)))
                    out = [c.token_ids for c in engine.generate(prompts, params)]
                    runs[on] = (out, engine.stats().spec)
                    assert (staged[0] > 0) == on, (steps, len(prompts), staged)
            assert runs[True] == runs[False], (steps, len(prompts))


@needs_gpu
def test_rounds_in_flight_equal_rounds_read_one_by_one_under_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graphs (the verify's program in the graph stages the next verify's inputs, the Triton launch on a
    GPU) greedy chain rounds launched before the one ahead is read back (``SpecDecoder.advance``, the default on a
    GPU) give the tokens and acceptance of rounds read one by one, for requests of different lengths (a stop drops
    the round launched after it) at chain-3 and chain-7, batch 1 and 3 (padded to 4; a seeded sampled request among
    them: the sampled rounds in flight); and they ran."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    followed = _count_follows(monkeypatch)
    lengths = (17, 40, 29)
    for steps in (3, 7):
        for n in (1, 3):
            runs = {}
            for overlap in (None, False):  # None: the GPU's default
                followed[0] = 0
                engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda", cuda_graphs=True,
                                                     overlap_scheduling=overlap,
                                                     speculative=SpeculativeConfig(DRAFT, num_steps=steps)))
                params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths[:n]]
                if n > 1:  # a seeded sampled request beside the greedy ones (the sampled rounds in flight)
                    params[1] = SamplingParams(temperature=0.9, seed=5, max_tokens=lengths[1], ignore_eos=True)
                out = [c.token_ids for c in engine.generate(PROMPTS[:n], params)]
                runs[overlap] = (out, engine.stats().spec)
                assert (followed[0] > 0) == (overlap is None), (steps, n, followed)
                assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
            assert runs[None] == runs[False], (steps, n)


@needs_gpu
def test_tree_rounds_in_flight_equal_rounds_read_one_by_one_and_eager_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graphs greedy tree rounds in flight (the verify's tree program in one Triton launch: acceptance,
    K/V moves, the draft's first pass + tree chain staged and replayed behind it) give the tokens and acceptance of
    tree rounds read one by one, and the eager engine's tokens (trees built, accepted and relocated by the host),
    at tree-s6-k4-t16 (SmolLM2's) and tree-s3-k2-t6, batch 1 and 3 (padded to 4); and they ran."""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    followed = _count_follows(monkeypatch)
    lengths = (17, 40, 29)
    for steps, topk, nodes in ((6, 4, 16), (3, 2, 6)):
        spec = SpeculativeConfig(DRAFT, num_steps=steps, topk=topk, num_draft_tokens=nodes)
        for n in (1, 3):
            params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths[:n]]
            runs = {}
            for overlap, graphs in ((None, True), (False, True), (False, False)):  # None: the GPU's default
                followed[0] = 0
                engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=4, device="cuda", cuda_graphs=graphs,
                                                     overlap_scheduling=overlap, speculative=spec))
                runs[overlap, graphs] = ([c.token_ids for c in engine.generate(PROMPTS[:n], params)],
                                         engine.stats().spec)
                assert (followed[0] > 0) == (overlap is None), (steps, n, followed)
                assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
            assert runs[None, True] == runs[False, True], (steps, n)
            assert runs[None, True][0] == runs[False, False][0], (steps, n)


@needs_gpu
def test_first_pass_layout_in_one_launch_keeps_the_chains_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_graphs.FIRST_PASS_KERNEL``: the draft's first pass and its chain laid out by one Triton launch
    (``chain_layout_triton``) give the greedy tokens of the torch layout, with chain-3 under graphs, and the
    launch equals ``chain_layout.first_pass`` on the device's own inputs."""
    from fusedserve.worker.executor import step_graphs
    from fusedserve.worker.executor.chain_layout import first_pass
    from fusedserve.worker.executor.chain_layout_triton import first_pass_triton
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig(DRAFT, num_steps=3)
    fused, engine = _generate(spec, True)
    draft = engine.speculator.draft  # type: ignore[attr-defined]
    assert draft.graphs.first_pass is first_pass_triton  # the default on a GPU
    monkeypatch.setattr(step_graphs, "FIRST_PASS_KERNEL", False)
    torch_layout, engine = _generate(spec, True)
    assert engine.speculator.draft.graphs.first_pass is first_pass  # type: ignore[attr-defined]
    assert fused == torch_layout
    g = torch.Generator(device="cuda").manual_seed(3)
    q, b, page, pad = 8, 3, 16, 64 * 16 - 1
    tables = torch.randperm(60, device="cuda", generator=g)[:30].view(b, 10)
    ctx = torch.tensor([40, 12, 1], device="cuda")
    index = torch.cat([c - q + torch.arange(q, device="cuda") for c in (40, 12)] + [torch.zeros(q, device="cuda")]).long()
    slots = torch.cat([tables[i, index[i * q:(i + 1) * q] // page] * page + index[i * q:(i + 1) * q] % page
                       for i in range(2)] + [torch.full((q,), pad, device="cuda")])
    args = (torch.arange(b * q, device="cuda"), index + 1, slots, index, ctx,
            torch.randn(b * q, 96, device="cuda", generator=g), torch.tensor([0, 5, 0], device="cuda"), tables, q, 3,
            page, pad)
    arange = torch.arange(b, device="cuda")
    want = first_pass(*args, (torch.arange(q, device="cuda"), arange, arange * q + q - 1))
    got = first_pass_triton(*args)
    for name in ("ids", "positions", "slots", "index", "hidden", "context_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("positions", "index", "context_lens", "slots"):
        assert torch.equal(getattr(got.steps, name), getattr(want.steps, name)), name
