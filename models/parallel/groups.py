"""Parallel groups of one engine group, all built once from one rank grid.

An engine group has ``tp`` ranks. Attention runs in ``dp`` data-parallel groups of
``attn_tp = tp // dp`` ranks each; MoE experts are split over ``ep`` ranks and each
expert over ``moe_tp = tp // ep`` ranks. Example, tp=4, dp=2, ep=2:

    rank          0  1  2  3
    dp_rank       0  0  1  1      attn_tp groups: [0,1] [2,3]
    attn_tp_rank  0  1  0  1      dp groups:      [0,2] [1,3]
    moe_ep_rank   0  0  1  1      moe_tp groups:  [0,1] [2,3]
    moe_tp_rank   0  1  0  1      moe_ep groups:  [0,2] [1,3]

``plan_group_ranks`` is the pure rank grid; ``build_groups`` creates the process groups
(every rank must call it, in the same order). Collectives on a size-1 group are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

GROUP_NAMES = ("tp", "attn_tp", "dp", "moe_ep", "moe_tp")


class ParallelConfigError(ValueError):
    """A (tp, dp, ep) combination no deployment could run."""


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.tp % self.dp:
            raise ParallelConfigError(f"data parallelism dp={self.dp} must divide tp={self.tp}")
        if self.tp % self.ep:
            raise ParallelConfigError(f"expert parallelism ep={self.ep} must divide tp={self.tp}")

    @property
    def world(self) -> int:
        return self.tp

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def dp_attention(self) -> bool:
        return self.dp > 1


def plan_group_ranks(config: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of every kind, as lists of global ranks (the rank grid)."""
    tp, attn_tp, moe_tp = config.tp, config.attn_tp, config.moe_tp
    return {
        "tp": [list(range(tp))],
        "attn_tp": [list(range(d * attn_tp, (d + 1) * attn_tp)) for d in range(config.dp)],
        "dp": [list(range(a, tp, attn_tp)) for a in range(attn_tp)],
        "moe_tp": [list(range(e * moe_tp, (e + 1) * moe_tp)) for e in range(config.ep)],
        "moe_ep": [list(range(t, tp, moe_tp)) for t in range(moe_tp)],
    }


@dataclass(frozen=True)
class RankCoordinates:
    rank: int
    tp_rank: int
    dp_rank: int
    attn_tp_rank: int
    moe_ep_rank: int
    moe_tp_rank: int


def rank_coordinates(config: ParallelConfig, rank: int) -> RankCoordinates:
    if not 0 <= rank < config.tp:
        raise ParallelConfigError(f"rank {rank} outside an engine group of {config.tp} ranks")
    return RankCoordinates(
        rank=rank,
        tp_rank=rank,
        dp_rank=rank // config.attn_tp,
        attn_tp_rank=rank % config.attn_tp,
        moe_ep_rank=rank // config.moe_tp,
        moe_tp_rank=rank % config.moe_tp,
    )


@dataclass(frozen=True)
class Group:
    """One communicating group as seen from one rank.

    ``device_group`` carries tensors (NCCL on CUDA, gloo on CPU); ``cpu_group`` carries
    small host-side metadata (always gloo). Both are None for a size-1 group. ``host_all_reduce``: the sum
    through shared memory of a CPU group whose ranks share a host (``host_all_reduce.py``), None elsewhere.
    """

    name: str
    rank: int
    ranks: tuple[int, ...]
    device_group: Any = None
    cpu_group: Any = None
    host_all_reduce: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_trivial(self) -> bool:
        return self.size == 1

    def all_reduce_path(self, device_path: str) -> str:
        """Where ``all_reduce_`` runs: "shm", or the device group's ``device_path`` ("nccl" / "gloo")."""
        return self.host_all_reduce.path if self.host_all_reduce is not None else device_path

    def all_reduce_(self, x: Any) -> Any:
        """x summed over the group's ranks, in place (shared memory where the group has it)."""
        if self.host_all_reduce is not None:
            return self.host_all_reduce(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.device_group)
        return x

    @staticmethod
    def single(name: str) -> Group:
        return Group(name=name, rank=0, ranks=(0,))


@dataclass(frozen=True)
class ParallelGroups:
    config: ParallelConfig
    coords: RankCoordinates
    tp: Group
    attn_tp: Group
    dp: Group
    moe_ep: Group
    moe_tp: Group

    def by_name(self, name: str) -> Group:
        if name not in GROUP_NAMES:
            raise KeyError(f"unknown group {name!r}; known: {', '.join(GROUP_NAMES)}")
        group: Group = getattr(self, name)
        return group

    @staticmethod
    def single_rank() -> ParallelGroups:
        """Groups of a one-rank engine (no process group needed)."""
        config = ParallelConfig()
        return ParallelGroups(
            config=config,
            coords=rank_coordinates(config, 0),
            **{name: Group.single(name) for name in GROUP_NAMES},
        )


def unconnected_groups(config: ParallelConfig, rank: int = 0) -> ParallelGroups:
    """One rank's groups of the grid without process groups: for building a model to check that it
    splits (``models/split_check.py``), never for running collectives."""
    grid = plan_group_ranks(config)
    mine = {name: next(Group(name, ranks.index(rank), tuple(ranks)) for ranks in grid[name] if rank in ranks)
            for name in GROUP_NAMES}
    return ParallelGroups(config=config, coords=rank_coordinates(config, rank), **mine)


def build_groups(config: ParallelConfig, rank: int, device_backend: str) -> ParallelGroups:
    """Create every process group of the grid. Requires an initialised default group.

    Every rank calls this with the same config: ``torch.distributed.new_group`` is
    collective over the default group, so the groups are created in one fixed order. On gloo, each group of
    several ranks then sets up its shared-memory all-reduce (its members only, in the same order).
    """
    import torch.distributed as dist

    from .host_all_reduce import HostAllReduce

    if dist.get_world_size() != config.world:
        raise ParallelConfigError(
            f"torch.distributed world size {dist.get_world_size()} != tp={config.tp}"
        )
    grid = plan_group_ranks(config)
    mine: dict[str, Group] = {}
    for name in GROUP_NAMES:
        for ranks in grid[name]:
            device_group = cpu_group = None
            if len(ranks) > 1:
                device_group = dist.new_group(ranks, backend=device_backend)
                cpu_group = device_group if device_backend == "gloo" else dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine[name] = Group(
                    name=name,
                    rank=ranks.index(rank),
                    ranks=tuple(ranks),
                    device_group=device_group,
                    cpu_group=cpu_group,
                )
    if device_backend == "gloo":
        for name in GROUP_NAMES:
            g = mine[name]
            if not g.is_trivial:
                mine[name] = replace(g, host_all_reduce=HostAllReduce.connect(g.rank, g.size, g.cpu_group, name))
    return ParallelGroups(config=config, coords=rank_coordinates(config, rank), **mine)
