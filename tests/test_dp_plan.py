"""Seed bug 2 (sglang PR #28102): under DP attention + EP an MoE layer's sum is completed by
exactly ONE reduce-scatter after the experts, never by an all-reduce (plus a scatter) there.

Checked on the plans of both MoE architectures for every DP-attention config the issue names,
in both padding modes; the spawned HF-equality tests (test_deepseek_v3, test_nemotron_h) check
that the executed collectives equal these plans.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fusedserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from fusedserve.models.nemotron_h import NemotronHForCausalLM
from fusedserve.models.parallel.comm_plan import ForwardPlan, plan_communication
from fusedserve.models.parallel.dp_geometry import Padding, choose_padding, dp_geometry
from fusedserve.models.parallel.groups import ParallelConfig

DP_CONFIGS = [(2, 2, 1), (2, 2, 2), (4, 2, 1), (4, 4, 4), (4, 2, 2), (4, 4, 2), (8, 8, 8)]

DEEPSEEK = SimpleNamespace(num_hidden_layers=4, first_k_dense_replace=1)
NEMOTRON = SimpleNamespace(hybrid_override_pattern="M*-EMEE", num_hidden_layers=7)


def _moe_exits(plan: ForwardPlan, moe_blocks: list[str]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """For each MoE block, the collectives of the boundary right after it."""
    sites = [b.site for b in plan.boundaries]
    out = []
    for name in moe_blocks:
        after = plan.boundaries[sites.index(f"{name}.in") + 1]
        out.append((after.site, [(s.op, s.group, s.purpose) for s in after.steps]))
    return out


@pytest.mark.parametrize("tp,dp,ep", DP_CONFIGS)
@pytest.mark.parametrize("arch", ["deepseek_v3", "nemotron_h"])
def test_each_moe_layer_is_completed_by_exactly_one_reduce_scatter(arch: str, tp: int, dp: int, ep: int) -> None:
    if arch == "deepseek_v3":
        blocks = DeepseekV3ForCausalLM.blocks(DEEPSEEK)
        moe = [f"layers.{i}.mlp" for i in range(DEEPSEEK.first_k_dense_replace, DEEPSEEK.num_hidden_layers)]
    else:
        blocks = NemotronHForCausalLM.blocks(NEMOTRON)
        moe = [f"layers.{i}.mixer" for i, c in enumerate(NEMOTRON.hybrid_override_pattern) if c == "E"]
    for fusion in (False, True):
        plan = plan_communication(ParallelConfig(tp, dp, ep), blocks, fusion)
        assert plan.fused is None, "no fused all-reduce under DP attention"
        for variant in (plan.unfused, plan.sum_len):
            assert variant is not None
            for site, steps in _moe_exits(variant, moe):
                # What completes the experts' sum: one reduce-scatter over the group they span.
                assert [s for s in steps if s[2] == "complete"] == [("reduce_scatter", "tp", "complete")], site
                # What follows only moves the complete, normed tokens to the next layout; with
                # SUM_LEN padding into a FULL block that is an all-reduce of a zero-filled buffer.
                gathers = [s[:2] for s in steps if s[2] == "gather"]
                assert gathers in ([], [("all_gather", "attn_tp")], [("all_gather", "tp")], [("all_reduce", "tp")])


def test_a_dp_group_without_tokens_still_takes_part() -> None:
    cfg = ParallelConfig(4, 2, 2)
    for padding in Padding:
        geo = dp_geometry(cfg, [5, 0], padding)
        assert len(geo.chunk_rows) == 4
        assert geo.local_sizes(1) == [0, 0]
        assert sum(geo.chunk_sizes) == 5


def test_padding_choice_follows_sglang() -> None:
    assert choose_padding([8, 8, 7, 8]) is Padding.MAX_LEN  # balanced decode: cheap to pad
    assert choose_padding([40, 0]) is Padding.SUM_LEN  # one group idle: padding doubles the work
    geo = dp_geometry(ParallelConfig(4, 2), [3, 1], Padding.MAX_LEN)
    assert geo.chunk_rows == (2, 2, 2, 2) and geo.chunk_sizes == (2, 1, 1, 0)
    assert geo.valid_full_rows() == [True, True, True, False, True, False, False, False]
    geo = dp_geometry(ParallelConfig(4, 2), [3, 1], Padding.SUM_LEN)
    assert geo.chunk_rows == (2, 1, 1, 0) and geo.valid_full_rows() is None


def test_dp_plan_table_tp4_dp2_ep2() -> None:
    plan = plan_communication(ParallelConfig(4, 2, 2), DeepseekV3ForCausalLM.blocks(SimpleNamespace(num_hidden_layers=2)),
                              fusion=True)
    assert plan.unfused.table() == [
        "layers.0.attn.in: reduce_scatter(attn_tp), all_gather(attn_tp)",
        "layers.0.mlp.in: reduce_scatter(attn_tp), all_gather(tp)",
        "layers.1.attn.in: reduce_scatter(tp), all_gather(attn_tp)",
        "layers.1.mlp.in: reduce_scatter(attn_tp), all_gather(tp)",
        "final.in: reduce_scatter(tp), all_gather(attn_tp)",
        "lm_head: all_gather(attn_tp)",
    ]
    assert plan.sum_len is not None
    assert plan.sum_len.table()[1] == "layers.0.mlp.in: reduce_scatter(attn_tp), all_reduce(tp)"
