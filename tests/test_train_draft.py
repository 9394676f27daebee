"""`fusedserve train-draft` at tiny scale: the trainable draft is the inference draft (same logits through
the executor's slot layout), the draft vocabulary, ShareGPT prompts, and the whole command on CPU."""

from __future__ import annotations

import json
import math
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
    assert sorted(prompts, key=str) == sorted(([{"role": "user", "content": q}] for q in QUESTIONS), key=str)
    assert prompts == sharegpt_prompts(sharegpt, 100, seed=0) != sharegpt_prompts(sharegpt, 100, seed=1)
    assert len(sharegpt_prompts(sharegpt, 5, seed=0)) == 5


def test_later_turns_come_with_the_conversation_before_them(tmp_path: Path) -> None:
    """``--turns later``: each later user turn with the messages before it (the original answers), ``all``
    the first turns too; a gzip'd file reads the same; an unknown speaker or an empty message ends the
    conversation; a repeated history counts once."""
    import gzip

    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                      {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
                                      {"from": "human", "value": "q3"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "r1"}, {"from": "gpt", "value": ""},
                                      {"from": "human", "value": "r2"}]},  # empty answer: r2 has no history
        {"id": "c", "conversations": [{"from": "human", "value": "s1"}, {"from": "tool", "value": "x"},
                                      {"from": "human", "value": "s2"}]},  # unknown speaker
        {"id": "a-again", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                            {"from": "human", "value": "q2"}]},
    ]
    path = tmp_path / "sharegpt.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(convs, f)
    q1, q2, q3 = ({"role": "user", "content": t} for t in ("q1", "q2", "q3"))
    a1, a2 = ({"role": "assistant", "content": t} for t in ("a1", "a2"))
    later = sharegpt_prompts(path, 100, seed=0, turns="later")
    assert sorted(later, key=len) == [[q1, a1, q2], [q1, a1, q2, a2, q3]]
    first = sharegpt_prompts(path, 100, seed=0, turns="first")
    assert sorted(m[0]["content"] for m in first) == ["q1", "r1", "s1"] and all(len(m) == 1 for m in first)
    assert sorted(map(str, sharegpt_prompts(path, 100, seed=0, turns="all"))) == sorted(map(str, first + later))


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
    aux, _ = features([seq])
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


def test_labels_from_the_kept_final_stream_are_hf_log_probs_over_the_draft_vocabulary() -> None:
    """The trainer keeps the stream entering the target's final norm ("layer N") instead of its logits;
    the labels made from it equal HF transformers' log-softmax of the same sequence's logits, restricted to
    the draft vocabulary."""
    from transformers import AutoModelForCausalLM

    features = TargetFeatures(str(TARGET), torch.device("cpu"), 256)
    seq = [3, 17, 99, 5, 250, 8, 61, 400, 12, 33, 77, 1000, 42]
    draft_ids = torch.arange(0, 1024, 2)
    aux, finals = features([seq])
    assert aux[0].shape == (len(seq), 3 * features.config.hidden_size)
    assert finals[0].shape == (len(seq), features.config.hidden_size)
    got = features.labels(draft_ids, torch.device("cpu"))(finals[0])
    hf = AutoModelForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([seq])).logits[0, :, draft_ids].float(), -1)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_features_past_the_device_budget_wait_in_host_memory_and_give_the_same_batches() -> None:
    """``cache_features`` keeps batches on the device until ``device_bytes`` would be passed, the rest in host
    memory (pinned on a GPU); ``prepare_batch`` brings them in: the same aux states, labels and masks as
    with every feature on the device, each sequence its own span."""
    from fusedserve.train_draft import Progress, cache_features, prepare_batch

    cpu = torch.device("cpu")
    features = TargetFeatures(str(TARGET), cpu, 256)
    labels = features.labels(torch.arange(0, 1024, 2), cpu)
    pairs = [([3, 17, 99, 5], [250, 8, 61, 400, 12]), ([33, 77], [1000, 42, 7]), ([5, 6, 7, 8, 9], [10, 11])] * 3
    every = cache_features(features, pairs, 32, cpu, Progress())
    some = cache_features(features, pairs, 32, cpu, Progress(), device_bytes=1)
    assert [e.ids.tolist() for e in every] == [e.ids.tolist() for e in some]
    assert all(e.aux.shape == (e.ids.numel(), 3 * features.config.hidden_size) for e in some)
    assert not any(e.aux.data_ptr() == f.aux.data_ptr() for e, f in zip(every, some))
    for got, want in zip(prepare_batch(some[:4], labels), prepare_batch(every[:4], labels)):
        assert torch.equal(got, want)


def test_training_batches_come_in_few_shapes_within_the_token_budget() -> None:
    """Batches pad to one of PAD_STEPS lengths an octave and hold batch_tokens // that many sequences: 2 000
    sequences of 1 000 different lengths come in a few dozen shapes, each example once, none over the budget,
    with a few per cent of padding."""
    import random

    from fusedserve.train_draft import Example, example_batches, padded_length

    empty = torch.empty(0)
    lengths = random.Random(0).sample(range(8, 1030), 1000) * 2
    examples = [Example(torch.zeros(n, dtype=torch.long), empty, empty, empty) for n in lengths]
    got = example_batches(examples, 16384, random.Random(1))
    assert sorted(id(e) for b in got for e in b) == sorted(id(e) for e in examples)
    shapes = {(len(b), padded_length(max(e.ids.numel() for e in b))) for b in got}
    assert all(padded_length(length) == length and rows * length <= 16384 for rows, length in shapes)
    assert len(shapes) < len(got) / 2
    assert sum(len(b) * padded_length(max(e.ids.numel() for e in b)) for b in got) < 1.08 * sum(lengths)
    assert [padded_length(n) for n in (1, 100, 128, 129, 432, 1000, 1024)] == [16, 112, 128, 144, 448, 1024, 1024]


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
    assert sum(e["steps"] for e in record["training"]["epochs"]) == record["training"]["steps"]
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


# Across device calls: --regen-only --save-pairs, --pairs, --init (in-process: a few seconds each).

def _train_draft(*args: str | Path) -> int:
    from fusedserve.cli import main

    return main(["train-draft", "--target", str(TARGET), *map(str, args)])


@pytest.fixture(scope="module")
def regenerated(sharegpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --regen-only call's folder: pairs.pt and regen.json (no --out)."""
    out = tmp_path_factory.mktemp("regen")
    assert _train_draft("--data", sharegpt, "--regen-only", "--save-pairs", out / "pairs.pt", "--budget-minutes", 1,
                        "--num-prompts", 12, "--max-new-tokens", 16, "--log", out / "regen.json") == 0
    return out


@pytest.mark.parametrize("wave", [0.0, 0.5])
def test_regeneration_admits_prompts_in_waves(monkeypatch: pytest.MonkeyPatch, wave: float) -> None:
    """``admit_wave``: new prompts go in once that share of the engine's sequences (8 on CPU) has finished, all
    free places at once (their prefills in few steps); 0: each place as it frees up. Every prompt is answered."""
    import time

    from fusedserve.train_draft import Progress, TrainOptions, regenerate
    from fusedserve.worker.engine.engine import Engine

    steps, admitted_at = [0], []
    step, add = Engine.step, Engine.add_request

    def counted_step(self: Engine) -> object:
        steps[0] += 1
        return step(self)

    def logged_add(self: Engine, *args: object, **kwargs: object) -> str:
        admitted_at.append(steps[0])
        return add(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "step", counted_step)
    monkeypatch.setattr(Engine, "add_request", logged_add)
    from fusedserve.worker.engine import sequence

    params = sequence.SamplingParams  # responses of 2..8 tokens by the request's seed: finishes staggered
    monkeypatch.setattr(sequence, "SamplingParams", lambda **kw: params(**{**kw, "max_tokens": 2 + kw["seed"] % 7}))
    opts = TrainOptions(target=str(TARGET), data="unused", out="unused", max_new_tokens=8, temperatures=(0.0, 0.8),
                        device="cpu", admit_wave=wave)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS + [q + " Briefly." for q in QUESTIONS]]
    prompts[-1] = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}, *prompts[-1]]
    # 24 prompts (the last with a conversation before it), 8 sequences at a time
    pairs, stats = regenerate(opts, prompts, time.monotonic() + 300, Progress())
    from fusedserve.worker.engine.tokenizer import Tokenizer

    history = Tokenizer.from_dir(TARGET).encode_chat(prompts[-1])
    assert sum(p == history for p, _ in pairs) == 1  # the history's turns are in its prompt ids
    assert len(pairs) == stats["responses"] == 24 and stats["admit_wave"] == wave
    moments = sorted(set(admitted_at))
    assert admitted_at.count(0) == 8  # the first 8 at once
    if wave:
        assert all(admitted_at.count(t) >= 4 for t in moments[:-1])  # then 4 or more at a time
    else:
        assert len(moments) > 24 // 4  # as places free up: more, smaller admissions


def test_pairs_file_round_trip_is_exact_and_compact(tmp_path: Path) -> None:
    from fusedserve.draft_pairs import load_pairs, save_pairs

    g = torch.Generator().manual_seed(0)
    # ~6 400 pairs of ~200 + ~300 tokens of SmolLM2's vocabulary: a regeneration call's worth
    ids = torch.randint(0, 49152, (6400, 500), generator=g).tolist()
    cut = torch.randint(150, 250, (6400,), generator=g).tolist()
    pairs = [(row[:c], row[c:]) for row, c in zip(ids, cut)]
    size = save_pairs(tmp_path / "pairs.pt", pairs, 49152, "llama", {"temperatures": [0.0, 0.8]})
    assert size < 16 << 20 and size == (tmp_path / "pairs.pt").stat().st_size  # 6.46 MB (uint16 ids)
    back, meta = load_pairs(tmp_path / "pairs.pt", 49152, "llama")
    assert back == pairs and meta["pairs"] == 6400 and meta["temperatures"] == [0.0, 0.8]
    wide = [([70000, 1], [99999]), ([], [0, 65536])]  # a vocabulary over 2^16: int32 ids
    save_pairs(tmp_path / "wide.pt", wide, 100000, "llama", {})
    assert load_pairs(tmp_path / "wide.pt", 100000, "llama")[0] == wide


def test_regen_only_writes_the_pairs_and_no_checkpoint(regenerated: Path) -> None:
    from fusedserve.draft_pairs import load_pairs

    assert sorted(p.name for p in regenerated.iterdir()) == ["pairs.pt", "regen.json"]
    record = json.loads((regenerated / "regen.json").read_text())
    assert "training" not in record and "checkpoint" not in record
    pairs, meta = load_pairs(regenerated / "pairs.pt", 1024, "llama")
    assert len(pairs) == record["regeneration"]["responses"] == record["pairs"]["pairs"] >= 10
    assert meta["max_new_tokens"] == 16 and meta["temperatures"] == [0.0, 0.8]
    assert sum(len(r) for _, r in pairs) == record["regeneration"]["response_tokens"]


def test_init_keeps_the_draft_vocabulary_and_trains_on_the_pairs(regenerated: Path, tmp_path: Path) -> None:
    """--pairs instead of regenerating, --init from a checkpoint save_draft wrote: its vocabulary
    (every even id, not the responses' most frequent) and weights are where training starts."""
    from safetensors.torch import load_file

    from fusedserve.draft_trainer import load_draft
    from fusedserve.models.loader import load_config

    config = load_config(TARGET)
    torch.manual_seed(1)
    init = DraftTrainer(config, torch.randn(1024, 128), torch.randn(512, 128))
    with torch.no_grad():
        for p in init.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # nothing a fresh draft would start from
    d2t, t2d = torch.arange(0, 1024, 2) - torch.arange(512), torch.arange(1024) % 2 == 0
    save_draft(tmp_path / "init", init, d2t, t2d, config, [2, 4, 5])
    out, log = tmp_path / "draft", tmp_path / "log.json"
    assert _train_draft("--pairs", regenerated / "pairs.pt", "--init", tmp_path / "init", "--out", out,
                        "--draft-vocab", 256, "--max-steps", 3, "--ttt-steps", 2, "--batch-tokens", 2048,
                        "--log", log) == 0
    record = json.loads(log.read_text())
    assert record["init"]["path"] == str(tmp_path / "init") and record["vocabulary"]["draft_vocab"] == 512
    assert record["pairs"]["pairs"] == json.loads((regenerated / "regen.json").read_text())["pairs"]["pairs"]
    assert "regeneration" not in record and record["training"]["steps"] == 3
    losses = [c["loss"] for c in record["training"]["curve"] if "loss" in c]
    assert losses and all(math.isfinite(v) for v in losses)
    assert record["training"]["curve"][0]["step"] == 0  # the checkpoint's own held-out agreement first
    saved, start = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "init/model.safetensors"))
    assert torch.equal(saved["d2t"], d2t) and torch.equal(saved["t2d"], t2d)
    # 3 steps at a warming-up learning rate move the weights little: they are the checkpoint's
    torch.testing.assert_close(saved["fc.weight"].float(), start["fc.weight"].float(), atol=0.02, rtol=0)
    # a checkpoint of bench/train_tiny_pair.py (embed_tokens kept, aux ids in the input convention) reads too
    assert load_draft(REPO_ROOT / "examples/checkpoints/tiny-code-eagle3", config, [2, 4, 5]).d2t.numel() == 1024


@pytest.mark.parametrize("case", ["vocab", "missing", "corrupt", "init-vocab", "init-layers", "regen-only-no-file"])
def test_unusable_inputs_are_refused_before_any_work(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from fusedserve.draft_pairs import save_pairs
    from fusedserve.models.loader import load_config

    pairs = tmp_path / "pairs.pt"
    save_pairs(pairs, [([1, 2], [3, 4])] * 2, 2048 if case == "vocab" else 1024, "llama", {})
    config = load_config(TARGET)
    save_draft(tmp_path / "init", DraftTrainer(config, torch.zeros(1024, 128), torch.zeros(4, 128)),
               torch.zeros(4, dtype=torch.long), torch.arange(1024) < 4, config, [2, 3, 5] if case == "init-layers"
               else [2, 4, 5])
    if case == "init-vocab":
        cfg = json.loads((tmp_path / "init/config.json").read_text())
        (tmp_path / "init/config.json").write_text(json.dumps({**cfg, "vocab_size": 2048}))
    if case == "corrupt":
        pairs.write_bytes(pairs.read_bytes()[:100])
    args: dict[str, list[str | Path]] = {
        "vocab": ["--pairs", pairs], "missing": ["--pairs", tmp_path / "nowhere.pt"], "corrupt": ["--pairs", pairs],
        "init-vocab": ["--pairs", pairs, "--init", tmp_path / "init"],
        "init-layers": ["--pairs", pairs, "--init", tmp_path / "init"], "regen-only-no-file": ["--regen-only"]}
    expect = {"vocab": "pairs of another target: vocab size 2048 (the target: 1024)", "missing": "no such file",
              "corrupt": "not a readable pairs file", "init-vocab": "a draft of another target: vocab size 2048",
              "init-layers": "aux layers [2, 3, 5] (the target: [2, 4, 5])",
              "regen-only-no-file": "--regen-only needs --save-pairs FILE"}
    data = [] if case != "regen-only-no-file" else ["--data", tmp_path / "unused.json"]
    assert _train_draft(*args[case], *data, "--out", tmp_path / "draft", "--log", tmp_path / "log.json") == 2
    assert expect[case] in capsys.readouterr().err
    assert not (tmp_path / "draft").exists() and not (tmp_path / "log.json").exists()
