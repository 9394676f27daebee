"""Overlapped steps (``worker/engine/inflight_step.py``) against the engine that reads every step's
tokens back before planning the next: the same tokens, text and finish reasons for every request,
through stops found only after the next step was launched, preemption, prefix hits, aborts and
requests that need their tokens on the host; and every block comes back. CPU, fp32; the
overlapped path runs here as on a GPU (the tokens stay in a tensor until read back)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from fusedserve.tiny import make_tiny_nemotron_h
from fusedserve.worker.engine import inflight_step
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.outputs import RequestOutput
from fusedserve.worker.engine.sequence import FinishReason, SamplingParams
from fusedserve.worker.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CODE = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code"
PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "for i in range(10):", "x = [", "# sort a list",
           "def add(a, b):\n    return", "print("]


def make(overlap: bool, model: Path = CODE, **cfg: object) -> Engine:
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("max_num_seqs", 8)
    return Engine(model, EngineConfig(overlap_scheduling=overlap, seed=3, **cfg))  # type: ignore[arg-type]


def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the steps left in flight."""
    count: Counter[str] = Counter()
    real = inflight_step.InFlightStep.launch

    def launch(*args: object) -> inflight_step.InFlightStep:
        count["launched"] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(inflight_step.InFlightStep, "launch", staticmethod(launch))
    return count


def results(e: Engine, prompts: list[str] | list[list[int]], params: list[SamplingParams]
            ) -> list[tuple[list[int], str, FinishReason | None]]:
    return [(c.token_ids, c.text, c.finish_reason) for c in e.generate(prompts, params)]


def frequent_token(e: Engine) -> int:
    """A token the model emits often (a stop token that fires mid-run)."""
    [c] = e.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return Counter(c.token_ids[3:]).most_common(1)[0][0]


def device_params(stop_token: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=40),
            SamplingParams(temperature=1.0, seed=5, max_tokens=33),
            SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=50, stop=("\n\n", "return")),
            SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(stop_token,)),
            SamplingParams(temperature=0, max_tokens=25, min_tokens=10, stop_token_ids=(stop_token,)),
            SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=1, max_tokens=64),
            SamplingParams(temperature=0, max_tokens=64, logit_bias=((stop_token, 2.0),)),
            SamplingParams(temperature=0.9, seed=11, max_tokens=1)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-graph-forwards"])
def test_overlapped_steps_give_the_same_tokens_text_and_stops(graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    sync = make(False, cuda_graphs=graphs)
    params = device_params(frequent_token(sync))
    expected = results(sync, PROMPTS, params)
    assert {r[2] for r in expected} == {FinishReason.STOP, FinishReason.LENGTH}  # stops found mid-run
    count = launches(monkeypatch)
    over = make(True, cuda_graphs=graphs)
    assert results(over, PROMPTS, params) == expected
    steps = max(len(r[0]) for r in expected)
    assert count["launched"] >= steps - 1  # every step after the prefill was left in flight
    assert over.blocks.num_free_blocks == over.blocks.num_blocks and not over.has_unfinished()


def test_requests_that_read_their_tokens_on_the_host_share_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """logprobs, a history penalty, prompt logprobs: their steps read back, the others' still overlap."""
    sync = make(False)
    params = device_params(frequent_token(sync))
    params[1] = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    params[6] = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5)
    params[7] = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1)
    expected = sync.generate(PROMPTS, params)
    count = launches(monkeypatch)
    over = make(True)
    got = over.generate(PROMPTS, params)
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == \
        [(c.token_ids, c.text, c.finish_reason) for c in expected]
    assert count["launched"] > 0
    # generate() returns the logprobs asked for: one per token, the token itself ranked by its two best
    asked = got[1]
    assert [lp.token_id for lp in asked.logprobs] == asked.token_ids and len(asked.token_ids) == 12
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id and lp.rank == 1 for lp in asked.logprobs)
    assert [lp.logprob for lp in asked.logprobs] == pytest.approx([lp.logprob for lp in expected[1].logprobs],
                                                                   abs=1e-5)
    assert all(not c.logprobs for i, c in enumerate(got) if i != 1)


def test_preemption_and_prefix_hits_under_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    shared = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))] for _ in range(10)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=rng.randint(4, 30), ignore_eos=True)
              for i in range(len(prompts))]
    cfg = dict(num_blocks=24, block_size=4, max_num_seqs=6, max_batch_tokens=32, skip_tokenizer=True)
    sync = make(False, **cfg)
    expected = results(sync, prompts, params)
    count = launches(monkeypatch)
    over = make(True, **cfg)
    assert results(over, prompts, params) == expected
    stats = over.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and count["launched"] > 0
    assert over.blocks.num_free_blocks == 24


def test_hybrid_mamba_model_under_overlap(tmp_path: Path) -> None:
    model = make_tiny_nemotron_h(tmp_path / "nemotron-h", seed=1)
    rng = random.Random(10)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 24))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in prompts]
    cfg = dict(num_blocks=12, block_size=4, max_num_seqs=4, max_batch_tokens=10, skip_tokenizer=True)
    assert results(make(True, model, **cfg), prompts, params) == results(make(False, model, **cfg), prompts, params)


def drain(e: Engine) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    while e.has_unfinished():
        out += e.step()
    return out


def test_streamed_outputs_and_aborts_in_flight() -> None:
    """Each step hands back the step before it; streamed deltas add up to the whole completion, and a
    request aborted while its token is in flight ends with "abort", counting only tokens it was given."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    sync = make(False)
    whole = {p: c.token_ids for p, c in zip(PROMPTS, sync.generate(PROMPTS, [params] * len(PROMPTS)))}
    e = make(True)
    ids = {e.add_request(p, params): p for p in PROMPTS}
    assert e.step() == []  # the prefill is in flight
    streamed: dict[str, list[int]] = {rid: [] for rid in ids}
    counts: dict[str, int] = {}
    for _ in range(5):
        for out in e.step():
            streamed[out.request_id] += out.new_token_ids
            counts[out.request_id] = out.num_output_tokens
    victim = next(iter(ids))
    assert e.abort(victim)
    outs = drain(e)
    [end] = [o for o in outs if o.request_id == victim]
    assert end.finish_reason is FinishReason.ABORT and end.num_output_tokens == counts[victim] == len(streamed[victim])
    for out in outs:
        streamed[out.request_id] += out.new_token_ids
    for rid, prompt in ids.items():
        assert streamed[rid] == (whole[prompt][: len(streamed[rid])] if rid == victim else whole[prompt])
    assert e.blocks.num_free_blocks == e.blocks.num_blocks


def test_overlap_off_cuda_is_asked_for_and_covers_speculation(tmp_path: Path) -> None:
    """Off CUDA every step reads back unless asked; with speculation, asking overlaps greedy chain rounds
    (``test_spec_rounds_in_flight.py``)."""
    draft = Path(__file__).resolve().parents[1] / "examples" / "checkpoints" / "tiny-code-eagle3"
    assert make(True, speculative=SpeculativeConfig(draft_model=str(draft), num_steps=2)).overlap
    assert not make(None, speculative=SpeculativeConfig(draft_model=str(draft), num_steps=2)).overlap  # type: ignore[arg-type]
    assert not make(None).overlap  # type: ignore[arg-type]  # the default off CUDA: read back every step


def test_a_one_rank_leader_overlaps_like_the_plain_engine() -> None:
    """``fusedserve run`` builds every engine on a leader's runner; with no follower it overlaps too."""
    from fusedserve.worker.parallel.rank import build_rank, lead_engine

    config = EngineConfig(num_blocks=64, max_num_seqs=8, overlap_scheduling=True, seed=3)
    leader, _ = lead_engine(build_rank(CODE, config), CODE, config)
    assert leader.overlap
    sync = make(False)
    params = device_params(frequent_token(sync))
    assert results(leader, PROMPTS, params) == results(sync, PROMPTS, params)
