"""Where a parameter's values come from while loading: a lazily read checkpoint tensor.

Parallel layers read only their shard (``narrow``) so no rank materialises the full weights.
Once every weight is in (the loader, random init), ``finish_loading`` lets each module that keeps
tensors derived from its weights (``derive_from_weights``, e.g. MLA's absorbed kv_b halves) make them.
``DequantizedSource`` reads a block-FP8 weight and its ``weight_scale_inv`` as one float32 tensor
(any shard: the scale rows or columns the shard touches are read and expanded, so a shard may
start or end inside a block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import nn

from .fp8_block import BlockFP8

T = TypeVar("T")


class WeightSource(Protocol):
    name: str

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The slice [start, start+length) along ``dim``, read from the checkpoint."""
        ...

    def full(self) -> torch.Tensor: ...


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not fit the model built from config.json."""


class TensorSource:
    """A WeightSource over an in-memory tensor (tests, converted weights)."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self._t = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._t.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._t.narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self._t


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class DequantizedSource:
    """A block-FP8 weight [..., rows, cols] and its scales [..., ceil(rows/bn), ceil(cols/bk)] read as
    one float32 tensor (``quantization: none``, or an architecture without FP8 layers)."""

    def __init__(self, weight: WeightSource, scale: WeightSource, fmt: BlockFP8) -> None:
        self.name = weight.name
        self._w, self._s, self._fmt = weight, scale, fmt
        rows, cols = weight.shape[-2:] if len(weight.shape) >= 2 else (0, 0)
        if len(weight.shape) < 2 or tuple(scale.shape) != (*weight.shape[:-2], *fmt.scale_shape(rows, cols)):
            raise WeightShapeError(f"{scale.name}: shape {scale.shape} is not the {fmt.block_n}x{fmt.block_k} "
                                   f"block grid of {weight.name} {weight.shape} (config.json weight_block_size)")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._w.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        nd = len(self.shape)
        dim = dim % nd
        unit = {nd - 2: self._fmt.block_n, nd - 1: self._fmt.block_k}.get(dim, 1)
        first, last = start // unit, -(-(start + length) // unit)
        w = self._w.narrow(dim, start, length)
        s = self._s.narrow(dim, first, last - first)
        return _dequantize(w, s, self._fmt, dim, start - first * unit)

    def full(self) -> torch.Tensor:
        return _dequantize(self._w.full(), self._s.full(), self._fmt, 0, 0)


def _dequantize(w: torch.Tensor, s: torch.Tensor, fmt: BlockFP8, dim: int, offset: int) -> torch.Tensor:
    """w [..., r, c] with the scales of the blocks it touches; along ``dim`` it starts ``offset``
    elements into its first block."""
    nd = w.dim()
    s = s.float().repeat_interleave(fmt.block_n, dim=nd - 2).repeat_interleave(fmt.block_k, dim=nd - 1)
    index = [slice(None)] * nd
    for d in (nd - 2, nd - 1):
        lo = offset if d == dim else 0
        index[d] = slice(lo, lo + w.shape[d])
    return w.float() * s[tuple(index)]


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into ``param`` (casting between float dtypes); a shape mismatch, or FP8 on one side
    only (a cast would silently requantize or reinterpret), names the tensor."""
    if tuple(param.shape) != tuple(value.shape):
        raise WeightShapeError(
            f"{name}: checkpoint shard has shape {tuple(value.shape)}, model expects {tuple(param.shape)}"
        )
    if (param.dtype in _FP8) != (value.dtype in _FP8):
        why = ("the model keeps block-FP8 weights here (config.json's quantization_config): a checkpoint "
               "weight that is not FP8 (modules_to_not_convert?) needs quantization: none"
               if param.dtype in _FP8 else
               "an FP8 tensor loads only with its weight_scale_inv and config.json's block-FP8 quantization_config")
        raise WeightShapeError(f"{name}: checkpoint tensor is {value.dtype}, model expects {param.dtype}: {why}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def expect_dim(source: WeightSource, dim: int, size: int) -> None:
    if len(source.shape) <= dim or source.shape[dim] != size:
        raise WeightShapeError(
            f"{source.name}: checkpoint shape {source.shape} has no dimension {dim} of size {size} "
            "as config.json implies"
        )


def named(what: str, build: Callable[[], T]) -> T:
    """``build()``, a shape error prefixed with what was being built (e.g. ``kv_b_proj: ...``)."""
    try:
        return build()
    except WeightShapeError as e:
        raise WeightShapeError(f"{what}: {e}") from e


def finish_loading(model: nn.Module) -> None:
    """Run ``derive_from_weights()`` of every module that has one (after all weights are loaded)."""
    for module in model.modules():
        derive = getattr(module, "derive_from_weights", None)
        if derive is not None:
            derive()
