"""Seed bug 1 (sglang PR #28343): EAGLE3 aux states must be the complete residual stream.

With tp=2 and the reference fused all-reduce + add + RMSNorm, each MLP sum is deferred into the
next layer's input norm. The communicator captures the residual *after* that completion, so the
aux states equal tp=1's. Capturing ``hidden + residual`` before the deferred reduction (the
original bug) gives each rank its own partial sum instead.
"""

from __future__ import annotations

import torch

from fusedserve.models.eagle3 import aux_layers
from fusedserve.worker.parallel.local_ranks import run_on_ranks

PROMPTS = [[5, 9, 17, 3, 44, 8, 100], [7, 7, 1], [200, 13]]
NUM_LAYERS = 8


def _capture(rank: int, world: int, backend: str, model_dir: str, fusion: bool) -> dict[str, torch.Tensor]:
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.loader import load_model
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.communicator import Communicator
    from fusedserve.models.parallel.fusion.reference import ReferenceFusedAllReduceNorm
    from fusedserve.models.parallel.groups import ParallelConfig, ParallelGroups, build_groups
    from fusedserve.models.parallel.layouts import Unreduced

    groups = build_groups(ParallelConfig(world), rank, backend) if world > 1 else ParallelGroups.single_rank()
    model = load_model(model_dir, groups, Collectives("gloo", fused=ReferenceFusedAllReduceNorm() if fusion else None))
    layers = aux_layers(NUM_LAYERS)

    # What the buggy capture would have read: hidden + residual before layer i's input boundary.
    buggy: list[torch.Tensor] = []
    boundary = Communicator.boundary

    def spy(self, ctx, index, incoming, residual, norm):  # type: ignore[no-untyped-def]
        if index % 2 == 0 and index // 2 in layers and residual is not None and isinstance(incoming, Unreduced):
            buggy.append(incoming.partial + residual)
        return boundary(self, ctx, index, incoming, residual, norm)

    Communicator.boundary = spy  # type: ignore[method-assign]
    kv = KVCache.allocate(model.kv_shapes(), 8, 4, torch.float32)
    batch = ForwardBatch.prefill(PROMPTS, kv)
    batch.aux_layers = tuple(layers)
    out = model(batch)
    Communicator.boundary = boundary  # type: ignore[method-assign]
    executed = [r.key for r in model.comm.ledger.forward_records()]
    return {
        "aux": torch.cat(out.hidden, dim=-1),
        "buggy": torch.cat(buggy, dim=-1),
        "deferred": torch.tensor([k[1] == "fused_ar_add_rmsnorm" and k[0] == "layers.2.attn.in" for k in executed]).any(),
        "plan_ok": torch.tensor(executed == model.comm.ledger.forward_plan()),
    }


def test_aux_capture_is_complete_under_deferred_reduction(tmp_path_factory) -> None:
    from fusedserve.tiny import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path_factory.mktemp("eagle3-capture"), num_hidden_layers=NUM_LAYERS))
    single = _capture(0, 1, "gloo", model_dir, False)
    ranks = run_on_ranks(_capture, 2, model_dir, True)
    assert aux_layers(NUM_LAYERS) == [2, 4, 5]
    for r in ranks:
        assert bool(r["deferred"]), "fusion reference must defer layer 1's MLP sum into layer 2's input"
        assert bool(r["plan_ok"])
        assert r["aux"].shape == single["aux"].shape == (12, 3 * 64)
        assert torch.allclose(r["aux"], single["aux"], atol=1e-5, rtol=0)
        # The pre-#28343 capture: per-rank partial sums, far from the complete stream.
        wrong = float((r["buggy"] - single["aux"]).abs().max())
        right = float((r["aux"] - single["aux"]).abs().max())
        assert wrong > 1e-3 and wrong > 1000 * right
    assert not torch.allclose(ranks[0]["buggy"], ranks[1]["buggy"], atol=1e-3)


def test_aux_layer_ids_follow_sglang_offset_rule() -> None:
    class Cfg:
        eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}

    class Cfg0:
        eagle_config = {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}

    assert aux_layers(61) == [2, 30, 58]
    assert aux_layers(61, Cfg()) == [2, 30, 58]
    assert aux_layers(61, Cfg0()) == [2, 30, 58]
