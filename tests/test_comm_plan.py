"""The communication plan as a pure value, per configuration, for a 2-layer Llama; the ledger; and
the communicator refusing what the plan did not predict."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedserve.models.llama import LlamaForCausalLM
from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.comm_plan import (
    FUSION_MAX_TOKENS,
    BoundaryKind,
    CommPlan,
    plan_communication,
)
from fusedserve.models.parallel.communicator import Communicator, PlanViolation
from fusedserve.models.parallel.groups import ParallelConfig, ParallelGroups
from fusedserve.models.parallel.layouts import Layout, Unreduced
from fusedserve.models.parallel.ledger import CollectiveLedger

BLOCKS = LlamaForCausalLM.blocks(SimpleNamespace(num_hidden_layers=2))

UNFUSED_TABLE = [
    "layers.0.attn.in: all_reduce(tp)",  # the vocab-parallel embedding's sum
    "layers.0.mlp.in: all_reduce(attn_tp)",
    "layers.1.attn.in: all_reduce(tp)",
    "layers.1.mlp.in: all_reduce(attn_tp)",
    "final.in: all_reduce(tp)",
    "lm_head: all_gather(tp)",
]
FUSED_TABLE = [
    "layers.0.attn.in: all_reduce(tp)",  # nothing to fuse with: no residual yet
    "layers.0.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "layers.1.attn.in: fused_ar_add_rmsnorm(tp)",  # layer 0's MLP sum, deferred into layer 1's input
    "layers.1.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
    "final.in: all_reduce(tp)",  # the final norm never fuses
    "lm_head: all_gather(tp)",
]
UNFUSED_EXPECTED = [
    ("layers.0.attn.in", "all_reduce", "tp"),
    ("layers.0.mlp.in", "all_reduce", "attn_tp"),
    ("layers.1.attn.in", "all_reduce", "tp"),
    ("layers.1.mlp.in", "all_reduce", "attn_tp"),
    ("final.in", "all_reduce", "tp"),
    ("lm_head", "all_gather", "tp"),
]
FUSED_EXPECTED = [
    ("layers.0.attn.in", "all_reduce", "tp"),
    ("layers.0.mlp.in", "fused_ar_add_rmsnorm", "attn_tp"),
    ("layers.1.attn.in", "fused_ar_add_rmsnorm", "tp"),
    ("layers.1.mlp.in", "fused_ar_add_rmsnorm", "attn_tp"),
    ("final.in", "all_reduce", "tp"),
    ("lm_head", "all_gather", "tp"),
]


def plan(tp: int, fusion: bool) -> CommPlan:
    return plan_communication(ParallelConfig(tp=tp), BLOCKS, fusion)


def test_llama_blocks() -> None:
    assert [(b.name, b.layout, b.owes) for b in BLOCKS] == [
        ("layers.0.attn", Layout.ATTN_TP_FULL, "attn_tp"),
        ("layers.0.mlp", Layout.FULL, "tp"),
        ("layers.1.attn", Layout.ATTN_TP_FULL, "attn_tp"),
        ("layers.1.mlp", Layout.FULL, "tp"),
    ]


@pytest.mark.parametrize("fusion", [False, True], ids=["fusion-off", "fusion-on"])
@pytest.mark.parametrize("tokens", [0, 1, 7, FUSION_MAX_TOKENS, FUSION_MAX_TOKENS + 1])
def test_tp1_has_no_collectives(fusion: bool, tokens: int) -> None:
    p = plan(1, fusion)
    assert p.fused is None  # fusion needs tp > 1
    selected = p.select(tokens)
    assert selected is p.unfused
    assert selected.table() == []
    assert selected.expected() == []
    assert [b.site for b in selected.boundaries] == [
        "layers.0.attn.in",
        "layers.0.mlp.in",
        "layers.1.attn.in",
        "layers.1.mlp.in",
        "final.in",
    ]
    assert [b.kind for b in selected.boundaries] == [BoundaryKind.FIRST] + [
        BoundaryKind.ALL_REDUCE_ADD_NORM
    ] * 4
    # Even without collectives each boundary names the group the incoming sum is owed to.
    assert [b.owed for b in selected.boundaries] == ["tp", "attn_tp", "tp", "attn_tp", "tp"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tokens", [0, 1, 7, FUSION_MAX_TOKENS, FUSION_MAX_TOKENS + 1, 100_000])
def test_fusion_off(tp: int, tokens: int) -> None:
    p = plan(tp, False)
    assert p.fused is None
    assert p.select(tokens) is p.unfused
    assert p.select(tokens).table() == UNFUSED_TABLE
    assert p.select(tokens).expected() == UNFUSED_EXPECTED


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tokens", [1, 2, 7, 512, FUSION_MAX_TOKENS])
def test_fusion_on_defers_the_mlp_all_reduce_into_the_next_input_norm(tp: int, tokens: int) -> None:
    p = plan(tp, True)
    selected = p.select(tokens)
    assert selected is p.fused and selected.fused
    assert selected.table() == FUSED_TABLE
    assert selected.expected() == FUSED_EXPECTED
    assert [b.kind for b in selected.boundaries] == [
        BoundaryKind.FIRST,
        BoundaryKind.FUSED_AR_ADD_NORM,
        BoundaryKind.FUSED_AR_ADD_NORM,
        BoundaryKind.FUSED_AR_ADD_NORM,
        BoundaryKind.ALL_REDUCE_ADD_NORM,
    ]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tokens", [0, FUSION_MAX_TOKENS + 1, 4096])
def test_fusion_on_outside_the_token_gate_selects_the_unfused_variant(tp: int, tokens: int) -> None:
    p = plan(tp, True)
    assert p.select(tokens) is p.unfused
    assert p.select(tokens).table() == UNFUSED_TABLE
    assert p.select(tokens).expected() == UNFUSED_EXPECTED


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fusion", [False, True])
def test_final_boundary_never_fuses(tp: int, fusion: bool) -> None:
    p = plan(tp, fusion)
    for variant in (p.unfused, p.fused):
        if variant is not None:
            final = variant.boundaries[-1]
            assert final.site == "final.in" and final.kind is not BoundaryKind.FUSED_AR_ADD_NORM


def test_single_layer_model_under_fusion_fuses_only_the_post_attention_norm() -> None:
    p = plan_communication(
        ParallelConfig(tp=2), LlamaForCausalLM.blocks(SimpleNamespace(num_hidden_layers=1)), True
    )
    assert p.select(3).table() == [
        "layers.0.attn.in: all_reduce(tp)",
        "layers.0.mlp.in: fused_ar_add_rmsnorm(attn_tp)",
        "final.in: all_reduce(tp)",
        "lm_head: all_gather(tp)",
    ]


def test_a_model_needs_blocks() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        plan_communication(ParallelConfig(tp=2), [], False)


def test_plan_is_a_pure_value() -> None:
    assert plan(2, True) == plan(2, True)
    assert plan(2, True) != plan(2, False)
    assert hash(plan(4, True).fused) == hash(plan(4, True).fused)


# --- the ledger ---------------------------------------------------------------------------------


def test_ledger_counts_calls_and_bytes_and_keeps_one_forward() -> None:
    ledger = CollectiveLedger()
    ledger.begin_forward()
    ledger.record("layers.0.attn.in", "all_reduce", "tp", "gloo", 100)
    ledger.record("lm_head", "all_gather", "tp", "gloo", 40)
    ledger.begin_forward()
    ledger.record("layers.0.attn.in", "all_reduce", "tp", "gloo", 100)
    assert [r.key for r in ledger.forward_records()] == [("layers.0.attn.in", "all_reduce", "tp")]
    assert ledger.forwards == 2
    assert ledger.totals() == [("all_gather", "tp", "gloo", 1, 40), ("all_reduce", "tp", "gloo", 2, 200)]


# --- the communicator refuses what the plan did not predict (tp=1: no process group needed) ------


def _communicator(fusion: bool = False) -> Communicator:
    groups = ParallelGroups.single_rank()
    return Communicator(plan_communication(groups.config, BLOCKS, fusion), groups, Collectives("gloo"))


NORM = SimpleNamespace(weight=torch.ones(4), eps=1e-6)


def test_boundary_refuses_an_already_reduced_plain_tensor() -> None:
    comm = _communicator()
    ctx = comm.begin_forward(3)
    _, residual = ctx.boundary(0, Unreduced(torch.randn(3, 4), "tp"), None, NORM)
    with pytest.raises(
        PlanViolation,
        match=r"layers\.0\.mlp\.in: expected a sum owed to group 'attn_tp', "
        r"got an already-reduced Tensor",
    ):
        ctx.boundary(1, torch.randn(3, 4), residual, NORM)  # type: ignore[arg-type]


@pytest.mark.parametrize("wrong", ["tp", "moe_ep", "dp"])
def test_boundary_refuses_a_sum_owed_to_the_wrong_group(wrong: str) -> None:
    comm = _communicator()
    ctx = comm.begin_forward(3)
    _, residual = ctx.boundary(0, Unreduced(torch.randn(3, 4), "tp"), None, NORM)
    with pytest.raises(
        PlanViolation, match=f"layers.0.mlp.in: incoming sum is owed to '{wrong}', plan says 'attn_tp'"
    ):
        ctx.boundary(1, Unreduced(torch.randn(3, 4), wrong), residual, NORM)


def test_boundary_residual_rules() -> None:
    comm = _communicator()
    ctx = comm.begin_forward(3)
    x = torch.randn(3, 4)
    with pytest.raises(PlanViolation, match="the first boundary takes no residual"):
        ctx.boundary(0, Unreduced(x, "tp"), x, NORM)
    with pytest.raises(PlanViolation, match="layers.1.attn.in: missing residual"):
        ctx.boundary(2, Unreduced(x, "tp"), None, NORM)


def test_boundary_completes_add_and_norm_with_a_fresh_residual() -> None:
    comm = _communicator()
    ctx = comm.begin_forward(3)
    x, residual = torch.randn(3, 4), torch.randn(3, 4)
    before = residual.clone()
    normed, new_residual = ctx.boundary(1, Unreduced(x, "attn_tp"), residual, NORM)
    expected = x + before
    torch.testing.assert_close(new_residual, expected)
    torch.testing.assert_close(normed, expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert new_residual.data_ptr() != residual.data_ptr()
    torch.testing.assert_close(residual, before)  # the caller's residual is not modified
