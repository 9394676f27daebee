"""Rows normed up to one factor each: what a boundary that folds its RMSNorm into the matmuls on either side of
it hands the next block (``comm_plan.BoundaryKind.MATMUL_ADD_NORM``).

``rms_norm(s) * w`` for the residual stream s is, row by row, ``(s * w) * rsqrt(mean(s^2) + eps)``: the producing
matmul (``linear_triton.decode_matmul_add_norm``) stores ``s * w`` and each of its output tiles' sum of squares per
row, and the consuming matmul (``decode_qkv_rope`` / ``decode_gate_up_silu`` given a ``RowScaled``) reduces
those sums and scales its fp32 results by the factor in its epilogue — a row factor commutes with the matmul
(``(a x) W^T = a (x W^T)``), so no RMSNorm kernel runs between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowScaled:
    """``scaled`` [n, hidden] (s * w, rounded to s's dtype) times ``rsqrt(sum of sumsq's column / hidden + eps)``
    per row; ``sumsq`` [tiles, >= n] fp32: each producing tile's sum of s^2 over its columns, per row."""

    scaled: torch.Tensor
    sumsq: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.scaled.shape

    def factors(self) -> torch.Tensor:
        """Each row's rsqrt(mean(s^2) + eps), [n] fp32."""
        n, hidden = self.scaled.shape
        return torch.rsqrt(self.sumsq.sum(0)[:n] / hidden + self.eps)

    def materialize(self) -> torch.Tensor:
        """The normed rows themselves, [n, hidden] (for an op that cannot take the factor in its epilogue)."""
        return (self.scaled.float() * self.factors()[:, None]).to(self.scaled.dtype)


def as_rows(h: torch.Tensor | RowScaled) -> torch.Tensor:
    """h's normed rows as a tensor (materialized where h is a ``RowScaled``)."""
    return h.materialize() if isinstance(h, RowScaled) else h
