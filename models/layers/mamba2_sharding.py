"""How a Mamba2 mixer's heads and B/C groups split over a TP group, and the layers that load so.

The fused input projection's output rows (and the conv channels, its middle part) are, in
the checkpoint::

    in_proj:  [ z (heads*hd) | x (heads*hd) | B (groups*N) | C (groups*N) | dt (heads) ]
    conv1d:             [ x (heads*hd) | B (groups*N) | C (groups*N) ]

Rank r of a group of ``size`` ranks holds heads [r*heads/size, (r+1)*heads/size) of z, x and
dt and the B/C groups those heads read. When groups >= size the groups split evenly; when
size > groups every group is replicated on size/groups consecutive ranks (as vLLM and
sglang do). Example, 8 heads, 2 groups, 4 ranks: rank 1 holds heads 2-3 and group 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.groups import Group
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim


@dataclass(frozen=True)
class Mamba2Sharding:
    num_heads: int  # global
    head_dim: int
    n_groups: int  # global B/C groups
    state_size: int
    size: int  # ranks in the group
    rank: int

    def __post_init__(self) -> None:
        if self.num_heads % self.size:
            raise WeightShapeError(f"mamba_num_heads={self.num_heads} does not split over {self.size} ranks")
        if self.num_heads % self.n_groups:
            raise WeightShapeError(f"mamba_num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")
        if self.n_groups % self.size and self.size % self.n_groups:
            raise WeightShapeError(
                f"n_groups={self.n_groups} neither splits over nor evenly replicates on {self.size} ranks")

    @property
    def heads(self) -> int:
        return self.num_heads // self.size

    @property
    def head_start(self) -> int:
        return self.rank * self.heads

    @property
    def groups(self) -> int:
        return max(1, self.n_groups // self.size)

    @property
    def group_start(self) -> int:
        if self.n_groups >= self.size:
            return self.rank * self.groups
        return self.rank // (self.size // self.n_groups)

    @property
    def inner(self) -> int:
        """This rank's share of intermediate = heads * head_dim."""
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_size

    @property
    def in_proj_rows(self) -> int:
        return 2 * self.inner + 2 * self.groups * self.state_size + self.heads

    def conv_segments(self) -> list[tuple[int, int]]:
        """(checkpoint row, rows) of this rank's conv channels, in local order (x, B, C)."""
        inner_all = self.num_heads * self.head_dim
        bc_all, n = self.n_groups * self.state_size, self.state_size
        return [
            (self.head_start * self.head_dim, self.inner),
            (inner_all + self.group_start * n, self.groups * n),
            (inner_all + bc_all + self.group_start * n, self.groups * n),
        ]

    def in_proj_segments(self) -> list[tuple[int, int]]:
        """(checkpoint row, rows) of this rank's in_proj rows, in local order (z, x, B, C, dt)."""
        inner_all = self.num_heads * self.head_dim
        conv_all = inner_all + 2 * self.n_groups * self.state_size
        z = (self.head_start * self.head_dim, self.inner)
        xbc = [(inner_all + start, rows) for start, rows in self.conv_segments()]
        dt = (inner_all + conv_all + self.head_start, self.heads)
        return [z, *xbc, dt]

    @staticmethod
    def for_group(num_heads: int, head_dim: int, n_groups: int, state_size: int, group: Group) -> Mamba2Sharding:
        return Mamba2Sharding(num_heads, head_dim, n_groups, state_size, group.size, group.rank)


def load_segments(param: torch.Tensor, source: WeightSource, segments: list[tuple[int, int]],
                  total_rows: int) -> None:
    """Copy checkpoint rows ``segments`` (dim 0) into consecutive rows of ``param``."""
    expect_dim(source, 0, total_rows)
    offset = 0
    for start, rows in segments:
        copy_checked(param.narrow(0, offset, rows), source.narrow(0, start, rows), source.name)
        offset += rows
    if offset != param.shape[0]:
        raise WeightShapeError(f"{source.name}: segments fill {offset} of {param.shape[0]} rows")


class Mamba2InProj(nn.Module):
    """Column-parallel fused projection hidden -> (z, x, B, C, dt) for this rank's heads."""

    def __init__(self, hidden: int, sharding: Mamba2Sharding, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.sharding = sharding
        rows = sharding.in_proj_rows
        self.weight = nn.Parameter(torch.empty((rows, hidden), dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        s = self.sharding
        total = 2 * s.num_heads * s.head_dim + 2 * s.n_groups * s.state_size + s.num_heads
        load_segments(param, source, s.in_proj_segments(), total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, in_proj_rows]
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Mamba2Conv1d(nn.Module):
    """Depthwise causal conv over this rank's x, B, C channels (weights as nn.Conv1d stores them)."""

    def __init__(self, sharding: Mamba2Sharding, kernel: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.sharding = sharding
        self.kernel = kernel
        channels = sharding.conv_channels
        self.weight = nn.Parameter(torch.empty((channels, 1, kernel), dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        s = self.sharding
        load_segments(param, source, s.conv_segments(), s.num_heads * s.head_dim + 2 * s.n_groups * s.state_size)

    def prefill(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One sequence; ``state`` (the previous kernel-1 inputs) is updated in place.
        x: [L, channels]; state: [channels, kernel-1] -> [L, channels] (before the activation)"""
        window = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [channels, kernel-1+L]
        state.copy_(window[:, window.shape[1] - state.shape[1]:])
        out = torch.nn.functional.conv1d(window[None], self.weight, self.bias, groups=window.shape[0])
        return out[0].t()

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of S sequences; returns the new states instead of writing them.
        x: [S, channels]; state: [S, channels, kernel-1] -> ([S, channels], new state)"""
        window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [S, channels, kernel]
        out = (window * self.weight[:, 0]).sum(-1)
        if self.bias is not None:
            out = out + self.bias
        return out, window[..., 1:]
