"""Tensor-parallel linear layers. Each owns its sharding, including how it loads weights.

A row-parallel layer returns this rank's addend of the output; it never reduces. The block
that uses it wraps the result in ``Unreduced`` and the communicator completes the sum.

Every layer multiplies through ``self.matmul`` (``F.linear``, the reference, unless a model
chose a kernel at construction with ``use_matmul``, e.g. ``linear_triton.linear_triton``).

Block FP8 (``fp8_block.py``), chosen at construction with ``fp8=BlockFP8(...)`` (every layer here
but ``QKVParallelLinear``): ``weight`` is float8_e4m3fn and ``weight_scale_inv`` [ceil(out/bn),
ceil(in/bk)] holds its block scales; the layer multiplies through ``self.fp8_matmul`` (the
dequantizing reference unless ``use_fp8_matmul`` chose a kernel). Scales shard with their weight,
in block units, so every shard boundary must fall on a block boundary: a split that cuts a block
is refused at construction with the reason (as sglang and vLLM refuse it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from .fp8_block import FP8_DTYPE, BlockFP8, BlockFP8MatmulFn, block_fp8_linear_reference
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim

# (x [n, in], weight [out, in], bias [out] | None) -> [n, out]
MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def use_matmul(module: nn.Module, matmul: MatmulFn) -> None:
    """Make every layer under ``module`` that multiplies through ``matmul`` use this one."""
    for m in module.modules():
        if hasattr(m, "matmul"):
            m.matmul = matmul  # type: ignore[assignment]


def use_fp8_matmul(module: nn.Module, matmul: BlockFP8MatmulFn) -> None:
    """Make every block-FP8 layer under ``module`` multiply through this kernel."""
    for m in module.modules():
        if isinstance(m, LinearBase) and m.weight_scale_inv is not None:
            m.fp8_matmul = matmul


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def fp8_block_aligned(size: int, block: int, what: str, fmt: BlockFP8, parts: int = 1) -> None:
    """Refuse an FP8 shard of ``size`` rows or columns that cuts a ``block``-wide scale block."""
    if size % block:
        split = f" over {parts} ranks" if parts > 1 else ""
        raise WeightShapeError(
            f"{what} of {size} per rank{split} is not a multiple of the FP8 block's {block} (weight_block_size "
            f"[{fmt.block_n}, {fmt.block_k}]): its scales cannot be split there; use fewer tensor-parallel ranks "
            "(experts: more expert-parallel ranks) or quantization: none (weights dequantized at load)")


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise WeightShapeError(f"{what}={total} does not split over {parts} ranks")
    return total // parts


class LinearBase(nn.Module):
    """A weight [out, in] in the compute dtype, or in block FP8 with its scales (``fp8``)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def _init_weight(self, out: int, in_: int, dtype: torch.dtype, device: torch.device | str | None,
                     fp8: BlockFP8 | None) -> None:
        self.fp8 = fp8
        self.weight = _param((out, in_), FP8_DTYPE if fp8 else dtype, device)
        self.weight_scale_inv: nn.Parameter | None = (
            _param(fp8.scale_shape(out, in_), torch.float32, device) if fp8 else None)
        self.matmul: MatmulFn = F.linear
        self.fp8_matmul: BlockFP8MatmulFn = block_fp8_linear_reference

    def _mm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [n, in] -> [n, out]
        if self.weight_scale_inv is None:
            return self.matmul(x, self.weight, bias)
        assert self.fp8 is not None
        return self.fp8_matmul(x, self.weight, self.weight_scale_inv, bias, self.fp8)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        self._init_weight(out_features, in_features, dtype, device, fp8)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        copy_checked(param, source.full(), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out]
        return self._mm(x, self.bias)


class MergedReplicatedLinear(ReplicatedLinear):
    """Several replicated outputs of the same input in one matmul (e.g. MLA's q_a_proj and
    kv_a_proj_with_mqa); shard_id = index. In block FP8 every part but the last must be whole blocks
    (the parts' scale rows are concatenated; the last part may end in a partial block, as alone)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        self.out_sizes = list(out_sizes)
        if fp8 is not None:
            for size in out_sizes[:-1]:
                fp8_block_aligned(size, fp8.block_n, f"merged output part of {size} rows", fp8)
        super().__init__(in_features, sum(out_sizes), bias, dtype, device, fp8)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise TypeError("MergedReplicatedLinear loads one part at a time (shard_id = index)")
        unit = self.fp8.block_n if (self.fp8 is not None and param is self.weight_scale_inv) else 1
        sizes = [-(-s // unit) for s in self.out_sizes]
        rows, offset = sizes[shard_id], sum(sizes[:shard_id])
        expect_dim(source, 0, rows)
        copy_checked(param.narrow(0, offset, rows), source.full(), source.name)


class ColumnParallelLinear(LinearBase):
    """Output features split over the group: rank r holds rows [r*out/size, (r+1)*out/size)."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        self.group = group
        self.out_per_rank = _split(out_features, group.size, "output features")
        if fp8 is not None and group.size > 1:
            fp8_block_aligned(self.out_per_rank, fp8.block_n, f"output rows {out_features}: a shard", fp8,
                              group.size)
        self._init_weight(self.out_per_rank, in_features, dtype, device, fp8)
        self.bias = _param((self.out_per_rank,), dtype, device) if bias else None

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        rows = param.shape[0]
        expect_dim(source, 0, rows * self.group.size)
        copy_checked(param, source.narrow(0, self.group.rank * rows, rows), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out/size]
        return self._mm(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up); shard_id = index. In block
    FP8 every part's shard must be whole blocks (the parts' scales are concatenated too)."""

    def __init__(self, in_features: int, out_sizes: list[int], group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        self.out_sizes_per_rank = [_split(s, group.size, "merged output") for s in out_sizes]
        if fp8 is not None:
            for total, size in zip(out_sizes, self.out_sizes_per_rank):
                fp8_block_aligned(size, fp8.block_n, f"merged output part of {total} rows: a shard", fp8,
                                  group.size)
        super().__init__(in_features, sum(out_sizes), group, bias, dtype, device, fp8)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise TypeError("MergedColumnParallelLinear loads one part at a time (shard_id = index)")
        unit = self.fp8.block_n if (self.fp8 is not None and param is self.weight_scale_inv) else 1
        sizes = [s // unit for s in self.out_sizes_per_rank]
        rows = sizes[shard_id]
        offset = sum(sizes[:shard_id])
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


class RowParallelLinear(LinearBase):
    """Input features split over the group; returns this rank's addend (bias on rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        self.group = group
        self.in_per_rank = _split(in_features, group.size, "input features")
        if fp8 is not None and group.size > 1:
            fp8_block_aligned(self.in_per_rank, fp8.block_k, f"input columns {in_features}: a shard", fp8,
                              group.size)
        self._init_weight(out_features, self.in_per_rank, dtype, device, fp8)
        self.bias = _param((out_features,), dtype, device) if bias else None

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
        return self._mm(x, bias)


def default_weight_loader(param: torch.Tensor, source: WeightSource, shard_id: object = None) -> None:
    copy_checked(param, source.full(), source.name)
