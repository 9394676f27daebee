"""The rank grid (pure) and the process groups built from it (gloo, 4 ranks)."""

from __future__ import annotations

import pytest
import torch

from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.groups import (
    GROUP_NAMES,
    Group,
    ParallelConfig,
    ParallelConfigError,
    ParallelGroups,
    RankCoordinates,
    plan_group_ranks,
    rank_coordinates,
)

# (tp, dp, ep) -> every group of every kind, as lists of global ranks.
GRIDS: dict[tuple[int, int, int], dict[str, list[list[int]]]] = {
    (1, 1, 1): {
        "tp": [[0]],
        "attn_tp": [[0]],
        "dp": [[0]],
        "moe_tp": [[0]],
        "moe_ep": [[0]],
    },
    (2, 1, 1): {
        "tp": [[0, 1]],
        "attn_tp": [[0, 1]],
        "dp": [[0], [1]],
        "moe_tp": [[0, 1]],
        "moe_ep": [[0], [1]],
    },
    (4, 1, 1): {
        "tp": [[0, 1, 2, 3]],
        "attn_tp": [[0, 1, 2, 3]],
        "dp": [[0], [1], [2], [3]],
        "moe_tp": [[0, 1, 2, 3]],
        "moe_ep": [[0], [1], [2], [3]],
    },
    (4, 2, 1): {
        "tp": [[0, 1, 2, 3]],
        "attn_tp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "moe_tp": [[0, 1, 2, 3]],
        "moe_ep": [[0], [1], [2], [3]],
    },
    (4, 4, 4): {
        "tp": [[0, 1, 2, 3]],
        "attn_tp": [[0], [1], [2], [3]],
        "dp": [[0, 1, 2, 3]],
        "moe_tp": [[0], [1], [2], [3]],
        "moe_ep": [[0, 1, 2, 3]],
    },
    (2, 1, 2): {
        "tp": [[0, 1]],
        "attn_tp": [[0, 1]],
        "dp": [[0], [1]],
        "moe_tp": [[0], [1]],
        "moe_ep": [[0, 1]],
    },
    (4, 2, 2): {
        "tp": [[0, 1, 2, 3]],
        "attn_tp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "moe_tp": [[0, 1], [2, 3]],
        "moe_ep": [[0, 2], [1, 3]],
    },
}


@pytest.mark.parametrize("tp_dp_ep", list(GRIDS), ids=lambda c: "tp{}-dp{}-ep{}".format(*c))
def test_plan_group_ranks(tp_dp_ep: tuple[int, int, int]) -> None:
    grid = plan_group_ranks(ParallelConfig(*tp_dp_ep))
    assert grid == GRIDS[tp_dp_ep]
    assert set(grid) == set(GROUP_NAMES)


@pytest.mark.parametrize("tp_dp_ep", list(GRIDS), ids=lambda c: "tp{}-dp{}-ep{}".format(*c))
def test_every_kind_partitions_the_ranks(tp_dp_ep: tuple[int, int, int]) -> None:
    config = ParallelConfig(*tp_dp_ep)
    sizes = {
        "tp": config.tp,
        "attn_tp": config.attn_tp,
        "dp": config.dp,
        "moe_tp": config.moe_tp,
        "moe_ep": config.ep,
    }
    for name, groups in plan_group_ranks(config).items():
        assert sorted(r for g in groups for r in g) == list(range(config.tp)), name
        assert {len(g) for g in groups} == {sizes[name]}, name


def test_parallel_config_derived_sizes() -> None:
    c = ParallelConfig(tp=4, dp=2, ep=2)
    assert (c.world, c.attn_tp, c.moe_tp, c.dp_attention) == (4, 2, 2, True)
    assert ParallelConfig(tp=4).dp_attention is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 4, "dp": 3}, "data parallelism dp=3 must divide tp=4"),
        ({"tp": 2, "dp": 4}, "data parallelism dp=4 must divide tp=2"),
        ({"tp": 4, "ep": 3}, "expert parallelism ep=3 must divide tp=4"),
        ({"tp": 6, "dp": 2, "ep": 4}, "expert parallelism ep=4 must divide tp=6"),
        ({"tp": 0}, "tp must be a positive integer, got 0"),
        ({"tp": 2, "dp": -1}, "dp must be a positive integer, got -1"),
        ({"tp": 2.0}, "tp must be a positive integer, got 2.0"),
    ],
)
def test_parallel_config_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ParallelConfigError) as e:
        ParallelConfig(**kwargs)  # type: ignore[arg-type]
    assert str(e.value) == message


def test_rank_coordinates_tp4_dp2_ep2() -> None:
    # The table in groups.py's docstring.
    config = ParallelConfig(4, 2, 2)
    rows = [rank_coordinates(config, r) for r in range(4)]
    assert rows == [
        RankCoordinates(rank=0, tp_rank=0, dp_rank=0, attn_tp_rank=0, moe_ep_rank=0, moe_tp_rank=0),
        RankCoordinates(rank=1, tp_rank=1, dp_rank=0, attn_tp_rank=1, moe_ep_rank=0, moe_tp_rank=1),
        RankCoordinates(rank=2, tp_rank=2, dp_rank=1, attn_tp_rank=0, moe_ep_rank=1, moe_tp_rank=0),
        RankCoordinates(rank=3, tp_rank=3, dp_rank=1, attn_tp_rank=1, moe_ep_rank=1, moe_tp_rank=1),
    ]


@pytest.mark.parametrize("tp_dp_ep", list(GRIDS), ids=lambda c: "tp{}-dp{}-ep{}".format(*c))
def test_rank_coordinates_agree_with_the_grid(tp_dp_ep: tuple[int, int, int]) -> None:
    """A rank's coordinate on each axis is its index in the group of that kind holding it."""
    config = ParallelConfig(*tp_dp_ep)
    grid = plan_group_ranks(config)
    for rank in range(config.tp):
        c = rank_coordinates(config, rank)
        (attn,) = [g for g in grid["attn_tp"] if rank in g]
        (dp,) = [g for g in grid["dp"] if rank in g]
        (moe_tp,) = [g for g in grid["moe_tp"] if rank in g]
        (moe_ep,) = [g for g in grid["moe_ep"] if rank in g]
        assert c.tp_rank == rank
        assert c.attn_tp_rank == attn.index(rank)
        assert c.dp_rank == dp.index(rank) == grid["attn_tp"].index(attn)
        assert c.moe_tp_rank == moe_tp.index(rank)
        assert c.moe_ep_rank == moe_ep.index(rank) == grid["moe_tp"].index(moe_tp)


def test_rank_coordinates_rejects_rank_outside_group() -> None:
    with pytest.raises(ParallelConfigError, match="rank 4 outside an engine group of 4 ranks"):
        rank_coordinates(ParallelConfig(4), 4)
    with pytest.raises(ParallelConfigError, match="rank -1 outside"):
        rank_coordinates(ParallelConfig(4), -1)


def test_single_rank_groups_and_by_name() -> None:
    groups = ParallelGroups.single_rank()
    for name in GROUP_NAMES:
        g = groups.by_name(name)
        assert (g.name, g.rank, g.ranks, g.size, g.is_trivial) == (name, 0, (0,), 1, True)
        assert g.device_group is None and g.cpu_group is None
    with pytest.raises(KeyError, match="unknown group 'pp'"):
        groups.by_name("pp")


def test_collectives_on_a_size_one_group_are_uncounted_no_ops() -> None:
    c = Collectives("gloo")
    g = Group.single("tp")
    x = torch.arange(6.0).reshape(3, 2)
    assert c.all_reduce(x, g, "s") is x
    assert c.all_gather(x, g, "s", dim=-1) is x
    assert c.reduce_scatter(x, g, "s") is x
    assert c.all_to_all(x, g, "s") is x
    assert c.broadcast(x, g, "s") is x
    assert c.ledger.forward_records() == [] and c.ledger.totals() == []


# --- build_groups on 4 gloo ranks ---------------------------------------------------------------


def _build_groups_rank(rank: int, world: int, backend: str) -> dict[str, object]:
    from fusedserve.models.parallel.groups import build_groups

    torch.set_num_threads(1)
    groups = build_groups(ParallelConfig(4, 2, 2), rank, backend)
    collectives = Collectives(backend)
    out: dict[str, object] = {"coords": groups.coords}
    for name in GROUP_NAMES:
        g = groups.by_name(name)
        # Sum of (global rank + 1) over the group: tells which ranks the device group really holds.
        summed = collectives.all_reduce(torch.tensor([float(rank + 1)]), g, f"test.{name}")
        gathered = collectives.all_gather(torch.tensor([rank]), g, f"test.{name}")
        out[name] = (
            g.rank,
            g.ranks,
            g.device_group is not None,
            g.cpu_group is g.device_group,
            float(summed),
            gathered.tolist(),
        )
    out["ledger"] = [r.key for r in collectives.ledger.forward_records()]
    return out


def test_build_groups_on_four_gloo_ranks() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    results = run_on_ranks(_build_groups_rank, 4, backend="gloo")
    grid = GRIDS[(4, 2, 2)]
    for rank, res in enumerate(results):
        assert res["coords"] == rank_coordinates(ParallelConfig(4, 2, 2), rank)
        for name in GROUP_NAMES:
            (ranks,) = [g for g in grid[name] if rank in g]
            assert res[name] == (
                ranks.index(rank),
                tuple(ranks),
                True,
                True,
                float(sum(r + 1 for r in ranks)),
                ranks,
            ), (rank, name)
        # Every group of (4, 2, 2) has 2+ ranks, so every call is counted, all_reduce then all_gather.
        assert res["ledger"] == [
            (f"test.{n}", op, n) for n in GROUP_NAMES for op in ("all_reduce", "all_gather")
        ]
