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

import torch


class Layout(enum.Enum):
    SCATTERED = "scattered"
    ATTN_TP_FULL = "attn_tp_full"
    FULL = "full"


@dataclass(frozen=True)
class Unreduced:
    """A layer output that still owes a sum over ``group`` (a group name, e.g. "tp").

    Layers return this instead of reducing; the communicator completes it exactly once, at
    the boundary the plan names (an all-reduce, a reduce-scatter, or the next norm's fused
    all-reduce + add + RMSNorm). A plain tensor given where a sum is owed is an error.
    """

    partial: torch.Tensor  # [num_tokens, hidden], this rank's addend
    group: str
