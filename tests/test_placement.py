"""The placement planner (pure): bundles, strategy, names, slices, and why a group stays pending."""

from __future__ import annotations

import pytest

from fusedserve.worker.ray.placement import (
    LOCAL_GPU_RESOURCE,
    ClusterShape,
    PlacementError,
    explain_unschedulable,
    group_name,
    lowest_free_index,
    node_slices,
    parse_group_index,
    plan_group,
    rank_actor_name,
)


def test_local_group_is_one_cpu_and_fake_gpu_bundle_per_rank_strictly_packed() -> None:
    plan = plan_group("default", "tiny-code", 0, ranks=2, cluster=ClusterShape.local(4))
    assert plan.name == "fusedserve/default/tiny-code/0"
    assert plan.bundles == ({"CPU": 0.25, LOCAL_GPU_RESOURCE: 1.0},) * 2
    assert plan.strategy == "STRICT_PACK" and plan.lifetime == "detached"
    assert plan.slices == ((0, 1),)
    assert plan.needs() == {"CPU": 0.5, LOCAL_GPU_RESOURCE: 2.0}


def test_gpu_group_asks_one_gpu_per_rank() -> None:
    plan = plan_group("prod", "llama", 3, ranks=8, cluster=ClusterShape("GPU", 8))
    assert plan.name == "fusedserve/prod/llama/3"
    assert all(b == {"GPU": 1.0, "CPU": 1.0} for b in plan.bundles) and plan.ranks == 8


def test_group_larger_than_a_node_is_refused_with_the_reason() -> None:
    with pytest.raises(PlacementError, match="groups larger than a node come later"):
        plan_group("default", "big", 0, ranks=16, cluster=ClusterShape("GPU", 8), attn_tp=8)
    with pytest.raises(PlacementError, match="attention tensor-parallel groups of 16 ranks would straddle"):
        plan_group("default", "big", 0, ranks=16, cluster=ClusterShape("GPU", 8))
    with pytest.raises(PlacementError, match="at least one rank"):
        plan_group("default", "none", 0, ranks=0, cluster=ClusterShape("GPU", 8))


def test_a_cluster_without_the_ranks_resource_is_refused_with_how_to_start_it() -> None:
    """`fusedserve run --ray-address` of a cluster started by a plain `ray start`: no GPUs, no fake_gpu (was a
    ZeroDivisionError in node_slices)."""
    for cluster, what in ((ClusterShape.local(0), f"the '{LOCAL_GPU_RESOURCE}' resource"), (ClusterShape("GPU", 0), "GPUs")):
        with pytest.raises(PlacementError, match=f"no node of the Ray cluster has {what}.*ray start --resources"):
            plan_group("default", "cpu", 0, ranks=1, cluster=cluster)
    with pytest.raises(PlacementError, match="hold no rank"):
        node_slices(1, 0)


def test_node_slices_are_whole_nodes() -> None:
    assert node_slices(4, 8) == ((0, 1, 2, 3),)
    assert node_slices(16, 8, attn_tp=4) == (tuple(range(8)), tuple(range(8, 16)))  # DP groups inside nodes
    with pytest.raises(PlacementError, match="whole number"):
        node_slices(12, 8, attn_tp=4)
    with pytest.raises(PlacementError, match="would straddle"):
        node_slices(16, 8)  # without DP attention the 16-rank attention-TP group would span two nodes


def test_names_round_trip_and_replacements_take_the_lowest_free_index() -> None:
    name = group_name("ns", "dep", 7)
    assert parse_group_index(name, "ns", "dep") == 7
    assert parse_group_index(name, "ns", "other") is None
    assert parse_group_index("fusedserve/ns/dep/7/rank0", "ns", "dep") is None
    assert parse_group_index("fusedserve/ns/dep-2/1", "ns", "dep") is None
    assert rank_actor_name(name, 1) == "fusedserve/ns/dep/7/rank1"
    assert lowest_free_index([]) == 0
    assert lowest_free_index([0, 1, 3]) == 2
    assert lowest_free_index([1]) == 0


def test_unschedulable_reasons_name_the_resource() -> None:
    plan = plan_group("default", "x", 0, ranks=2, cluster=ClusterShape.local(8))
    node = {"CPU": 2.0, LOCAL_GPU_RESOURCE: 1.0}
    assert explain_unschedulable(plan, [node], node) == "needs 2 fake_gpu, cluster has 1"
    # enough in total, but not on one node: STRICT_PACK cannot place it
    two = [{"CPU": 2.0, LOCAL_GPU_RESOURCE: 1.0}] * 2
    assert explain_unschedulable(plan, two, {"CPU": 4.0, LOCAL_GPU_RESOURCE: 2.0}) == \
        "needs 2 fake_gpu on one node (STRICT_PACK), the largest node has 1"
    # fits, but other groups hold the resources now
    big = {"CPU": 2.0, LOCAL_GPU_RESOURCE: 4.0}
    assert explain_unschedulable(plan, [big], {"CPU": 2.0, LOCAL_GPU_RESOURCE: 1.0}) == \
        "needs 2 fake_gpu, 1 free (other groups hold the rest)"
    gpu = plan_group("default", "x", 0, ranks=4, cluster=ClusterShape("GPU", 8))
    assert explain_unschedulable(gpu, [{"CPU": 16.0}], {"CPU": 16.0}) == "needs 4 GPU, cluster has 0"
