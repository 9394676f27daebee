"""Executes the communication plan: the one place where owed sums are completed.

A model calls ``begin_forward`` once per forward (this picks the plan variant for the batch),
then ``boundary(i, incoming, residual, norm)`` before each block and before the final norm,
and ``gather_vocab`` on the LM head's shard. Each boundary checks that what it receives is
what the plan says (an ``Unreduced`` owed to the planned group) and runs exactly the planned
collectives, so a sum can be neither dropped nor completed twice.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .collectives import Collectives
from .comm_plan import Boundary, BoundaryKind, CommPlan, ForwardPlan
from .fused_allreduce_norm import add_rms_norm, rms_norm
from .groups import ParallelGroups
from .layouts import Unreduced


class NormWeights(Protocol):
    weight: torch.Tensor
    eps: float


class PlanViolation(RuntimeError):
    """A block handed the communicator something the plan did not predict."""


class Communicator:
    def __init__(self, plan: CommPlan, groups: ParallelGroups, collectives: Collectives) -> None:
        self.plan = plan
        self.groups = groups
        self.collectives = collectives
        self.active: ForwardPlan = plan.unfused
        self._vocab_group = groups.by_name(plan.unfused.lm_head[0].group) if plan.unfused.lm_head else None
        # Rows of a FULL-layout tensor that are real tokens (DP padding excluded); None = all.
        # MoE blocks read it so that padding rows never route to experts.
        self.valid_rows: torch.Tensor | None = None
        self._capture: frozenset[int] = frozenset()
        self.captured: list[torch.Tensor] = []

    def capture_inputs_of(self, layers: list[int]) -> None:
        """Record the complete residual stream entering these layers (EAGLE3 aux states)."""
        self._capture = frozenset(layers)

    @property
    def ledger(self):  # type: ignore[no-untyped-def]
        return self.collectives.ledger

    def begin_forward(self, num_tokens: int) -> ForwardPlan:
        self.active = self.plan.select(num_tokens)
        self.collectives.ledger.begin_forward()
        self.captured = []
        return self.active

    def after_input_boundary(self, layer: int, residual: torch.Tensor) -> None:
        """Called by a layer right after its input boundary completed the residual stream.

        The residual here is the complete output of layer-1 (pre-norm), never a partial sum:
        every boundary has already completed what was owed. Every boundary runner returns a
        fresh residual tensor, so a snapshot needs no copy; a runner that updates the residual
        in place must clone here.
        """
        if layer in self._capture:
            self.captured.append(residual)

    def boundary(
        self,
        index: int,
        incoming: Unreduced,
        residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete ``incoming``, add the residual, norm. Returns (normed, residual).

        incoming.partial, residual: [num_tokens, hidden]. The returned residual is the complete
        residual stream at this boundary (the input of the next block, pre-norm).
        """
        b = self.active.boundaries[index]
        if not isinstance(incoming, Unreduced):
            raise PlanViolation(
                f"{b.site}: expected a sum owed to group {b.owed!r}, got an already-reduced "
                f"{type(incoming).__name__}; a block must leave its reduction to the plan"
            )
        if incoming.group != b.owed:
            raise PlanViolation(f"{b.site}: incoming sum is owed to {incoming.group!r}, plan says {b.owed!r}")
        run = _RUNNERS[b.kind]
        return run(self, b, incoming.partial, residual, norm)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits shard -> full (padded) vocab. logits: [n, vocab/size] -> [n, vocab]"""
        if self._vocab_group is None:
            return logits
        return self.collectives.all_gather(logits, self._vocab_group, "lm_head", dim=-1)

    # --- one runner per boundary kind -------------------------------------------------

    def _first(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            raise PlanViolation(f"{b.site}: the first boundary takes no residual")
        h = self._all_reduce_steps(b, h)
        return rms_norm(h, norm.weight, norm.eps), h

    def _all_reduce_add_norm(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        h = self._all_reduce_steps(b, h)
        return add_rms_norm(h, residual, norm.weight, norm.eps)

    def _fused(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        group = self.groups.by_name(b.owed)
        return self.collectives.fused_allreduce_add_rmsnorm(h, residual, norm.weight, norm.eps, group, b.site)

    def _all_reduce_steps(self, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        for step in b.steps:
            h = self.collectives.all_reduce(h, self.groups.by_name(step.group), b.site)
        return h


_RUNNERS = {
    BoundaryKind.FIRST: Communicator._first,
    BoundaryKind.ALL_REDUCE_ADD_NORM: Communicator._all_reduce_add_norm,
    BoundaryKind.FUSED_AR_ADD_NORM: Communicator._fused,
}
