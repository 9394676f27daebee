"""The decode runner's static buffers and padding, the kernel sets, and ledger replay (CPU).

On CPU the runner runs its padded, static-buffer forward eagerly (no CUDA graphs); the graph
capture itself is tested on a GPU (tests/test_gpu_decode.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fusedserve.models.forward_batch import ForwardBatch, KVCache
from fusedserve.models.layers.kernels import Kernels
from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.groups import ParallelGroups
from fusedserve.models.parallel.ledger import CollectiveLedger, CollectiveRecord
from fusedserve.models.random_init import random_model
from fusedserve.worker.cuda_graph_runner import CudaGraphRunner

BLOCK = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]]


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])


def _model(kernels: Kernels) -> Any:
    return random_model(_config(), ParallelGroups.single_rank(), Collectives("gloo"), False, seed=11,
                        kernels=kernels)


def _tables() -> list[list[int]]:
    return [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]  # room to decode; block 10 (last) is the pad block


def _prefilled(model: Any) -> KVCache:
    kv = KVCache.allocate(model.kv_shapes(), 11, BLOCK, torch.float32)
    tables = _tables()
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, pr in zip(tables, PROMPTS) for p in range(len(pr))]
    model(ForwardBatch(torch.tensor([x for p in PROMPTS for x in p]),
                       torch.tensor([i for p in PROMPTS for i in range(len(p))]), [len(p) for p in PROMPTS],
                       [len(p) for p in PROMPTS], torch.tensor(slots), tables, kv))
    return kv


def _decode_batch(kv: KVCache, step: int) -> ForwardBatch:
    tables = _tables()
    pos = [len(p) + step for p in PROMPTS]
    return ForwardBatch(torch.tensor([7 + step, 8, 9]), torch.tensor(pos), [1, 1, 1], [p + 1 for p in pos],
                        torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, pos)]), tables, kv)


def test_torch_kernel_set_equals_reference() -> None:
    logits = {}
    for kernels in (Kernels.reference(), Kernels.torch_native()):
        model = _model(kernels)
        kv = _prefilled(model)
        logits[kernels.name] = torch.cat([model(_decode_batch(kv, s)) for s in range(3)])
    assert torch.allclose(logits["torch"], logits["reference"], atol=1e-5)


def test_runner_pads_and_equals_the_plain_forward() -> None:
    """3 sequences run at the captured size 4: the padding row writes only the pad slot."""
    ref = _model(Kernels.reference())
    fast = _model(Kernels.torch_native())
    ref_kv, kv = _prefilled(ref), _prefilled(fast)
    runner = CudaGraphRunner(fast, kv, max_blocks_per_seq=6, batch_sizes=(1, 4, 8))
    assert not runner.use_graphs and runner.padded_size(3) == 4 and runner.pad_slot == 11 * BLOCK - 1
    for step in range(3):
        want = ref(_decode_batch(ref_kv, step))
        got = runner.run_batch(_decode_batch(kv, step))
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), step
    real = [s for t in _tables() for b in t for s in range(b * BLOCK, (b + 1) * BLOCK)]
    for layer in kv.k:
        assert torch.allclose(kv.k[layer][real], ref_kv.k[layer][real], atol=1e-6)  # same K/V in real slots
    # a smaller step after a larger one: stale rows of the static buffers are padded again
    got = runner.run(torch.tensor([1]), torch.tensor([10]), torch.tensor([10]),
                     torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([11], dtype=torch.int32))
    want = ref(ForwardBatch(torch.tensor([1]), torch.tensor([10]), [1], [11], torch.tensor([10]), [[0, 1, 2]],
                            ref_kv))
    assert torch.allclose(got, want, atol=1e-5)


def test_runner_refuses_what_it_cannot_capture() -> None:
    model = _model(Kernels.reference())
    kv = KVCache.allocate(model.kv_shapes(), 4, BLOCK, torch.float32)
    with pytest.raises(ValueError, match="graph-safe"):
        CudaGraphRunner(model, kv, max_blocks_per_seq=2)
    runner = CudaGraphRunner(_model(Kernels.torch_native()), kv, max_blocks_per_seq=2, batch_sizes=(1, 2))
    with pytest.raises(ValueError, match="exceed"):
        runner.run(*(torch.zeros(3, dtype=torch.long),) * 3, torch.zeros((3, 1), dtype=torch.int32),
                   torch.ones(3, dtype=torch.int32))
    assert runner.planned(2) == []  # one rank: no collectives


def test_ledger_replay_counts_a_captured_forward_again() -> None:
    ledger = CollectiveLedger()
    ledger.begin_forward()
    ledger.record("layers.0.attn.in", "all_reduce", "tp", "nccl", 64)
    captured = [CollectiveRecord("layers.0.mlp.in", "fused_ar_add_rmsnorm", "tp", "flashinfer_fused", 128),
                CollectiveRecord("lm_head", "all_gather", "tp", "nccl", 256)]
    for _ in range(3):
        ledger.replay(captured)
    assert ledger.forwards == 4
    assert ledger.forward_records() == captured
    assert ledger.calls[("fused_ar_add_rmsnorm", "tp", "flashinfer_fused")] == 3
    assert ledger.bytes[("all_gather", "tp", "nccl")] == 3 * 256
    assert ledger.calls[("all_reduce", "tp", "nccl")] == 1
