"""Speculative decoding on a tp=2 engine (gloo): the leader drafts, followers join each target forward.

With fusion "reference" every MLP all-reduce is deferred into the next layer's fused AR + add +
RMSNorm, the situation of sglang PR #28343. The aux states the draft reads must still be the
complete residual stream, so (seed regression) the tp=2 engine accepts exactly the drafts the
tp=1 engine accepts, and greedy output with speculation equals greedy output without it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.tiny import make_tiny_eagle3_draft, make_tiny_llama
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.parallel.local_ranks import RankFailed, run_on_ranks
from fusedserve.worker.spec_decode.config import SpeculativeConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = str(REPO_ROOT / "examples/checkpoints/tiny-code")
DRAFT = str(REPO_ROOT / "examples/checkpoints/tiny-code-eagle3")
CODE_PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n\n", "class Foo:\n    def __init__(self",
                "    return self._"]
RANDOM_PROMPTS = [[5, 9, 17, 3, 44, 8, 100], [7, 7, 1], [200, 13, 5, 5, 6, 7, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _configs(target: str, draft: str) -> dict[str, SpeculativeConfig | None]:
    return {"plain": None, "chain": SpeculativeConfig(draft, num_steps=3),
            "tree": SpeculativeConfig(draft, num_steps=4, topk=4, num_draft_tokens=8)}


def _engine_config(spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(num_blocks=48, skip_tokenizer=True, speculative=spec)


def _generate(engine: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    out = engine.generate(prompts, GREEDY)
    spec = engine.stats().spec
    ledger = engine.collective_ledger()
    deferred = ledger is not None and any(op == "fused_ar_add_rmsnorm" for op, _group in ledger.planned)
    return {"tokens": [c.token_ids for c in out], "spec": spec, "deferred": deferred}


def _run_all(rank: int, world: int, backend: str, runs: list[tuple[str, str, str, list[list[int]]]]
             ) -> dict[str, Any] | None:
    from fusedserve.worker.parallel.rank import run_engine_group

    results: dict[str, Any] = {}
    for key, target, draft, prompts in runs:
        spec = _configs(target, draft)[key.split("/")[1]]
        results[key] = run_engine_group(rank, world, backend, target, _engine_config(spec),
                                        lambda engine, p=prompts: _generate(engine, p), fusion="reference")
    return results if rank == 0 else None


def test_tp2_with_deferred_reduction_matches_tp1_tokens_and_acceptance(tmp_path: Path) -> None:
    from fusedserve.worker.engine.tokenizer import Tokenizer

    target = make_tiny_llama(tmp_path / "target", seed=3, num_hidden_layers=6, initializer_range=0.15)
    draft = make_tiny_eagle3_draft(tmp_path / "draft", target, seed=4, draft_vocab_size=200)
    tok = Tokenizer.from_dir(TARGET)
    code = [tok.encode(p) for p in CODE_PROMPTS]
    runs = [(f"{name}/{kind}", t, d, p) for name, t, d, p in
            [("code", TARGET, DRAFT, code), ("random", str(target), str(draft), RANDOM_PROMPTS)]
            for kind in ("plain", "chain", "tree")]
    torch.set_num_threads(1)
    single = {key: _generate(Engine(t, _engine_config(_configs(t, d)[key.split("/")[1]])), p)
              for key, t, d, p in runs}
    # tp=2 runs speculation only: its reference is tp=1 without speculation
    tp2 = run_on_ranks(_run_all, 2, [r for r in runs if not r[0].endswith("plain")])[0]
    for model in ("code", "random"):
        reference = single[f"{model}/plain"]["tokens"]
        for kind in ("chain", "tree"):
            key = f"{model}/{kind}"
            assert tp2[key]["deferred"], "fusion reference must defer the MLP sums into the next norm"
            assert single[key]["tokens"] == reference, key
            assert tp2[key]["tokens"] == reference, key
            # seed regression (#28343): the same drafts accepted at every position and step
            assert tp2[key]["spec"] == single[key]["spec"], key
    chain, tree = single["code/chain"]["spec"], single["code/tree"]["spec"]
    assert chain.acceptance_length > 2.0 and tree.acceptance_length > 2.0


def _fail_on_follower(rank: int, world: int, backend: str) -> None:
    from fusedserve.worker.executor.executor import StepExecutor
    from fusedserve.worker.parallel.rank import run_engine_group

    if rank == 1:
        forward = StepExecutor.run
        calls = [0]

        def failing(self, step, hidden=None, input_ids=None):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected follower failure")
            return forward(self, step, hidden, input_ids)

        StepExecutor.run = failing  # type: ignore[method-assign]
    spec = SpeculativeConfig(DRAFT, num_steps=3)
    run_engine_group(rank, world, backend, TARGET, _engine_config(spec),
                     lambda engine: engine.generate([[5, 6, 7, 8]], GREEDY), fusion="reference")


def test_follower_failure_does_not_hang_the_leader() -> None:
    """The follower's error ends the run before the process group's timeout could (a hung leader would
    only fail after it): the bound is the timeout, not a speed — spawning and loading two ranks on a busy
    machine took 87 s once."""
    start = time.monotonic()
    with pytest.raises(RankFailed, match="injected follower failure"):
        run_on_ranks(_fail_on_follower, 2, timeout_s=300.0)
    assert time.monotonic() - start < 300.0
