"""Where a parameter's values come from while loading: a lazily read checkpoint tensor.

Parallel layers read only their shard (``narrow``) so no rank materialises the full weights.
"""

from __future__ import annotations

from typing import Protocol

import torch


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


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into ``param`` (casting dtype); a shape mismatch names the tensor."""
    if tuple(param.shape) != tuple(value.shape):
        raise WeightShapeError(
            f"{name}: checkpoint shard has shape {tuple(value.shape)}, model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def expect_dim(source: WeightSource, dim: int, size: int) -> None:
    if len(source.shape) <= dim or source.shape[dim] != size:
        raise WeightShapeError(
            f"{source.name}: checkpoint shape {source.shape} has no dimension {dim} of size {size} "
            "as config.json implies"
        )
