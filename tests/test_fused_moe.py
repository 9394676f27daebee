"""The routed experts' block computation (models/layers/fused_moe.py) equals the per-expert loop.

``moe_align`` puts every pair routed to this rank in exactly one row of a block of its own
expert; ``fused_experts_torch`` (the capturable torch twin of the Triton kernels) gives the
loop's sums; a DeepSeek-V3 model built with the graph-safe torch kernel set gives the reference
set's logits, through prefill and decode, and its decode forward replays in the (eager on CPU)
graph runner.
"""

from __future__ import annotations

import pytest
import torch

from fusedserve.models.layers.experts import RoutedExperts
from fusedserve.models.layers.fused_moe import fused_experts_torch, max_blocks, moe_align
from fusedserve.models.parallel.groups import Group


def _group(name: str, rank: int, size: int) -> Group:
    return Group(name, rank, tuple(range(size)))


@pytest.mark.parametrize("n,k,experts,block_m", [(1, 8, 128, 16), (5, 3, 4, 2), (64, 8, 16, 16), (7, 2, 3, 4)])
def test_moe_align_places_every_local_pair_once_in_a_block_of_its_expert(n: int, k: int, experts: int,
                                                                          block_m: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    ids = torch.randint(-1, experts, (n, k), generator=g)
    blk = moe_align(ids, experts, block_m)
    pairs = n * k
    assert blk.max_blocks == max_blocks(pairs, experts, block_m)
    rows = blk.sorted_pairs.view(blk.max_blocks, block_m)
    flat = ids.reshape(-1)
    seen = []
    for b in range(blk.max_blocks):
        e = int(blk.block_expert[b])
        real = [int(p) for p in rows[b] if p < pairs]
        if e < 0:
            assert not real  # an unused block holds padding only
            continue
        assert real and all(int(flat[p]) == e for p in real)
        seen += real
    assert sorted(seen) == [p for p in range(pairs) if flat[p] >= 0]
    used = blk.block_expert[blk.block_expert >= 0]
    assert torch.equal(used, used.sort().values)  # used blocks first, in expert order
    assert (blk.block_expert[len(used):] == -1).all()


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_fused_experts_torch_equals_the_per_expert_loop(ep_rank: int) -> None:
    torch.manual_seed(ep_rank)
    experts = RoutedExperts(8, 32, 24, _group("moe_ep", ep_rank, 2), _group("moe_tp", 0, 1))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(9)])
    ids[2, 1] = -1  # a padding row's slot
    w = torch.rand(9, 3)
    want = experts(x, ids, w)
    mine = (ids >= experts.first) & (ids < experts.first + experts.num_local)
    got = fused_experts_torch(x, torch.where(mine, ids - experts.first, -1), w, experts.gate_up_proj,
                              experts.down_proj)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    experts.fused = fused_experts_torch  # the construction-time choice, as Kernels.torch_native() makes it
    torch.testing.assert_close(experts(x, ids, w), want, atol=1e-5, rtol=1e-5)
    assert not experts(torch.zeros(0, 32), ids[:0], w[:0]).numel()


def test_deepseek_v3_graph_safe_torch_kernels_equal_the_reference() -> None:
    from moe_blocks import copy_weights_folding_shared
    from transformers import DeepseekV3Config

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model
    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS
    from fusedserve.worker.executor.executor import StepExecutor
    from fusedserve.worker.executor.step import SeqRows, Step
    from fusedserve.worker.executor.step_shape import StepShape

    config = DeepseekV3Config(**{**DEEPSEEK_V3_DEFAULTS, "architectures": ["DeepseekV3ForCausalLM"]})
    logits = {}
    ref: torch.nn.Module | None = None
    for name in ("reference", "torch"):
        model = random_model(config, ParallelGroups.single_rank(), Collectives("gloo"), seed=3,
                             kernels=Kernels.named(name))
        if name == "torch":
            assert model.layers[1].mlp.experts.fused is fused_experts_torch
            assert model.layers[1].mlp.shared_experts is None  # folded: expert E of the fused computation
            assert copy_weights_folding_shared(model, ref) == 2 * (config.num_hidden_layers - 1)
        else:
            ref = model
        with torch.no_grad():  # spread the router so choices are clear-cut
            for layer in model.layers[1:]:
                layer.mlp.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(layer.layer_id))
        kv = KVCache.allocate(model.kv_shapes(), 9, 4, torch.float32)
        out = [model(ForwardBatch.prefill([[3, 1, 4, 1, 5, 9], [2, 6, 5]], kv)).logits]
        step = ForwardBatch(torch.tensor([2, 7]), torch.tensor([6, 3]), [1, 1], [7, 4], torch.tensor([6, 11]),
                            [[0, 1], [2]], kv)
        out.append(model(step).logits)
        if name == "torch":  # the decode forward as a graph replays it (static padded buffers; block 8 pads)
            ex = StepExecutor(model, kv, torch.device("cpu"), model.comm.ledger, reserved_blocks=1,
                              graph_ready=True)
            ex.capture([StepShape(1, 1), StepShape(4, 1)], max_blocks=2)
            step2 = Step((SeqRows((0, 1), (8,), (7,), 8), SeqRows((2, 3), (1,), (4,), 5)))
            assert ex.graph_shape(step2) == StepShape(4, 1)
            out.append(ex.run(step2).logits.clone())
        else:
            out.append(model(ForwardBatch(torch.tensor([8, 1]), torch.tensor([7, 4]), [1, 1], [8, 5],
                                          torch.tensor([7, 12]), [[0, 1], [2, 3]], kv)).logits)
        logits[name] = out
    for got, want in zip(logits["torch"], logits["reference"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernel_sets_choose_the_experts_path() -> None:
    from fusedserve.models.layers.kernels import Kernels

    assert Kernels.reference().fused_moe is None
    assert Kernels.torch_native().fused_moe is fused_experts_torch
