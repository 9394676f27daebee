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
from .dp_geometry import DPGeometry, Padding, dp_geometry
from .fused_allreduce_norm import NormKernels
from .groups import ParallelGroups
from .layouts import Layout, Unreduced


class NormWeights(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


class PlanViolation(RuntimeError):
    """A block handed the communicator something the plan did not predict."""


class Communicator:
    def __init__(self, plan: CommPlan, groups: ParallelGroups, collectives: Collectives,
                 norms: NormKernels | None = None) -> None:
        self.plan = plan
        # The (add +) RMSNorm of unfused boundaries; the fused one is the collectives' choice.
        self.norms = norms if norms is not None else NormKernels()
        self.groups = groups
        self.collectives = collectives
        self.active: ForwardPlan = plan.unfused
        self._vocab_group = groups.by_name(plan.unfused.lm_head[0].group) if plan.unfused.lm_head else None
        # Rows of a FULL-layout tensor that are real tokens (DP padding excluded); None = all.
        # MoE blocks read it so that padding rows never route to experts.
        self.valid_rows: torch.Tensor | None = None
        self.geometry: DPGeometry | None = None
        # Tests and benchmarks may pin the DP padding mode; None = sglang's automatic choice.
        self.force_padding: Padding | None = None
        self._capture: frozenset[int] = frozenset()
        self.captured: list[torch.Tensor] = []

    def capture_inputs_of(self, layers: list[int]) -> None:
        """Record the complete residual stream entering these layers (EAGLE3 aux states)."""
        self._capture = frozenset(layers)

    @property
    def ledger(self):  # type: ignore[no-untyped-def]
        return self.collectives.ledger

    def begin_forward(self, num_tokens: int, dp_num_tokens: list[int] | None = None,
                      padding: Padding | None = None) -> ForwardPlan:
        """Pick the plan variant for this forward. Under DP attention every rank passes the
        token counts of all DP groups (the same list on every rank); ``padding`` overrides
        the automatic MAX_LEN / SUM_LEN choice."""
        if self.plan.config.dp_attention:
            if dp_num_tokens is None:
                raise ValueError("DP attention: the forward batch must carry dp_num_tokens")
            geo = dp_geometry(self.plan.config, dp_num_tokens, padding or self.force_padding)
            if dp_num_tokens[self.groups.coords.dp_rank] != num_tokens:
                raise ValueError(f"dp_num_tokens {dp_num_tokens} disagrees with this DP group's {num_tokens} tokens")
            self.geometry = geo
            valid = geo.valid_full_rows()
            self.valid_rows = None if valid is None else torch.tensor(valid, device=self._device())
            self.active = self.plan.select(num_tokens, geo.padding)
        else:
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
        return self.norms.rms_norm(h, norm.weight, norm.eps), h

    def _all_reduce_add_norm(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        h = self._all_reduce_steps(b, h)
        return self.norms.add_rms_norm(h, residual, norm.weight, norm.eps)

    def _fused(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        group = self.groups.by_name(b.owed)
        return self.collectives.fused_allreduce_add_rmsnorm(h, residual, norm.weight, norm.eps, group, b.site)

    # --- DP attention (see comm_plan.py and dp_geometry.py) ----------------------------

    def _dp_first(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            raise PlanViolation(f"{b.site}: the first boundary takes no residual")
        chunk = self._scatter_local(b, h)
        return self._gather(b, self.norms.rms_norm(chunk, norm.weight, norm.eps)), chunk

    def _dp_scatter_add_norm_gather(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        chunk = self._scatter_local(b, h) if b.owed == "attn_tp" else self._scatter_full(b, h)
        normed, residual = self.norms.add_rms_norm(chunk, residual, norm.weight, norm.eps)
        return self._gather(b, normed), residual

    def _dp_all_reduce_slice_add_norm_gather(
        self, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Benchmark-only (``plan_communication(dp_combine="all_reduce")``): the combine as an
        all-reduce of the whole FULL sum, then this rank's chunk; the plan's default is one
        reduce-scatter (``_dp_scatter_add_norm_gather``). Same result, more communication."""
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        if b.owed != "tp":
            raise PlanViolation(f"{b.site}: the all-reduce combine completes sums owed to tp, not {b.owed!r}")
        chunk = self._all_reduce_slice_full(b, h)
        normed, residual = self.norms.add_rms_norm(chunk, residual, norm.weight, norm.eps)
        return self._gather(b, normed), residual

    def _geo(self) -> DPGeometry:
        assert self.geometry is not None, "begin_forward was not called with DP token counts"
        return self.geometry

    def _scatter_local(self, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """This DP group's tokens, owed over attn_tp -> this rank's complete chunk.
        h: [n_d, H] -> [chunk_rows[rank], H]"""
        geo, me, group = self._geo(), self.groups.coords, self.groups.attn_tp
        sizes = geo.local_sizes(me.dp_rank)
        rows = geo.chunk_rows[me.rank]
        if group.is_trivial:
            return _pad_rows(h, rows)
        width = max(geo.chunk_rows[me.dp_rank * group.size : (me.dp_rank + 1) * group.size])
        buf = h.new_zeros((group.size * width, h.shape[1]))
        start = 0
        for j, n in enumerate(sizes):
            buf[j * width : j * width + n] = h[start : start + n]
            start += n
        return self.collectives.reduce_scatter(buf, group, b.site)[:rows]

    def _scatter_full(self, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """All DP groups' tokens, owed over tp -> this rank's complete chunk (one reduce-scatter).
        h: [full_rows, H] -> [chunk_rows[rank], H]"""
        geo, me, group = self._geo(), self.groups.coords, self.groups.tp
        if geo.padding is Padding.MAX_LEN:
            return self.collectives.reduce_scatter(h, group, b.site)
        width = geo.max_chunk
        buf = h.new_zeros((group.size * width, h.shape[1]))
        for r, n in enumerate(geo.chunk_rows):
            off = geo.chunk_offset(r)
            buf[r * width : r * width + n] = h[off : off + n]
        return self.collectives.reduce_scatter(buf, group, b.site)[: geo.chunk_rows[me.rank]]

    def _all_reduce_slice_full(self, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """All DP groups' tokens, owed over tp -> all-reduced in place -> this rank's chunk rows
        (a view, no copy). h: [full_rows, H] -> [chunk_rows[rank], H]"""
        geo, me = self._geo(), self.groups.coords
        h = self.collectives.all_reduce(h, self.groups.tp, b.site)
        off = geo.chunk_offset(me.rank)
        return h[off : off + geo.chunk_rows[me.rank]]

    def _gather(self, b: Boundary, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk -> the layout of the next block. chunk: [chunk_rows[rank], H]"""
        geo, me = self._geo(), self.groups.coords
        if b.gather_to is Layout.FULL:
            if geo.padding is Padding.MAX_LEN:
                return self.collectives.all_gather(chunk, self.groups.tp, b.site)
            buf = chunk.new_zeros((geo.full_rows, chunk.shape[1]))
            off = geo.chunk_offset(me.rank)
            buf[off : off + chunk.shape[0]] = chunk
            return self.collectives.all_reduce(buf, self.groups.tp, b.site)
        group = self.groups.attn_tp
        n_local = geo.dp_num_tokens[me.dp_rank]
        if group.is_trivial:
            return chunk[:n_local]
        sizes = geo.local_sizes(me.dp_rank)
        width = max(geo.chunk_rows[me.dp_rank * group.size : (me.dp_rank + 1) * group.size])
        gathered = self.collectives.all_gather(_pad_rows(chunk, width), group, b.site)
        return torch.cat([gathered[j * width : j * width + n] for j, n in enumerate(sizes)])

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.collectives.device_path == "nccl" \
            else torch.device("cpu")

    def _all_reduce_steps(self, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        for step in b.steps:
            h = self.collectives.all_reduce(h, self.groups.by_name(step.group), b.site)
        return h


_RUNNERS = {
    BoundaryKind.FIRST: Communicator._first,
    BoundaryKind.ALL_REDUCE_ADD_NORM: Communicator._all_reduce_add_norm,
    BoundaryKind.FUSED_AR_ADD_NORM: Communicator._fused,
    BoundaryKind.DP_FIRST: Communicator._dp_first,
    BoundaryKind.DP_SCATTER_ADD_NORM_GATHER: Communicator._dp_scatter_add_norm_gather,
    BoundaryKind.DP_ALL_REDUCE_SLICE_ADD_NORM_GATHER: Communicator._dp_all_reduce_slice_add_norm_gather,
}


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    if x.shape[0] > rows:
        raise PlanViolation(f"{x.shape[0]} rows do not fit a chunk of {rows}")
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])
