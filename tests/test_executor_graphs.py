"""The executor's graph path on CPU: padded static-shape forwards (``executor/step_graphs.py``) equal
the eager forward, padding rows write only the pad slot, the kernel sets agree, and the ledger
counts a replayed forward exactly as its capture planned and recorded it.

On CPU the captured forwards run eagerly on the same static buffers; CUDA-graph capture itself is
tested on a GPU (tests/test_gpu_decode.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fusedserve.models.forward_batch import KVCache
from fusedserve.models.layers.kernels import Kernels
from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.groups import ParallelGroups
from fusedserve.models.parallel.ledger import CapturedForward, CollectiveLedger, CollectiveRecord
from fusedserve.models.random_init import random_model
from fusedserve.worker.executor.executor import StepExecutor
from fusedserve.worker.executor.step import SeqRows, Step
from fusedserve.worker.executor.step_shape import StepShape

BLOCK = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]]
TABLES = [(0, 1, 2), (3, 4, 5), (6, 7, 8, 9)]  # room to decode; block 10 (last) is the pad block


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])


def _executor(kernels: Kernels, graph_ready: bool) -> StepExecutor:
    model = random_model(_config(), ParallelGroups.single_rank(), Collectives("gloo"), seed=11, kernels=kernels)
    kv = KVCache.allocate(model.kv_shapes(), 11, BLOCK, torch.float32)
    return StepExecutor(model, kv, torch.device("cpu"), model.comm.ledger, reserved_blocks=1,
                        graph_ready=graph_ready)


def _prefill() -> Step:
    return Step(tuple(SeqRows(t, tuple(p), tuple(range(len(p))), len(p), 1) for t, p in zip(TABLES, PROMPTS)))


def _decode(step: int, seqs: int = 3) -> Step:
    return Step(tuple(SeqRows(t, (7 + step + i,), (len(p) + step,), len(p) + step + 1)
                      for i, (t, p) in enumerate(zip(TABLES[:seqs], PROMPTS[:seqs]))))


def test_torch_kernel_set_equals_reference() -> None:
    logits = {}
    for kernels in (Kernels.reference(), Kernels.torch_native()):
        ex = _executor(kernels, graph_ready=False)
        ex.run(_prefill())
        logits[kernels.name] = torch.cat([ex.run(_decode(s)).logits for s in range(3)])
    assert torch.allclose(logits["torch"], logits["reference"], atol=1e-5)


def test_padded_replays_equal_the_eager_forward() -> None:
    """3 sequences run at the captured size 4: the padding row writes only the pad slot."""
    ref = _executor(Kernels.reference(), graph_ready=False)
    fast = _executor(Kernels.torch_native(), graph_ready=True)
    ref.run(_prefill())
    fast.run(_prefill())
    fast.capture([StepShape(1, 1), StepShape(4, 1), StepShape(8, 1)], max_blocks=6)
    graphs = fast.graphs
    assert graphs is not None and not graphs.use_graphs and graphs.pad_slot == 11 * BLOCK - 1
    assert fast.graph_shape(_decode(0)) == StepShape(4, 1)
    assert fast.graph_shape(_prefill()) is None  # a prefill runs eagerly
    for step in range(3):
        want = ref.run(_decode(step)).logits
        got = fast.run(_decode(step)).logits
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), step
    assert graphs.runs == 3
    real = [s for t in TABLES for b in t for s in range(b * BLOCK, (b + 1) * BLOCK)]
    for layer in fast.kv_cache.k:
        assert torch.allclose(fast.kv_cache.k[layer][real], ref.kv_cache.k[layer][real], atol=1e-6)
    # a smaller step after a larger one: stale rows of the static buffers are padded again
    assert torch.allclose(fast.run(_decode(3, seqs=1)).logits, ref.run(_decode(3, seqs=1)).logits, atol=1e-5)


def test_what_cannot_be_captured_is_refused() -> None:
    model = _executor(Kernels.reference(), False).model
    with pytest.raises(ValueError, match="reserved cache block"):
        StepExecutor(model, KVCache.allocate({0: (2, 16)}, 4, BLOCK, torch.float32), torch.device("cpu"),
                     graph_ready=True)
    with pytest.raises(ValueError, match="not built for CUDA graphs"):
        _executor(Kernels.reference(), graph_ready=False).capture([StepShape(1, 1)], 2)
    ex = _executor(Kernels.torch_native(), graph_ready=True)
    ex.capture([StepShape(1, 1), StepShape(2, 1)], max_blocks=2)
    assert ex.graph_shape(_decode(0)) is None  # 3 sequences: larger than any captured batch
    with pytest.raises(ValueError, match="exceeds the captured"):
        ex.run(Step((SeqRows(TABLES[2], (1,), (14,), 15),)))  # 4 blocks > 2 captured


def test_ledger_counts_planned_and_executed_and_replays_a_capture() -> None:
    ledger = CollectiveLedger()
    ledger.begin_forward([("layers.0.attn.in", "all_reduce", "tp")])
    ledger.record("layers.0.attn.in", "all_reduce", "tp", "nccl", 64)
    with ledger.capture() as captured:
        ledger.begin_forward([("layers.0.mlp.in", "fused_ar_add_rmsnorm", "tp"), ("lm_head", "all_gather", "tp")])
        ledger.record("layers.0.mlp.in", "fused_ar_add_rmsnorm", "tp", "flashinfer_fused", 128)
        ledger.record("lm_head", "all_gather", "tp", "nccl", 256)
    assert ledger.forwards == 1 and sum(ledger.calls.values()) == 1  # the capture ran nothing
    assert captured == CapturedForward(
        [("layers.0.mlp.in", "fused_ar_add_rmsnorm", "tp"), ("lm_head", "all_gather", "tp")],
        [CollectiveRecord("layers.0.mlp.in", "fused_ar_add_rmsnorm", "tp", "flashinfer_fused", 128),
         CollectiveRecord("lm_head", "all_gather", "tp", "nccl", 256)])
    for _ in range(3):
        ledger.replay(captured)
    assert ledger.forwards == 4
    assert ledger.forward_records() == captured.records and ledger.forward_plan() == captured.planned
    assert ledger.calls[("fused_ar_add_rmsnorm", "tp", "flashinfer_fused")] == 3
    assert ledger.bytes[("all_gather", "tp", "nccl")] == 3 * 256
    assert ledger.calls[("all_reduce", "tp", "nccl")] == 1
    assert ledger.planned == {("all_reduce", "tp"): 1, ("fused_ar_add_rmsnorm", "tp"): 3, ("all_gather", "tp"): 3}
