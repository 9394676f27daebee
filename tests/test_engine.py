"""Engine end to end on tiny random Llama checkpoints (CPU, fp32).

The central property: whatever the batching does (many concurrent sequences, chunked prefill,
a KV cache so small that sequences are preempted and recomputed), every sequence gets the
tokens it would get alone, and every block comes back.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.interface import ModelOutput
from fusedserve.models.layers.mamba_state import MambaStateCache, MambaStateShape
from fusedserve.tiny import make_tiny_llama, make_tiny_nemotron_h
from fusedserve.tiny_tokenizer import make_tiny_tokenizer
from fusedserve.worker.engine.config import EngineConfig, EngineConfigError
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.forward_step import forward_step
from fusedserve.worker.engine.outputs import RequestOutput
from fusedserve.worker.engine.scheduler import ScheduledBatch, ScheduledSeq
from fusedserve.worker.engine.sequence import FinishReason, InvalidRequest, SamplingParams
from fusedserve.worker.engine.tokenizer import Tokenizer, TokenizerError
from fusedserve.worker.executor.executor import StepExecutor
from fusedserve.worker.executor.kv_cache import (
    kv_bytes_per_block,
    num_blocks_for_memory,
    state_bytes_per_slot,
)
from fusedserve.worker.executor.step import Step

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def text_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a tokenizer whose greedy text is printable: the LM-head rows of special
    tokens and of byte tokens that are no whole character are zeroed, so they never win."""
    from safetensors.torch import load_file, save_file

    d = make_tiny_llama(tmp_path_factory.mktemp("text-llama"), seed=2, num_hidden_layers=2, vocab_size=300,
                        bos_token_id=0, eos_token_id=1)
    make_tiny_tokenizer(d, vocab_size=300)
    tok = Tokenizer.from_dir(d)
    dirty = [i for i in range(300) if i in tok.special_ids or not tok.decode([i]).isprintable()
             or "\ufffd" in tok.decode([i])]
    weights = load_file(str(d / "model.safetensors"))
    weights["lm_head.weight"][dirty] = 0.0
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def engine(model_dir: Path, **cfg: object) -> Engine:
    cfg.setdefault("skip_tokenizer", True)
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("block_size", 4)
    return Engine(model_dir, EngineConfig(**cfg))  # type: ignore[arg-type]


def random_prompts(n: int, seed: int, vocab: int = 250, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def test_greedy_matches_transformers(llama_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    batch = random_prompts(3, seed=0)
    ours = engine(llama_dir).generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, completion in zip(batch, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(8):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert completion.token_ids == ids[0, len(prompt):].tolist()
        assert completion.finish_reason == "length"


@pytest.mark.parametrize("chunked,max_batch_tokens", [(True, 24), (False, 96)])
def test_concurrent_sequences_under_preemption_match_running_alone(
        llama_dir: Path, chunked: bool, max_batch_tokens: int) -> None:
    batch = random_prompts(14, seed=3)
    rng = random.Random(4)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 24), ignore_eos=True) for _ in batch]
    alone_engine = engine(llama_dir, num_blocks=64)
    alone = [alone_engine.generate([p], sp)[0].token_ids for p, sp in zip(batch, params)]

    small = engine(llama_dir, num_blocks=24, block_size=4, max_num_seqs=6, max_batch_tokens=max_batch_tokens,
                   enable_chunked_prefill=chunked)
    together = small.generate(batch, params)
    assert small.stats().num_preemptions > 0, "the cache was meant to force preemption"
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t.token_ids == a, f"sequence {i}"
        assert len(t.token_ids) == params[i].max_tokens and t.finish_reason == "length"
    assert small.blocks.num_free_blocks == 24
    assert not small.has_unfinished()


def test_hybrid_mamba_model_keeps_state_per_sequence(tmp_path: Path) -> None:
    """Nemotron-H (Mamba2 + attention + MoE): recurrent state slots survive chunked prefill and
    are rebuilt after preemption, so batched greedy tokens equal solo ones (and HF's)."""
    from transformers import NemotronHForCausalLM

    model_dir = make_tiny_nemotron_h(tmp_path / "nemotron-h", seed=1)
    batch = random_prompts(8, seed=10, max_len=24)
    rng = random.Random(11)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in batch]
    solo_engine = engine(model_dir, num_blocks=64)
    solo = [solo_engine.generate([p], sp)[0].token_ids for p, sp in zip(batch, params)]
    small = engine(model_dir, num_blocks=12, max_num_seqs=4, max_batch_tokens=10)
    assert small.executor.state_cache is not None
    together = small.generate(batch, params)
    assert small.stats().num_preemptions > 0
    assert [c.token_ids for c in together] == solo
    assert small.blocks.num_free_blocks == 12
    hf = NemotronHForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([batch[0]])
    with torch.no_grad():
        for _ in range(params[0].max_tokens):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, len(batch[0]):].tolist() == solo[0]


def run_all(e: Engine) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    while e.has_unfinished():
        out += e.step()
    return out


def test_aborts_free_everything(llama_dir: Path) -> None:
    e = engine(llama_dir, num_blocks=20, max_num_seqs=3)
    ids = [e.add_request(p, GREEDY) for p in random_prompts(6, seed=5)]
    for _ in range(3):
        e.step()
    running = [s.request_id for s in e.scheduler.running]
    waiting = [s.request_id for s in e.scheduler.waiting]
    assert running and waiting
    assert e.abort(running[0]) and e.abort(waiting[-1])
    assert not e.abort(running[0]) and not e.abort("no-such-request")
    outs = run_all(e)
    aborted = [o for o in outs if o.finish_reason == FinishReason.ABORT]
    assert sorted(o.request_id for o in aborted) == sorted([running[0], waiting[-1]])
    assert all(o.finished and not o.new_token_ids for o in aborted)
    finished = {o.request_id for o in outs if o.finished}
    assert finished == set(ids)
    assert e.blocks.num_free_blocks == 20 and not e.scheduler.running and not e.scheduler.waiting
    assert sorted(e.scheduler._free_state_slots) == [0, 1, 2]


def test_max_tokens_stop_tokens_and_eos(llama_dir: Path) -> None:
    e = engine(llama_dir)
    prompt = random_prompts(1, seed=6)[0]
    [full] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    stop_at = full.token_ids[5]
    cut = full.token_ids.index(stop_at) + 1
    [c] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=(stop_at,)))
    assert c.token_ids == full.token_ids[:cut] and c.finish_reason == "stop"
    [c] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert c.token_ids == full.token_ids[:3] and c.finish_reason == "length"
    e.eos_token_ids = frozenset({stop_at})
    [c] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=20))
    assert c.token_ids == full.token_ids[:cut] and c.finish_reason == "stop"
    [c] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert c.token_ids == full.token_ids


def test_max_model_len_ends_with_length(llama_dir: Path) -> None:
    e = engine(llama_dir, max_model_len=12)
    [c] = e.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(c.token_ids) == 2 and c.finish_reason == "length"
    with pytest.raises(InvalidRequest, match="no room"):
        e.add_request([5] * 12)


def test_seeded_sampling_reproducible_and_independent_of_batch(llama_dir: Path) -> None:
    e = engine(llama_dir, num_blocks=40)
    prompt = random_prompts(1, seed=7)[0]
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=123, max_tokens=12, ignore_eos=True)
    [alone] = e.generate([prompt], seeded)
    [again] = e.generate([prompt], seeded)
    assert alone.token_ids == again.token_ids
    others = random_prompts(5, seed=8)
    crowd = e.generate(others[:2] + [prompt] + others[2:],
                       [SamplingParams(max_tokens=9, ignore_eos=True), GREEDY, seeded,
                        SamplingParams(seed=5, max_tokens=14, ignore_eos=True), GREEDY,
                        SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)])
    assert crowd[2].token_ids == alone.token_ids
    [other] = e.generate([prompt], SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=124,
                                                   max_tokens=12, ignore_eos=True))
    assert other.token_ids != alone.token_ids


def test_state_slots_and_fresh_flags_reach_the_model(llama_dir: Path) -> None:
    e = engine(llama_dir, num_blocks=14, max_num_seqs=4, max_batch_tokens=16)
    seen: list[Step] = []
    run = e.executor.run

    def spy(step: Step, hidden: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> object:
        seen.append(step)
        return run(step, hidden, input_ids)

    e.executor.run = spy  # type: ignore[method-assign]
    e.generate(random_prompts(8, seed=9), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert e.stats().num_preemptions > 0 and seen
    for step in seen:
        slots = [s.state_slot for s in step.seqs]
        assert len(set(slots)) == len(slots) and all(s is not None and 0 <= s < 4 for s in slots)
        assert [s.fresh for s in step.seqs] == [s.context_len == s.rows for s in step.seqs]
        assert e.executor.forward_batch(step).state_slots is None  # a Llama has no recurrent state cache


class StubStateModel(torch.nn.Module):
    """A model with Mamba-style recurrent state and no weights that matter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"vocab_size": 8})()

    def state_shapes(self) -> dict[int, MambaStateShape]:
        return {1: MambaStateShape(conv=(6, 3), ssm=(2, 4, 5))}

    def kv_shapes(self) -> dict[int, tuple[int, ...]]:
        return {0: (1, 2)}

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        assert batch.logits_indices is not None
        return ModelOutput(torch.zeros(len(batch.logits_indices), 8))


def test_forward_batch_of_a_scheduled_step() -> None:
    cache = KVCache.allocate({0: (1, 2)}, num_blocks=8, block_size=4, dtype=torch.float32)
    model = StubStateModel()
    state = MambaStateCache.allocate(model.state_shapes(), 4, torch.float32)
    runner = StepExecutor(model, cache, torch.device("cpu"), state_cache=state)
    assert runner.state_cache is not None and runner.state_cache.num_slots == 4
    assert runner.state_cache.ssm[1].shape == (4, 2, 4, 5)
    assert state_bytes_per_slot(StubStateModel().state_shapes(), torch.float32) == (18 + 40) * 4
    batch = ScheduledBatch([
        ScheduledSeq(0, [11, 12, 13, 14, 15], start=0, block_table=[5, 2], num_logits=1, state_slot=3),
        ScheduledSeq(1, [21], start=6, block_table=[1, 7], num_logits=1, state_slot=0),
        ScheduledSeq(2, [31, 32, 33], start=2, block_table=[4, 3], num_logits=0, state_slot=1),
        ScheduledSeq(3, [41, 42, 43], start=3, block_table=[6, 0], num_logits=3, state_slot=2,
                     position_ids=(3, 4, 4)),
    ])
    step = forward_step(batch)
    assert [s.fresh for s in step.seqs] == [True, False, False, False]
    fb = runner.forward_batch(step)
    assert fb.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 31, 32, 33, 41, 42, 43]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 6, 2, 3, 4, 3, 4, 4]
    assert fb.slot_mapping.tolist() == [20, 21, 22, 23, 8, 30, 18, 19, 12, 27, 0, 1]
    assert fb.query_lens == [5, 1, 3, 3] and fb.context_lens == [5, 7, 5, 6]
    assert fb.logits_indices is not None and fb.logits_indices.tolist() == [4, 5, 9, 10, 11]
    assert fb.state_slots == [3, 0, 1, 2] and fb.state_cache is runner.state_cache
    assert fb.attn_masks is None
    assert runner.run(step).logits.shape == (5, 8)


def test_text_prompts_streaming_and_stop_strings(text_llama_dir: Path) -> None:
    e = engine(text_llama_dir, skip_tokenizer=False)
    assert e.tokenizer is not None and e.eos_token_ids == {1}
    tok = e.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "write a loop"}])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [full] = e.generate([prompt], params)
    assert full.text == tok.decode(full.token_ids)
    # Streaming deltas add up to the same text.
    rid = e.add_request(prompt, params)
    streamed = "".join(o.text_delta for o in run_all(e) if o.request_id == rid)
    assert streamed == full.text
    # A stop string that spans a token boundary: the text ends right before it.
    text = full.text
    clean = [len(tok.decode(full.token_ids[:k])) for k in range(1, len(full.token_ids))
             if text.startswith(tok.decode(full.token_ids[:k]))]
    candidates = [(b - 2, text[b - 2:b + 2]) for b in clean
                  if 2 <= b <= len(text) - 2 and "\ufffd" not in text[b - 2:b + 2]
                  and text.find(text[b - 2:b + 2]) == b - 2]
    assert candidates, f"no usable stop string in {text!r}"
    at, stop = candidates[len(candidates) // 2]
    [c] = e.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert c.finish_reason == "stop" and c.text == text[:at]
    assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < len(full.token_ids)
    # Text prompts are encoded by the checkpoint's tokenizer.
    [t] = e.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert t.prompt_token_ids == tok.encode("def f(x):") and len(t.token_ids) == 4


def test_request_and_config_errors(llama_dir: Path, tmp_path: Path) -> None:
    e = engine(llama_dir)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        e.add_request([1, 250])
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        e.add_request("hello")
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        e.add_request([1, 2], SamplingParams(stop=("x",)))
    with pytest.raises(InvalidRequest, match="no tokens"):
        e.add_request([])
    rid = e.add_request([1, 2], request_id="dup")
    with pytest.raises(InvalidRequest, match="already in use"):
        e.add_request([1, 2], request_id="dup")
    with pytest.raises(RuntimeError, match="idle engine"):
        e.generate([[1]])
    e.abort(rid)
    run_all(e)
    with pytest.raises(InvalidRequest):
        e.generate([[1, 2], [1, 999]])
    assert not e.has_unfinished() and e.blocks.num_free_blocks == 64
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        engine(llama_dir, skip_tokenizer=False)
    with pytest.raises(EngineConfigError, match="max_model_len"):
        engine(llama_dir, num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(EngineConfigError):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(EngineConfigError):
        EngineConfig(dtype="int3")
    with pytest.raises(EngineConfigError, match="max_batch_tokens"):
        EngineConfig(max_num_seqs=8, max_batch_tokens=4)
    with pytest.raises(EngineConfigError, match="kv_memory_fraction"):
        EngineConfig(kv_memory_fraction=0.0)


def test_kv_cache_sized_from_a_memory_fraction(llama_dir: Path) -> None:
    e = engine(llama_dir, num_blocks=None, kv_memory_fraction=1e-5)  # ~1e-5 of free host memory
    assert e.blocks.num_blocks >= 2
    [c] = e.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(c.token_ids) == 2


def test_kv_cache_sizing() -> None:
    per_block = kv_bytes_per_block({0: (2, 16), 1: (2, 16)}, block_size=16, dtype=torch.float32)
    assert per_block == 2 * 2 * (16 + 16) * 16 * 4
    assert kv_bytes_per_block({0: (1, 576, 512)}, block_size=1, dtype=torch.bfloat16) == (576 + 512) * 2
    assert num_blocks_for_memory(10 * per_block, 0.5, per_block) == 5


def test_dummy_weights_need_only_a_config(llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")  # no weights at all
    runs = [engine(tmp_path, load_format="dummy", seed=7).generate([[5, 6, 7]], GREEDY)[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == GREEDY.max_tokens  # the same random weights from one seed
    with pytest.raises(EngineConfigError, match="load_format"):
        EngineConfig(load_format="pt")
