"""RMSNorm. The math (and the fused all-reduce variant's reference) is in
``parallel/fused_allreduce_norm.py``; the communicator applies input norms at boundaries."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..parallel.fusion.reference import rms_norm


class RMSNorm(nn.Module):
    """``kernel``: the norm's implementation, chosen at construction (``Kernels.norms.rms_norm``)."""

    def __init__(self, hidden: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.kernel = kernel or rms_norm
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden]
        return self.kernel(x, self.weight, self.eps)
