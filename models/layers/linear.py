"""Tensor-parallel linear layers. Each owns its sharding, including how it loads weights.

A row-parallel layer returns this rank's addend of the output; it never reduces. The block
that uses it wraps the result in ``Unreduced`` and the communicator completes the sum.

Every layer multiplies through ``self.matmul`` (``F.linear``, the reference, unless a model
chose a kernel at construction with ``use_matmul``, e.g. ``linear_triton.linear_triton``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim

# (x [n, in], weight [out, in], bias [out] | None) -> [n, out]
MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def use_matmul(module: nn.Module, matmul: MatmulFn) -> None:
    """Make every layer under ``module`` that multiplies through ``matmul`` use this one."""
    for m in module.modules():
        if hasattr(m, "matmul"):
            m.matmul = matmul  # type: ignore[assignment]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise WeightShapeError(f"{what}={total} does not split over {parts} ranks")
    return total // parts


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.matmul: MatmulFn = F.linear

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        copy_checked(param, source.full(), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out]
        return self.matmul(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over the group: rank r holds rows [r*out/size, (r+1)*out/size)."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.group = group
        self.out_per_rank = _split(out_features, group.size, "output features")
        self.weight = _param((self.out_per_rank, in_features), dtype, device)
        self.bias = _param((self.out_per_rank,), dtype, device) if bias else None
        self.matmul: MatmulFn = F.linear

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        rows = param.shape[0]
        expect_dim(source, 0, rows * self.group.size)
        copy_checked(param, source.narrow(0, self.group.rank * rows, rows), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out/size]
        return self.matmul(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up); shard_id = index."""

    def __init__(self, in_features: int, out_sizes: list[int], group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, sum(out_sizes), group, bias, dtype, device)
        self.out_sizes_per_rank = [_split(s, group.size, "merged output") for s in out_sizes]

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise TypeError("MergedColumnParallelLinear loads one part at a time (shard_id = index)")
        rows = self.out_sizes_per_rank[shard_id]
        offset = sum(self.out_sizes_per_rank[:shard_id])
        expect_dim(source, 0, rows * self.group.size)
        copy_checked(param.narrow(0, offset, rows), source.narrow(0, self.group.rank * rows, rows), source.name)


class QKVParallelLinear(nn.Module):
    """Fused q, k, v projections; query heads split over the group.

    When the group has more ranks than there are KV heads, each KV head is replicated on
    ``size / num_kv_heads`` consecutive ranks (as vLLM and sglang do).
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, group: Group,
                 bias: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        size = group.size
        if num_heads % size:
            raise WeightShapeError(f"num_attention_heads={num_heads} does not split over {size} ranks")
        if num_kv_heads >= size:
            if num_kv_heads % size:
                raise WeightShapeError(f"num_key_value_heads={num_kv_heads} does not split over {size} ranks")
            self.kv_heads = num_kv_heads // size
            self.kv_head_start = group.rank * self.kv_heads
        else:
            if size % num_kv_heads:
                raise WeightShapeError(
                    f"{size} ranks cannot share num_key_value_heads={num_kv_heads} evenly"
                )
            self.kv_heads = 1
            self.kv_head_start = group.rank // (size // num_kv_heads)
        self.group = group
        self.head_dim = head_dim
        self.q_heads = num_heads // size
        self.q_size = self.q_heads * head_dim
        self.kv_size = self.kv_heads * head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        out = self.q_size + 2 * self.kv_size
        self.weight = _param((out, hidden), dtype, device)
        self.bias = _param((out,), dtype, device) if bias else None
        self.matmul: MatmulFn = F.linear

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        hd = self.head_dim
        if shard_id == "q":
            expect_dim(source, 0, self.num_heads * hd)
            dst, src = param.narrow(0, 0, self.q_size), source.narrow(0, self.group.rank * self.q_size, self.q_size)
        elif shard_id in ("k", "v"):
            expect_dim(source, 0, self.num_kv_heads * hd)
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            dst = param.narrow(0, offset, self.kv_size)
            src = source.narrow(0, self.kv_head_start * hd, self.kv_size)
        else:
            raise TypeError(f"QKVParallelLinear shard_id must be q, k or v, not {shard_id!r}")
        copy_checked(dst, src, source.name)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [n, hidden] -> q [n, q_heads*hd], k, v [n, kv_heads*hd]
        qkv = self.matmul(x, self.weight, self.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(nn.Module):
    """Input features split over the group; returns this rank's addend (bias on rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.group = group
        self.in_per_rank = _split(in_features, group.size, "input features")
        self.weight = _param((out_features, self.in_per_rank), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.matmul: MatmulFn = F.linear

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: replicated in the checkpoint
            copy_checked(param, source.full(), source.name)
            return
        cols = param.shape[1]
        expect_dim(source, 1, cols * self.group.size)
        copy_checked(param, source.narrow(1, self.group.rank * cols, cols), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in/size] -> partial [n, out]
        bias = self.bias if self.group.rank == 0 else None
        return self.matmul(x, self.weight, bias)


def default_weight_loader(param: torch.Tensor, source: WeightSource, shard_id: object = None) -> None:
    copy_checked(param, source.full(), source.name)
