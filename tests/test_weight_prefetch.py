"""The L2 weight prefetch's schedule (``models/layers/weight_prefetch.py``) on CPU: a Llama forward asks,
after each matmul, for exactly the weight of the next one (qkv -> o -> gate_up -> down -> the next layer's
qkv, the LM head last) and ends joined; prefetching changes no logit; off (the reference set, or not
capturing) it asks for nothing. The prefetch kernel itself runs in tests/test_gpu_weight_prefetch.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fusedserve.models.forward_batch import KVCache
from fusedserve.models.layers.kernels import Kernels
from fusedserve.models.layers.weight_prefetch import NO_PREFETCH, WeightPrefetch
from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.groups import ParallelGroups
from fusedserve.models.random_init import random_model
from fusedserve.worker.executor.executor import StepExecutor
from fusedserve.worker.executor.step import SeqRows, Step

BLOCK = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 2]]
TABLES = [(0, 1, 2), (3, 4)]


class Recorder:
    def __init__(self, active: bool = True) -> None:
        self.events: list[Any] = []
        self.active = active

    def prefetch(self) -> WeightPrefetch:
        return WeightPrefetch(lambda w: self.events.append(w), lambda: self.events.append("join"),
                              lambda: self.active)


def _config(tied: bool = False) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                       architectures=["LlamaForCausalLM"])


def _run(kernels: Kernels, tied: bool = False) -> tuple[Any, torch.Tensor]:
    model = random_model(_config(tied), ParallelGroups.single_rank(), Collectives("gloo"), seed=5, kernels=kernels)
    kv = KVCache.allocate(model.kv_shapes(), 6, BLOCK, torch.float32)
    ex = StepExecutor(model, kv, torch.device("cpu"), model.comm.ledger, reserved_blocks=1, graph_ready=False)
    step = Step(tuple(SeqRows(t, tuple(p), tuple(range(len(p))), len(p), 1) for t, p in zip(TABLES, PROMPTS)))
    return model, ex.run(step).logits


def test_each_matmul_is_followed_by_the_next_weight() -> None:
    for tied in (False, True):
        rec = Recorder()
        model, logits = _run(dataclasses.replace(Kernels.reference(), weight_prefetch=rec.prefetch), tied)
        want: list[Any] = []
        for layer in model.layers:
            want += [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
            nxt = layer.layer_id + 1
            want.append(model.layers[nxt].self_attn.qkv_proj.weight if nxt < len(model.layers)
                        else model.lm_head.weight)
        want.append("join")
        assert len(rec.events) == len(want)
        for got, w in zip(rec.events, want):
            assert got is w if isinstance(w, torch.Tensor) else got == w
        if tied:
            assert rec.events[-2] is model.embed_tokens.weight
        _, plain = _run(Kernels.reference(), tied)
        assert torch.equal(logits, plain)


def test_inactive_or_reference_asks_for_nothing() -> None:
    rec = Recorder(active=False)
    _run(dataclasses.replace(Kernels.reference(), weight_prefetch=rec.prefetch))
    assert rec.events == []
    assert Kernels.reference().weight_prefetch() is NO_PREFETCH
    assert Kernels.torch_native().weight_prefetch() is NO_PREFETCH


def test_no_gpu_no_prefetch() -> None:
    from fusedserve.models.layers.weight_prefetch import l2_weight_prefetch

    if not torch.cuda.is_available():
        assert l2_weight_prefetch() is NO_PREFETCH
