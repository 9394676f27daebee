"""Speculative rounds in flight (``SpecDecoder.advance``, ``overlap_scheduling`` with speculation): a greedy chain
round is launched before the one ahead of it is read back, on the inputs that round's verify staged on the device
(``verify_program.stage_next_verify``), and it gives exactly the tokens, text, stops and acceptance of rounds read
back one by one. So does a greedy tree round (``tree_verify_program.py``: the accepted nodes' K/V moved on the
device, the next tree drafted behind the verify on its staged first pass), and both equal the host's tree path
(trees built, accepted and relocated by the host: ``cuda_graphs=False``). On CPU the captured shapes run eagerly on the same static buffers (``cuda_graphs=True``), so the
staging, the block tables reserved ahead and the rounds dropped after a stop are checked here as on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.outputs import RequestOutput
from fusedserve.worker.engine.sequence import FinishReason, SamplingParams
from fusedserve.worker.spec_decode.config import SpeculativeConfig
from fusedserve.worker.spec_decode.decoder import RoundInFlight, SpecDecoder

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
PROMPTS = ["def fib(n):\n    ", "import os\nclass Foo:\n", "for i in range(10):"]


# trees as (num_steps, topk, num_draft_tokens): the SmolLM2 defaults' shape (deep, wide, a verify of 16) and small ones
TREES = [(3, 2, 6), (5, 4, 16), (2, 3, 4)]


def _engine(overlap: bool, steps: int = 3, tree: tuple[int, int] | None = None, **config: object) -> Engine:
    """``tree``: (topk, num_draft_tokens), else a chain of ``steps``."""
    settings: dict[str, object] = {"num_blocks": 48, "block_size": 4, "max_num_seqs": 3,
                                   "cuda_graph_batch_sizes": (1, 2, 4), "cuda_graphs": True}
    settings.update(config)
    spec = SpeculativeConfig(DRAFT, num_steps=steps) if tree is None else SpeculativeConfig(
        DRAFT, num_steps=steps, topk=tree[0], num_draft_tokens=tree[1])
    return Engine(TARGET, EngineConfig(speculative=spec, overlap_scheduling=overlap, **settings))  # type: ignore[arg-type]


def _count_follows(monkeypatch: pytest.MonkeyPatch, sampled_only: bool) -> list[int]:
    """How many rounds (with ``sampled_only``: rounds with sampled requests) were launched before the one ahead of
    them was read back."""
    count = [0]
    follow = SpecDecoder._follow

    def counted(self: SpecDecoder, r: RoundInFlight, *args: object) -> RoundInFlight | None:
        nxt = follow(self, r, *args)  # type: ignore[arg-type]
        count[0] += nxt is not None and (bool(r.sampled) or not sampled_only)
        return nxt

    monkeypatch.setattr(SpecDecoder, "_follow", counted)
    return count


@pytest.fixture
def followed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count_follows(monkeypatch, sampled_only=False)


def _drive(engine: Engine, requests: dict[int, list[tuple[str, SamplingParams]]], abort: dict[int, str] | None = None,
           max_steps: int = 400) -> dict[str, tuple[list[int], str, FinishReason | None]]:
    """Run the engine step by step, adding ``requests[k]`` before step k and aborting ``abort[k]`` before it ->
    per request its streamed tokens, text and finish reason."""
    got: dict[str, tuple[list[int], str, FinishReason | None]] = {}

    def take(outs: list[RequestOutput]) -> None:
        for out in outs:
            tokens, text, _ = got.get(out.request_id, ([], "", None))
            got[out.request_id] = (tokens + out.new_token_ids, text + out.text_delta, out.finish_reason)

    for k in range(max_steps):
        for rid, (prompt, params) in enumerate(requests.get(k, [])):
            engine.add_request(prompt, params, request_id=f"{k}-{rid}")
        if abort and k in abort:
            assert engine.abort(abort[k])
        if k > max(requests) and not engine.has_unfinished():
            return got
        take(engine.step())
    raise AssertionError("the engine did not finish")


GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=eos) for n, eos in ((13, True), (29, True), (40, False))]
SAMPLED = [SamplingParams(temperature=0.9, seed=7, max_tokens=31, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
           SamplingParams(temperature=1.3, seed=11, max_tokens=40)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_rounds_in_flight_equal_rounds_read_one_by_one(monkeypatch: pytest.MonkeyPatch,
                                                       params: list[SamplingParams]) -> None:
    """Three requests of different lengths (each stop drops the round launched after it), with and without EOS,
    at chain-3 and chain-5 (rounds crossing block boundaries: block size 4): the same tokens, text, finish reasons
    and acceptance counts as rounds read one by one; the in-flight rounds ran. Greedy, and seeded requests at
    temperatures 0.9 and 1.3 beside a greedy one: there the verify's staged inputs are moved to the rejection
    rule's outcome on the device and the sampled chain replays on the staged first pass, drawing the same numbers
    from each request's stream in the same order; the greedy request among them gets plain greedy tokens."""
    sampled = params is SAMPLED
    follows = _count_follows(monkeypatch, sampled_only=sampled)
    for steps in (3, 5):
        runs = {}
        for overlap in (True, False):
            follows[0] = 0
            engine = _engine(overlap, steps)
            outs = engine.generate(PROMPTS, params)
            runs[overlap] = ([(c.token_ids, c.text, c.finish_reason) for c in outs], engine.stats().spec)
            assert (follows[0] > 3) == overlap, (steps, follows)
            assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert runs[True] == runs[False], steps
        if sampled:
            greedy = _engine(False, steps).generate(PROMPTS[1:2], params[1:2])[0].token_ids
            assert runs[True][0][1][0] == greedy


@pytest.mark.parametrize("tree", TREES, ids=["-".join(map(str, t)) for t in TREES])
def test_tree_rounds_in_flight_equal_rounds_read_one_by_one_and_the_host_path(
        followed: list[int], tree: tuple[int, int, int]) -> None:
    """Greedy tree rounds (three requests of different lengths, with and without EOS; blocks of 4 slots, so rounds
    and the next trees cross block boundaries): in flight, read one by one (the device's acceptance and K/V moves,
    nothing in flight) and on the host's path (trees built, accepted and relocated by the host) give the same
    tokens, text, finish reasons and acceptance counts, and end with every block free."""
    steps, topk, nodes = tree
    runs = {}
    for name, overlap, graphs in (("in flight", True, True), ("one by one", False, True), ("host", False, False)):
        followed[0] = 0
        engine = _engine(overlap, steps, (topk, nodes), num_blocks=64, cuda_graphs=graphs)
        outs = engine.generate(PROMPTS, GREEDY)
        runs[name] = ([(c.token_ids, c.text, c.finish_reason) for c in outs], engine.stats().spec)
        assert (followed[0] > 3) == overlap, (name, followed)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert runs["in flight"] == runs["one by one"] == runs["host"]
    assert runs["host"][1].accepted_tokens > 0


_GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ARRIVALS = {  # requests added before step k, the request aborted and the step before which it is
    "greedy": ({0: [(PROMPTS[0], _GREEDY_24), (PROMPTS[1], _GREEDY_24)],
                6: [(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop=["\n\n", "):"]))],
                11: [(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]}, "0-1", 9),
    "sampled": ({0: [(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)),
                     (PROMPTS[1], SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True))],
                 5: [(PROMPTS[2], SamplingParams(temperature=0.8, seed=9, max_tokens=18, ignore_eos=True))]}, "0-0", 8),
}


@pytest.mark.parametrize("case", [*sorted(ARRIVALS), "tree"])
def test_rounds_in_flight_with_arrivals_aborts_and_stop_strings(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Requests arriving while rounds are in flight (the round read back, nothing launched after it, the newcomer
    prefilled), an abort of a request whose round is in flight, and stop strings, greedy and sampled, and greedy
    with trees (a newcomer's first round drafts its tree anew beside the others'): every request streams what it
    does when rounds are read one by one, and the engine ends with every block free."""
    requests, victim, at = ARRIVALS["greedy" if case == "tree" else case]
    follows = _count_follows(monkeypatch, sampled_only=case == "sampled")
    runs = {}
    for overlap in (True, False):
        follows[0] = 0
        engine = _engine(overlap, tree=(2, 6), num_blocks=64) if case == "tree" else _engine(overlap)
        runs[overlap] = _drive(engine, requests, abort={at: victim})
        assert (follows[0] > 0) == overlap
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    got, want = runs[True], runs[False]
    assert set(got) == set(want) == {f"{k}-{i}" for k, added in requests.items() for i in range(len(added))}
    for rid in set(got) - {victim}:
        assert got[rid] == want[rid], rid
    aborted, whole = got[victim], want[victim]
    assert aborted[2] is FinishReason.ABORT and aborted[0] == whole[0][:len(aborted[0])]  # a prefix: aborted earlier


@pytest.mark.parametrize("tree", [None, (2, 6)], ids=["chain", "tree"])
def test_rounds_in_flight_near_the_model_length_and_out_of_blocks(followed: list[int], tree: tuple[int, int] | None
                                                                   ) -> None:
    """Close to ``max_model_len`` no round is launched past it, and where the free blocks cannot hold a round ahead
    the rounds are read one by one (the scheduler preempts as it would): the same tokens either way, chains and
    trees."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for config in ({"max_model_len": 40}, {"num_blocks": 18 if tree is None else 24, "max_model_len": 64}):
        runs = {}
        for overlap in (True, False):
            followed[0] = 0
            engine = _engine(overlap, tree=tree, **config)
            runs[overlap] = [(c.token_ids, c.finish_reason) for c in engine.generate(PROMPTS, params)]
            assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
            assert (followed[0] > 0) == overlap
        assert runs[True] == runs[False], config
        assert all(reason is FinishReason.LENGTH for _, reason in runs[True])


def test_a_one_rank_leader_speculates_in_flight_like_the_engine(followed: list[int]) -> None:
    """``fusedserve run`` builds its engine on a group leader's runner; with no follower (``single_rank``) the
    decoder takes the one-rank paths — the verify program, rounds in flight — and gives the plain engine's tokens
    and acceptance."""
    from fusedserve.worker.parallel.rank import build_rank, lead_engine

    config = EngineConfig(num_blocks=48, block_size=4, max_num_seqs=3, cuda_graph_batch_sizes=(1, 2, 4),
                          speculative=SpeculativeConfig(DRAFT, num_steps=3), cuda_graphs=True, overlap_scheduling=True)
    leader, runner = lead_engine(build_rank(TARGET, config), TARGET, config)
    assert runner.single_rank and leader.runner is runner
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    got = [c.token_ids for c in leader.generate(PROMPTS, params)]
    assert followed[0] > 0
    alone = _engine(False)
    assert got == [c.token_ids for c in alone.generate(PROMPTS, params)]
    assert leader.stats().spec == alone.stats().spec


@pytest.mark.parametrize("tree", [None, (4, 16)], ids=["chain", "tree"])
def test_rounds_stay_in_flight_while_the_queue_cannot_be_admitted(followed: list[int], tree: tuple[int, int] | None
                                                                  ) -> None:
    """Five requests on two running slots: while both slots are taken the waiting ones cannot be admitted, so the
    rounds stay in flight; each stop frees a slot, the round is read back and the next request admitted — the
    tokens of rounds read one by one, chains and trees."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (11, 26, 17, 9, 20)]
    prompts = [*PROMPTS, PROMPTS[0] + "return", PROMPTS[2] + " x"]
    runs = {}
    for overlap in (True, False):
        followed[0] = 0
        engine = _engine(overlap, max_num_seqs=2) if tree is None else _engine(overlap, 5, tree, max_num_seqs=2,
                                                                                num_blocks=64)
        runs[overlap] = ([(c.token_ids, c.finish_reason) for c in engine.generate(prompts, params)],
                         engine.stats().spec)
        assert (followed[0] > 10) == overlap, followed
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert runs[True] == runs[False]


@pytest.mark.parametrize("tree", [None, (2, 6)], ids=["chain", "tree"])
def test_no_round_is_launched_after_one_that_may_reach_max_tokens(followed: list[int], tree: tuple[int, int] | None
                                                                   ) -> None:
    """A round emits up to ``num_steps + 1`` tokens, so once every sequence has no more than that left before its
    ``max_tokens`` the next round is not launched ahead: it would run for nothing after a round that ends them
    (and a next request's prefill would wait behind it). Rounds still follow one another before that, no round is
    ever left in flight over finished sequences only, and the tokens are those of rounds read one by one."""
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    runs = {}
    for overlap in (True, False):
        followed[0] = 0
        engine = _engine(overlap, tree=tree, num_blocks=64)
        spec = engine.speculator
        assert spec is not None
        for rid, prompt in enumerate(PROMPTS[:1]):
            engine.add_request(prompt, params, request_id=str(rid))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            r = spec._in_flight
            assert r is None or r.work is None or not all(w.seq.is_finished for w in r.work)
        runs[overlap] = tokens
        assert (followed[0] > 3) == overlap, followed
    assert runs[True] == runs[False] and len(runs[True]) == 33
