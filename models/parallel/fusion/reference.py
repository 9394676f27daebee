"""All-reduce + residual add + RMSNorm: the plain reference and the kernel choice.

``residual_out = all_reduce(x) + residual``; ``normed = rms_norm(residual_out) * weight``.
The reference runs exactly that: a real all-reduce, then the add, then the norm — never a
norm without the all-reduce. The FlashInfer kernel (GPU) lives in ``flashinfer.py`` and falls
back to this reference; which one a rank uses is decided once, in ``selection.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..groups import Group


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; statistics in fp32, output in x's dtype (as HF Llama does).
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is a fresh tensor."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


@dataclass(frozen=True)
class NormKernels:
    """The RMSNorm and add + RMSNorm a communicator runs where no all-reduce is fused in, chosen
    once at construction (e.g. Triton kernels on a GPU); the defaults are the references above."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]] = add_rms_norm


class FusedAllReduceNorm(Protocol):
    """One all-reduce + add + RMSNorm over a group. ``path`` labels it in the ledger."""

    path: str

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: Group
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ReferenceFusedAllReduceNorm:
    """all_reduce(x) on the group's device group, then add, then RMSNorm."""

    path = "reference_fused"

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: Group
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden]
        if not group.is_trivial:
            group.all_reduce_(x)
        return add_rms_norm(x, residual, weight, eps)
