"""Token layouts between stages, and the typed value of a sum still owed.

Example: tp=4, dp=2 (attention groups of attn_tp=2 ranks), DP group 0 serves sequences
``a, b`` and DP group 1 serves ``c, d``::

    layout          rank 0   rank 1   rank 2   rank 3
    SCATTERED       a        b        c        d        each rank its own slice of its DP group's tokens
    ATTN_TP_FULL    ab       ab       cd       cd       every rank of an attention group: its DP group's tokens
    FULL            abcd     abcd     abcd     abcd     every rank: every DP group's tokens

Without DP attention (dp=1) ATTN_TP_FULL and FULL are the same layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch


class Layout(enum.Enum):
    SCATTERED = "scattered"
    ATTN_TP_FULL = "attn_tp_full"
    FULL = "full"


class OwedMatmul(Protocol):
    """A block's last matmul, not run yet (``RowParallelLinear.owed``): ``x @ weight^T (+ bias)`` is this
    rank's addend. A boundary that folds the residual add into that matmul's epilogue runs it itself
    (``comm_plan.BoundaryKind.MATMUL_ADD_NORM``); every other boundary asks for ``run()``."""

    @property
    def x(self) -> torch.Tensor: ...

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    def run(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Unreduced:
    """A layer output that still owes a sum over ``group`` (a group name, e.g. "tp").

    Layers return this instead of reducing; the communicator completes it exactly once, at
    the boundary the plan names (an all-reduce, a reduce-scatter, or the next norm's fused
    all-reduce + add + RMSNorm). A plain tensor given where a sum is owed is an error.
    ``owed``: this rank's addend [num_tokens, hidden], or the matmul that computes it (``OwedMatmul``),
    which ``partial`` runs where a boundary does not take it whole.
    """

    owed: torch.Tensor | OwedMatmul
    group: str

    @property
    def partial(self) -> torch.Tensor:
        """This rank's addend, [num_tokens, hidden]."""
        return self.owed if isinstance(self.owed, torch.Tensor) else self.owed.run()
