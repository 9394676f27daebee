"""GPU (-m gpu, SM90+): the L2 weight prefetch (``models/layers/l2_prefetch_triton.py``, ``weight_prefetch.py``)
changes nothing it touches, and a captured decode with it gives bit-identical logits to one without it
(the Triton kernel set, bf16, CUDA graphs), its requests inside the graphs.

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_weight_prefetch.py -m gpu``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="needs an SM90+ GPU")
BLOCK = 16


@needs_hopper
def test_prefetch_kernels_change_nothing() -> None:
    from fusedserve.models.layers.l2_prefetch_triton import prefetch_l2, prefetch_l2_lines

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((6144, 4096), (1000, 24), (3, 8)):
        w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        before = w.clone()
        for cap in (0, 100, 16 << 20):
            prefetch_l2(w, cap)
            prefetch_l2(w, cap, sub=4096, evict_last=True)
            prefetch_l2_lines(w, cap)
        torch.cuda.synchronize()
        assert torch.equal(w, before)


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])


@needs_hopper
def test_captured_decode_with_prefetch_equals_without() -> None:
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.layers.weight_prefetch import NO_PREFETCH, WeightPrefetch, no_weight_prefetch
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model
    from fusedserve.worker.executor.executor import StepExecutor
    from fusedserve.worker.executor.step import SeqRows, Step
    from fusedserve.worker.executor.step_shape import StepShape

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
    tables = [(0, 1), (2, 3), (4, 5)]
    issued: list[int] = []
    logits = {}
    for name in ("prefetch", "none"):
        kernels = Kernels.triton()
        if name == "none":
            kernels = dataclasses.replace(kernels, weight_prefetch=no_weight_prefetch)
        else:
            def counted() -> WeightPrefetch:
                real = Kernels.triton().weight_prefetch()
                assert real is not NO_PREFETCH
                return WeightPrefetch(lambda w: (issued.append(1), real._issue(w))[1], real._rejoin, real._active)
            kernels = dataclasses.replace(kernels, weight_prefetch=counted)
        model = random_model(_config(), ParallelGroups.single_rank(), Collectives("nccl"), dtype=torch.bfloat16,
                             device="cuda", seed=3, kernels=kernels)
        kv = KVCache.allocate(model.kv_shapes(), 8, BLOCK, torch.bfloat16, "cuda")
        ex = StepExecutor(model, kv, torch.device("cuda"), model.comm.ledger, reserved_blocks=1, graph_ready=True)
        ex.run(Step(tuple(SeqRows(t, tuple(p), tuple(range(len(p))), len(p), 1) for t, p in zip(tables, prompts))))
        ex.capture([StepShape(1, 1), StepShape(4, 1)], max_blocks=2)
        out = []
        for s in range(4):
            step = Step(tuple(SeqRows(t, (7 + s + i,), (len(p) + s,), len(p) + s + 1)
                              for i, (t, p) in enumerate(zip(tables, prompts))))
            out.append(ex.run(step).logits.float())
        assert ex.graphs is not None and ex.graphs.use_graphs and ex.graphs.runs == 4
        logits[name] = torch.cat(out)
    # each capture of a shape asks for every next weight once: 4 matmuls a layer x 3 layers
    assert issued and len(issued) % (4 * 3) == 0
    assert torch.equal(logits["prefetch"], logits["none"])
