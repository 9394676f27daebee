"""`fusedserve train-draft` at tiny scale: the trainable draft is the inference draft (same logits through
the executor's slot layout), the draft vocabulary, ShareGPT prompts, and the whole command on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedserve.draft_trainer import DraftTrainer, save_draft
from fusedserve.train_draft import TargetFeatures, draft_vocabulary, sharegpt_prompts

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = REPO_ROOT / "examples/checkpoints/tiny-code"  # 8 layers, a chat template: aux layers [2, 4, 5]
QUESTIONS = ["Write a function that adds two numbers.", "What is a list comprehension?", "Explain recursion.",
             "How do I read a file?", "Sort a list of numbers.", "What does import do?", "Define a class.",
             "How to loop over a dict?", "What is a lambda?", "Print hello world.", "How do exceptions work?",
             "What is a generator?"]


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "..."}]}
             for i, q in enumerate(QUESTIONS)]
    convs.append({"id": "dup", "conversations": [{"from": "human", "value": QUESTIONS[0]}]})  # a duplicate
    convs.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "hello"}]})  # no human turn
    path = tmp_path_factory.mktemp("data") / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_prompts_are_first_human_turns_shuffled_and_distinct(sharegpt: Path) -> None:
    prompts = sharegpt_prompts(sharegpt, 100, seed=0)
    assert sorted(prompts) == sorted(QUESTIONS)
    assert prompts == sharegpt_prompts(sharegpt, 100, seed=0) != sharegpt_prompts(sharegpt, 100, seed=1)
    assert len(sharegpt_prompts(sharegpt, 5, seed=0)) == 5


def test_draft_vocabulary_keeps_the_most_frequent_tokens() -> None:
    pairs = [([9, 9], [5, 5, 5, 7, 7, 3]), ([1], [5, 7, 2])]
    d2t, t2d, covered = draft_vocabulary(pairs, 3, vocab=10)
    ids = d2t + torch.arange(3)
    assert ids.tolist() == [2, 5, 7]  # 5 x4, 7 x3, then 3 and 2 once each: the lower id wins the tie
    assert t2d.nonzero().flatten().tolist() == [2, 5, 7]
    assert covered == pytest.approx(8 / 9)
    d2t, _, _ = draft_vocabulary(pairs, 6, vocab=10)  # more than the tokens seen: unseen ids fill up
    assert (d2t + torch.arange(6)).tolist() == [0, 1, 2, 3, 5, 7]


def test_trainer_forward_is_the_inference_draft(tmp_path: Path) -> None:
    """Steps 0 and 1 of the training-time test give the logits the inference draft gives when the
    executor feeds it as the engine's drafter does (base b reads token b+1 with aux b at RoPE b+1;
    a chain step at RoPE n+1 after the bases)."""
    from fusedserve.worker.executor.step import SeqRows, Step
    from fusedserve.worker.spec_decode.draft_model import build_draft

    torch.manual_seed(0)
    features = TargetFeatures(str(TARGET), torch.device("cpu"), 256)
    seq = [3, 17, 99, 5, 250, 8, 61, 400, 12, 33, 77, 1000, 42]
    draft_ids = torch.arange(0, 1024, 2)  # a 512-token draft vocabulary: every even id
    aux, _ = features([seq], draft_ids)
    trainer = DraftTrainer(features.config, torch.randn(1024, 128), torch.randn(512, 128))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1
            p.copy_(p.to(torch.bfloat16).float())  # what the checkpoint holds
        trainer.embed_tokens.weight.copy_(features.rank.model.embed_tokens.weight[:1024].float())
    t2d = torch.zeros(1024, dtype=torch.bool)
    t2d[draft_ids] = True
    save_draft(tmp_path / "draft", trainer, draft_ids - torch.arange(512), t2d, features.config, features.layers)
    model, executor = build_draft(tmp_path / "draft", TARGET, features.config, 8, 16, torch.float32,
                                  torch.device("cpu"))
    n = len(seq) - 2  # bases 0 .. n-1; the chain step reads seq[n + 1]
    with torch.no_grad():
        expect0, expect1 = trainer(aux[0][None, :n].float(), [torch.tensor([seq[1 : n + 1]]),
                                                               torch.tensor([seq[2 : n + 2]])])
    first = executor.run(Step((SeqRows((0, 1), tuple(seq[1 : n + 1]), tuple(range(1, n + 1)), n, n),)), aux[0][:n])
    torch.testing.assert_close(first.logits, expect0[0], atol=2e-4, rtol=1e-4)
    step1 = executor.run(Step((SeqRows((0, 1), (seq[n + 1],), (n + 1,), n + 1, 1),)), first.hidden[0][n - 1 :])
    torch.testing.assert_close(step1.logits[0], expect1[0, n - 1], atol=2e-4, rtol=1e-4)
    assert model.to_target_ids(torch.tensor([0, 1, 511])).tolist() == [0, 2, 1022]
    config = json.loads((tmp_path / "draft/config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # sglang's: output ids
    assert config["draft_vocab_size"] == 512 and config["architectures"] == ["LlamaForCausalLMEagle3"]


def test_train_draft_command_at_tiny_scale(sharegpt: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "draft", tmp_path / "log.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fusedserve.cli", "train-draft", "--target", str(TARGET), "--data", str(sharegpt),
         "--out", str(out), "--budget-minutes", "0.6", "--num-prompts", "12", "--max-new-tokens", "32",
         "--draft-vocab", "512", "--ttt-steps", "3", "--batch-tokens", "2048", "--log", str(log)],
        check=False, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "regenerating" in proc.stderr or "regenerated" in proc.stderr
    record = json.loads(log.read_text())
    assert record["regeneration"]["responses"] >= 2 and record["training"]["steps"] >= 1
    assert record["vocabulary"]["draft_vocab"] == 512 and len(record["heldout"]["top1_per_step"]) == 3
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" not in names and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= names
    # The engine serves the pair; greedy speculation gives the target's own greedy text.
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(TARGET, EngineConfig(num_blocks=32)).generate(["def f(x):"], params)
    spec = Engine(TARGET, EngineConfig(num_blocks=32, speculative=SpeculativeConfig(str(out), num_steps=3)))
    assert spec.generate(["def f(x):"], params)[0].token_ids == plain[0].token_ids
    assert spec.stats().spec is not None and spec.stats().spec.drafts > 0
