"""Prefix caching in the engine (CPU, fp32): repeated long system prompts find their blocks, and
greedy outputs are token for token those with caching off — plain, with chunked prefill, under
preemption (a tiny KV cache), under EAGLE3 speculation (chain and tree: the draft's K/V in the
shared blocks is the K/V its own first pass would have written, so it drafts and accepts exactly
as with caching off), at tp=2 and under DP attention (gloo), and on the real SmolLM2.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedserve.tiny import make_tiny_llama, make_tiny_nemotron_h
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.prefix_cache import PrefixCache
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.parallel.local_ranks import run_on_ranks
from fusedserve.worker.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = REPO_ROOT / "examples/checkpoints/tiny-code"
DRAFT = REPO_ROOT / "examples/checkpoints/tiny-code-eagle3"
SYSTEM = ("# Helpers for the service: read the config, talk to the database, format the reply.\n"
          "import os\nimport sys\nimport json\n\n\n")
QUESTIONS = ["def fib(n):\n    ", "class Foo:\n    def __init__(self", "for i in range(10):\n",
             "def load(path):\n    with open(", "    return self._", "def main():\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def shared_prompts(n: int, seed: int, system_len: int = 37) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(system_len)]
    return [system + [3 + i] + [rng.randrange(3, 250) for _ in range(rng.randint(0, 9))] for i in range(n)]


def in_waves(engine: Engine, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    """The first prompt alone, then the others together (they find its blocks)."""
    first = engine.generate(prompts[:1], params)
    return [c.token_ids for c in first + engine.generate(prompts[1:], params)]


@pytest.mark.parametrize("setting", [
    {},
    {"max_batch_tokens": 16, "max_num_seqs": 4},  # chunked prefill
    {"num_blocks": 26, "max_num_seqs": 6, "max_batch_tokens": 32},  # preemption by recompute
], ids=["plain", "chunked", "preemption"])
def test_repeated_system_prompt_hits_and_matches_caching_off(llama_dir: Path, setting: dict[str, int]) -> None:
    prompts = shared_prompts(8, seed=len(setting))
    cfg: dict[str, Any] = {"num_blocks": 96, "block_size": 4, "skip_tokenizer": True, **setting}
    off = Engine(llama_dir, EngineConfig(**cfg, enable_prefix_caching=False))
    on = Engine(llama_dir, EngineConfig(**cfg))
    expected = in_waves(off, prompts, GREEDY)
    assert in_waves(on, prompts, GREEDY) == expected
    s_on, s_off = on.stats(), off.stats()
    assert s_on.prefix_caching and not s_off.prefix_caching
    assert s_off.prefix_cache_queries == 0 and s_off.prefix_cache_hits == 0
    assert s_on.prefix_cache_queries >= sum(map(len, prompts))
    if "num_blocks" in setting:
        assert s_on.num_preemptions > 0, "the cache was meant to force preemption"
        assert s_on.prefix_cache_hits > 0
    else:  # every later prompt finds the 9 full blocks of the system prompt
        assert s_on.prefix_cache_hits >= 36 * (len(prompts) - 1)
    assert s_on.num_free_blocks == s_on.num_blocks and not on.has_unfinished()


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(llama_dir: Path) -> None:
    cfg: dict[str, Any] = {"num_blocks": 32, "block_size": 4, "skip_tokenizer": True}
    prompt = shared_prompts(1, seed=5, system_len=16)[0][:16]  # exactly 4 blocks
    off = Engine(llama_dir, EngineConfig(**cfg, enable_prefix_caching=False))
    on = Engine(llama_dir, EngineConfig(**cfg))
    assert in_waves(on, [prompt, prompt, prompt[:12]], GREEDY) == in_waves(off, [prompt, prompt, prompt[:12]], GREEDY)
    assert on.stats().prefix_cache_hits == 12 + 8  # 3 of the 4 blocks, then 2 of 3


def test_abort_releases_shared_blocks(llama_dir: Path) -> None:
    on = Engine(llama_dir, EngineConfig(num_blocks=32, block_size=4, skip_tokenizer=True))
    prompts = shared_prompts(3, seed=2)
    on.generate(prompts[:1], GREEDY)
    ids = [on.add_request(p, GREEDY) for p in prompts[1:]]
    on.step()
    assert on.stats().prefix_cache_hits == 2 * 36
    for rid in ids:
        assert on.abort(rid)
    on.step()
    assert on.stats().num_free_blocks == 32 and not on.has_unfinished()


@pytest.mark.parametrize("spec", [SpeculativeConfig(str(DRAFT), num_steps=3),
                                  SpeculativeConfig(str(DRAFT), num_steps=4, topk=4, num_draft_tokens=8)],
                         ids=["chain", "tree"])
def test_speculation_drafts_and_accepts_as_with_caching_off(spec: SpeculativeConfig) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    cfg: dict[str, Any] = {"num_blocks": 160, "block_size": 4, "speculative": spec}
    off = Engine(TARGET, EngineConfig(**cfg, enable_prefix_caching=False))
    on = Engine(TARGET, EngineConfig(**cfg))
    assert len(on.tokenizer.encode(SYSTEM)) >= 16  # type: ignore[union-attr]
    expected = in_waves(off, prompts, GREEDY)
    assert in_waves(on, prompts, GREEDY) == expected
    s_on, s_off = on.stats(), off.stats()
    assert s_on.prefix_cache_hits > 0
    # The draft read the shared blocks' draft K/V: it proposed and accepted exactly what it did
    # when it computed that K/V itself.
    assert s_on.spec is not None and s_off.spec is not None
    assert (s_on.spec.drafts, s_on.spec.accepted_tokens, s_on.spec.accepted_per_position) == \
        (s_off.spec.drafts, s_off.spec.accepted_tokens, s_off.spec.accepted_per_position)
    assert s_on.num_free_blocks == s_on.num_blocks
    # Under a tiny cache and budget (chunked prefill, preemption) too.
    small = {**cfg, "num_blocks": 40, "max_batch_tokens": 16, "max_num_seqs": 4}
    tiny = Engine(TARGET, EngineConfig(**small))
    assert in_waves(tiny, prompts, GREEDY) == expected
    assert tiny.stats().num_preemptions > 0 and tiny.stats().prefix_cache_hits > 0


def draft_kv_after_first_draft(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The draft's K/V of every prompt position once each prompt's first draft ran (prefill, then
    one verify step): [positions, layers * 2 * heads * head_dim] per prompt; then aborts them."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    assert engine.speculator is not None
    cache = engine.speculator.draft.kv_cache
    bs = engine.blocks.block_size
    by_request = {s.request_id: s for s in engine.scheduler.running}
    out = []
    for rid, prompt in zip(ids, prompts):
        table = engine.blocks.table(by_request[rid].seq_id)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(prompt))])
        out.append(torch.cat([t[slots].flatten(1) for layer in sorted(cache.k) for t in (cache.k[layer],
                                                                                       cache.v[layer])], dim=1))
        engine.abort(rid)
    engine.step()
    return out


@pytest.mark.parametrize("next_token_in_key", [True, False])
def test_a_hit_reads_the_draft_kv_its_own_first_pass_would_write(next_token_in_key: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot b of the draft's cache holds token b + 1 read with the target's aux state at b, so a
    block's last slot depends on the token after the block. Prompts that part right after a block:
    with that token in the block's key (the engine's choice under speculation) the block is not
    shared and every slot a later prompt reads equals what it computes alone; keyed by the block's
    own tokens only (forced here), the block is shared and its last slot is the other prompt's."""
    spec = SpeculativeConfig(str(DRAFT), num_steps=3)
    cfg: dict[str, Any] = {"num_blocks": 160, "block_size": 4, "speculative": spec}
    if not next_token_in_key:
        monkeypatch.setattr("fusedserve.worker.engine.engine.prefix_cache_for",
                            lambda config, recurrent: PrefixCache(config.block_size))
    on = Engine(TARGET, EngineConfig(**cfg))
    tok = on.tokenizer
    assert tok is not None
    system = tok.encode(SYSTEM)
    system = system[: len(system) // 4 * 4]  # a whole number of blocks
    # prompts that part right after the system prompt (one per first token)
    prompts = list({p[len(system)]: p for p in (system + tok.encode(q) for q in QUESTIONS)}.values())
    assert len(prompts) >= 3
    on.generate(prompts[:1], GREEDY)
    shared = draft_kv_after_first_draft(on, prompts[1:])
    hits = on.stats().prefix_cache_hits
    alone = Engine(TARGET, EngineConfig(**cfg, enable_prefix_caching=False))
    for prompt, got in zip(prompts[1:], shared):
        [want] = draft_kv_after_first_draft(alone, [prompt])
        wrong = [p for p in range(len(prompt)) if not torch.allclose(got[p], want[p], atol=1e-4, rtol=1e-4)]
        assert wrong == ([] if next_token_in_key else [len(system) - 1])
    assert hits == (len(system) - (4 if next_token_in_key else 0)) * (len(prompts) - 1)


def test_hybrid_mamba_models_run_without_prefix_caching(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_tiny_nemotron_h(tmp_path / "nemotron")
    prompts = shared_prompts(3, seed=7, system_len=20)
    with caplog.at_level(logging.INFO, logger="fusedserve.worker.engine.engine"):
        engine = Engine(model, EngineConfig(num_blocks=48, block_size=4, skip_tokenizer=True))
    assert sum("prefix caching is off" in r.getMessage() for r in caplog.records) == 1
    off = Engine(model, EngineConfig(num_blocks=48, block_size=4, skip_tokenizer=True, enable_prefix_caching=False))
    assert in_waves(engine, prompts, GREEDY) == in_waves(off, prompts, GREEDY)
    stats = engine.stats()
    assert not stats.prefix_caching and stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == 0


# --- tp=2 (gloo) ------------------------------------------------------------------------------


def _tp2(rank: int, world: int, backend: str, model: str, prompts: list[list[int]]) -> dict[str, Any] | None:
    from fusedserve.worker.parallel.rank import run_engine_group

    out: dict[str, Any] = {}
    for caching in (True, False):
        cfg = EngineConfig(num_blocks=64, block_size=4, skip_tokenizer=True, enable_prefix_caching=caching)
        out[str(caching)] = run_engine_group(
            rank, world, backend, model, cfg,
            lambda engine: (in_waves(engine, prompts, GREEDY), engine.stats().prefix_cache_hits), fusion="reference")
    return out if rank == 0 else None


def test_tp2_with_caching_matches_tp1_without(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "llama", seed=6, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    prompts = shared_prompts(5, seed=9)
    tp1 = in_waves(Engine(model, EngineConfig(num_blocks=64, block_size=4, skip_tokenizer=True,
                                              enable_prefix_caching=False)), prompts, GREEDY)
    tp2 = run_on_ranks(_tp2, 2, str(model), prompts, timeout_s=300.0)[0]
    assert tp2["True"][0] == tp1 and tp2["False"][0] == tp1
    assert tp2["True"][1] >= 36 * 4 and tp2["False"][1] == 0


def _dp_rank(rank: int, world: int, backend: str, model: str, caching: bool) -> dict[str, Any]:
    """tp=2 dp=2 ep=2: each DP leader caches in its own blocks; a warm request, then three sharing its prefix."""
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.parallel.rank import build_rank, lead_engine, leads

    groups = build_groups(ParallelConfig(2, 2, 2), rank, backend)
    config = EngineConfig(num_blocks=48, block_size=4, max_num_seqs=4, max_batch_tokens=64, skip_tokenizer=True,
                          enable_prefix_caching=caching)
    built = build_rank(model, config, groups, backend)
    assert leads(groups)  # attn_tp = 1: every rank leads its DP group
    engine, _ = lead_engine(built, model, config)
    prompts = shared_prompts(4, seed=10 + groups.coords.dp_rank)  # another system prompt per DP group
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens: dict[str, list[int]] = {engine.add_request(prompts[0], params): []}
    for i in range(60):  # every step is one round on both DP leaders: the same number of steps on each
        if i == 15:
            tokens.update({engine.add_request(p, params): [] for p in prompts[1:]})
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    stats = engine.stats()
    return {"tokens": tokens, "hits": stats.prefix_cache_hits, "free": stats.num_free_blocks == stats.num_blocks}


def test_dp_attention_groups_cache_in_their_own_blocks(tmp_path: Path) -> None:
    from fusedserve.tiny import make_tiny_deepseek_v3

    model = str(make_tiny_deepseek_v3(tmp_path / "ds"))
    on = run_on_ranks(_dp_rank, 2, model, True, backend="gloo", timeout_s=300)
    off = run_on_ranks(_dp_rank, 2, model, False, backend="gloo", timeout_s=300)
    for r_on, r_off in zip(on, off):
        assert r_on["tokens"] == r_off["tokens"] and all(len(t) == 6 for t in r_on["tokens"].values())
        assert r_on["hits"] >= 3 * 36 and r_off["hits"] == 0
        assert r_on["free"] and r_off["free"]


# --- the real SmolLM2 (the `smollm2` fixture: the machine's cached conversion) ---------------------


def test_smollm2_chat_with_a_long_system_prompt(smollm2: Path) -> None:
    system = ("You are a careful assistant for a small bakery. Answer in one short sentence, name prices in "
              "euros, never invent opening hours, and say when you do not know. ") * 3
    prompts = [f"{system}\nQuestion: {q}\nAnswer:" for q in
               ("What is a croissant?", "Do you sell rye bread?", "How much is a baguette?")]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    cfg: dict[str, Any] = {"num_blocks": 64, "block_size": 16}
    off = Engine(smollm2, EngineConfig(**cfg, enable_prefix_caching=False))
    on = Engine(smollm2, EngineConfig(**cfg))
    assert in_waves(on, prompts, params) == in_waves(off, prompts, params)
    assert on.stats().prefix_cache_hits >= 2 * 64
