"""EAGLE3 speculative decoding in the engine (one rank, CPU, fp32).

Central property: greedy output with speculation, chain or tree, is token for token the greedy
output without it — on the trained tiny pair (which accepts often, so trees relocate K/V) and on
random tiny models (random drafts, a draft vocabulary smaller than the target's, a shared
embedding), also under chunked prefill and preemption. An "oracle" draft that proposes the
right tokens at awkward tree positions forces deep acceptance with K/V relocation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fusedserve.tiny import make_tiny_eagle3_draft, make_tiny_llama, make_tiny_nemotron_h
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from fusedserve.worker.spec_decode.draft_tree import DraftTree
from fusedserve.worker.spec_decode.drafter import Proposal

pytestmark = pytest.mark.usefixtures("one_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = REPO_ROOT / "examples/checkpoints/tiny-code"
DRAFT = REPO_ROOT / "examples/checkpoints/tiny-code-eagle3"
CODE_PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n", "class Foo:\n    def __init__(self",
                "for i in range(10):\n", "    return self._"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
RANDOM_PROMPTS = [[5, 9, 17, 3, 44, 8, 100], [7, 7, 1], [200, 13, 5, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def chain(draft: Path | str, steps: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(str(draft), num_steps=steps)


def tree(draft: Path | str, steps: int = 4, topk: int = 4, nodes: int = 8) -> SpeculativeConfig:
    return SpeculativeConfig(str(draft), num_steps=steps, topk=topk, num_draft_tokens=nodes)


@pytest.fixture(scope="module")
def code_reference() -> list[list[int]]:
    engine = Engine(TARGET, EngineConfig(num_blocks=64))
    return [c.token_ids for c in engine.generate(CODE_PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-random")
    target = make_tiny_llama(root / "target", seed=3, num_hidden_layers=6, initializer_range=0.15)  # sharp attention
    return {
        "target": target,
        "draft": make_tiny_eagle3_draft(root / "draft", target, seed=4, draft_vocab_size=200),
        "shared": make_tiny_eagle3_draft(root / "shared", target, seed=5, own_embedding=False),
    }


def check_stats(engine: Engine, steps: int, nodes: int) -> None:
    s = engine.stats().spec
    assert s is not None and s.drafts > 0
    assert s.draft_tokens == s.drafts * (nodes - 1)
    assert 0 <= s.accepted_tokens <= s.draft_tokens
    assert len(s.accepted_per_position) == steps and sum(s.accepted_per_position) == s.accepted_tokens
    assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
    assert len(s.accepted_per_step) == steps + 1 and sum(s.accepted_per_step) == s.drafts
    assert sum(k * n for k, n in enumerate(s.accepted_per_step)) == s.accepted_tokens
    assert s.acceptance_length == pytest.approx(1 + s.accepted_tokens / s.drafts)


@pytest.mark.parametrize("spec", [chain(DRAFT), tree(DRAFT)], ids=["chain", "tree"])
def test_tiny_pair_greedy_is_exact_and_accepts(spec: SpeculativeConfig, code_reference: list[list[int]]) -> None:
    engine = Engine(TARGET, EngineConfig(num_blocks=64, speculative=spec))
    out = engine.generate(CODE_PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == code_reference
    check_stats(engine, spec.num_steps, spec.verify_tokens)
    stats = engine.stats()
    assert stats.spec is not None and stats.spec.acceptance_length > 2.0  # the trained pair drafts well
    assert stats.num_free_blocks == stats.num_blocks
    # Under a tiny KV cache and token budget (chunked prefill, preemption by recompute) too.
    small = Engine(TARGET, EngineConfig(num_blocks=12, block_size=8, max_batch_tokens=16, max_num_seqs=5,
                                        speculative=spec))
    out = small.generate(CODE_PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == code_reference
    assert small.stats().num_preemptions > 0 and small.stats().num_free_blocks == 12


def test_random_models_greedy_is_exact(random_pair: dict[str, Path]) -> None:
    cfg = {"num_blocks": 48, "skip_tokenizer": True}
    ref = [c.token_ids for c in Engine(random_pair["target"], EngineConfig(**cfg)).generate(RANDOM_PROMPTS, GREEDY)]
    for draft in ("draft", "shared"):
        for spec in (chain(random_pair[draft], 2), tree(random_pair[draft], 3, 3, 6)):
            engine = Engine(random_pair["target"], EngineConfig(**cfg, speculative=spec))
            assert [c.token_ids for c in engine.generate(RANDOM_PROMPTS, GREEDY)] == ref, (draft, spec)
            check_stats(engine, spec.num_steps, spec.verify_tokens)


def test_oracle_tree_forces_deep_acceptance_with_kv_relocation(random_pair: dict[str, Path]) -> None:
    """Right tokens placed after wrong siblings: every accepted node moves its K/V."""
    cfg = {"num_blocks": 48, "skip_tokenizer": True}
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = [c.token_ids for c in Engine(random_pair["target"], EngineConfig(**cfg)).generate(RANDOM_PROMPTS, params)]
    engine = Engine(random_pair["target"], EngineConfig(**cfg, speculative=tree(random_pair["draft"], 4, 2, 9)))
    speculator = engine.speculator
    assert speculator is not None
    real_propose = speculator.propose
    moves: list[int] = []
    copy_kv = engine.runner.copy_kv

    def count_moves(src: list[int], dst: list[int]) -> None:
        moves.append(len(src))
        copy_kv(src, dst)

    def oracle(work):  # type: ignore[no-untyped-def]
        real_propose(work)  # keeps the draft's cache in step
        out = []
        for w in work:
            n = w.entry.start
            full = RANDOM_PROMPTS[w.seq.seq_id] + ref[w.seq.seq_id]
            right = full[n + 1: n + 5] + [0] * 4
            wrong = [(t + 1) % 250 for t in right]
            # root -> [wrong, right1]; right1 -> [wrong, right2]; right2 -> [wrong, right3]; right3 -> right4
            tokens = (full[n], wrong[0], right[0], wrong[1], right[1], wrong[2], right[2], wrong[3], right[3])
            out.append(Proposal(DraftTree(tokens, (-1, 0, 0, 2, 2, 4, 4, 6, 6))))
        return out

    speculator.propose = oracle  # type: ignore[method-assign]
    engine.runner.copy_kv = count_moves  # type: ignore[method-assign]
    assert [c.token_ids for c in engine.generate(RANDOM_PROMPTS, params)] == ref
    stats = engine.stats().spec
    assert stats is not None and stats.accepted_per_step[4] >= stats.drafts - len(RANDOM_PROMPTS)
    assert sum(moves) >= 4 * (stats.drafts - len(RANDOM_PROMPTS))


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, ignore_eos=True, seed=5)
    other = SamplingParams(temperature=1.0, top_k=20, max_tokens=25, ignore_eos=True, seed=1)
    for spec in (chain(DRAFT), tree(DRAFT, 3, 2, 5)):
        engine = Engine(TARGET, EngineConfig(num_blocks=64, speculative=spec))
        [alone] = engine.generate(CODE_PROMPTS[:1], seeded)
        batch = engine.generate(CODE_PROMPTS[:3], [seeded, other, GREEDY])
        assert batch[0].token_ids == alone.token_ids and len(alone.token_ids) == 30
        check_stats(engine, spec.num_steps, spec.verify_tokens)


def test_engine_config_reserves_lookahead_and_refuses_recurrent_targets(tmp_path: Path) -> None:
    cfg = EngineConfig(num_blocks=8, num_lookahead_tokens=2, speculative=tree("d", 4, 4, 8))
    assert cfg.lookahead_tokens == 16 and cfg.scheduler_config().num_lookahead_tokens == 16
    assert EngineConfig(num_lookahead_tokens=2).lookahead_tokens == 2
    nemotron = make_tiny_nemotron_h(tmp_path / "nemotron")
    with pytest.raises(SpeculativeConfigError, match="recurrent"):
        Engine(nemotron, EngineConfig(num_blocks=8, skip_tokenizer=True, speculative=chain(DRAFT)))
