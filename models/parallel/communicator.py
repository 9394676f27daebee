"""Executes the communication plan: the one place where owed sums are completed.

A model starts every forward with ``begin_forward`` (which picks the plan variant for the
batch and returns it, with the DP geometry, as a frozen ``ForwardContext``), passes that context
down, and calls ``ctx.boundary(i, incoming, residual, norm)`` before each block and before the
final norm, and ``gather_vocab`` on the LM head's shard. Each boundary checks that what it
receives is what the plan says (an ``Unreduced`` owed to the planned group) and runs exactly the
planned collectives, so a sum can be neither dropped nor completed twice. The communicator holds
no per-forward state: everything a forward needs travels in its context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .collectives import Collectives
from .comm_plan import Boundary, BoundaryKind, CommPlan, ForwardPlan
from .dp_geometry import DPGeometry, Padding, dp_geometry
from .fusion.reference import NormKernels
from .groups import ParallelGroups
from .layouts import Layout, Unreduced


class NormWeights(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


class PlanViolation(RuntimeError):
    """A block handed the communicator something the plan did not predict."""


@dataclass(frozen=True)
class ForwardContext:
    """One forward's communication, decided when it starts (``Communicator.begin_forward``).

    ``plan``: the plan variant this forward runs (fused or not; under DP attention MAX_LEN or
    SUM_LEN); ``geometry``: where every token sits under DP attention (None without);
    ``valid_rows``: [full_rows] bool on the device, the FULL-layout rows that are real tokens
    (MAX_LEN padding excluded; MoE blocks route no padding row), None when every row is.
    """

    comm: Communicator
    plan: ForwardPlan
    geometry: DPGeometry | None = None
    valid_rows: torch.Tensor | None = None

    def boundary(self, index: int, incoming: Unreduced, residual: torch.Tensor | None,
                 norm: NormWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``Communicator.boundary``."""
        return self.comm.boundary(self, index, incoming, residual, norm)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_vocab(logits)


class Communicator:
    def __init__(self, plan: CommPlan, groups: ParallelGroups, collectives: Collectives,
                 norms: NormKernels | None = None) -> None:
        self.plan = plan
        # The (add +) RMSNorm of unfused boundaries; the fused one is the collectives' choice.
        self.norms = norms if norms is not None else NormKernels()
        self.groups = groups
        self.collectives = collectives
        self._vocab_group = groups.by_name(plan.unfused.lm_head[0].group) if plan.unfused.lm_head else None

    @property
    def ledger(self):  # type: ignore[no-untyped-def]
        return self.collectives.ledger

    def begin_forward(self, num_tokens: int, dp_num_tokens: list[int] | tuple[int, ...] | None = None,
                      padding: Padding | None = None, dp_real_tokens: torch.Tensor | None = None
                      ) -> ForwardContext:
        """The context of a forward of ``num_tokens`` tokens on this rank; its plan variant's
        collectives are counted as planned in the ledger.

        Under DP attention every rank passes the token counts of all DP groups (the same list on
        every rank); ``padding`` overrides the automatic MAX_LEN / SUM_LEN choice;
        ``dp_real_tokens`` ([dp] int, on the device) are the real tokens of each DP group when
        ``dp_num_tokens`` are padded counts (a CUDA-graph replay at a padded batch), else None.
        """
        if not self.plan.config.dp_attention:
            plan = self.plan.select(num_tokens)
            self.collectives.ledger.begin_forward(plan.expected())
            return ForwardContext(self, plan)
        if dp_num_tokens is None:
            raise ValueError("DP attention: the forward batch must carry dp_num_tokens")
        counts = list(dp_num_tokens)
        geo = dp_geometry(self.plan.config, counts, padding)
        if counts[self.groups.coords.dp_rank] != num_tokens:
            raise ValueError(f"dp_num_tokens {counts} disagrees with this DP group's {num_tokens} tokens")
        plan = self.plan.select(num_tokens, geo.padding)
        self.collectives.ledger.begin_forward(plan.expected())
        return ForwardContext(self, plan, geo, self._valid_rows(geo, dp_real_tokens))

    def _valid_rows(self, geo: DPGeometry, real: torch.Tensor | None) -> torch.Tensor | None:
        """FULL rows that are real tokens, built on the device: row k of DP group d's span (attn_tp
        chunks of c rows each under MAX_LEN) is real iff k < the group's real token count."""
        if geo.padding is Padding.SUM_LEN:
            return None
        if real is None:  # counts not given on the device (a direct caller): they are the real ones
            flags = geo.valid_full_rows()
            if flags is None or all(flags):
                return None
            real = torch.tensor(geo.dp_num_tokens, device=self._device())
        span = geo.attn_tp * (geo.chunk_rows[0] if geo.chunk_rows else 0)
        rows = torch.arange(span * len(geo.dp_num_tokens), device=real.device)
        return (rows % max(span, 1)) < real.to(rows.dtype).repeat_interleave(span)

    def boundary(
        self,
        ctx: ForwardContext,
        index: int,
        incoming: Unreduced,
        residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete ``incoming``, add the residual, norm. Returns (normed, residual).

        incoming.partial, residual: [num_tokens, hidden]. The returned residual is the complete
        residual stream at this boundary (the input of the next block, pre-norm), a fresh tensor
        that nothing later writes into.
        """
        b = ctx.plan.boundaries[index]
        if not isinstance(incoming, Unreduced):
            raise PlanViolation(
                f"{b.site}: expected a sum owed to group {b.owed!r}, got an already-reduced "
                f"{type(incoming).__name__}; a block must leave its reduction to the plan"
            )
        if incoming.group != b.owed:
            raise PlanViolation(f"{b.site}: incoming sum is owed to {incoming.group!r}, plan says {b.owed!r}")
        run = _RUNNERS[b.kind]
        return run(self, ctx, b, incoming.partial, residual, norm)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits shard -> full (padded) vocab. logits: [n, vocab/size] -> [n, vocab]"""
        if self._vocab_group is None:
            return logits
        return self.collectives.all_gather(logits, self._vocab_group, "lm_head", dim=-1)

    # --- one runner per boundary kind -------------------------------------------------

    def _first(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            raise PlanViolation(f"{b.site}: the first boundary takes no residual")
        h = self._all_reduce_steps(b, h)
        return self.norms.rms_norm(h, norm.weight, norm.eps), h

    def _all_reduce_add_norm(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        h = self._all_reduce_steps(b, h)
        return self.norms.add_rms_norm(h, residual, norm.weight, norm.eps)

    def _fused(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        group = self.groups.by_name(b.owed)
        return self.collectives.fused_allreduce_add_rmsnorm(h, residual, norm.weight, norm.eps, group, b.site)

    # --- DP attention (see comm_plan.py and dp_geometry.py) ----------------------------

    def _dp_first(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            raise PlanViolation(f"{b.site}: the first boundary takes no residual")
        chunk = self._scatter_local(ctx, b, h)
        return self._gather(ctx, b, self.norms.rms_norm(chunk, norm.weight, norm.eps)), chunk

    def _dp_scatter_add_norm_gather(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        chunk = self._scatter_local(ctx, b, h) if b.owed == "attn_tp" else self._scatter_full(ctx, b, h)
        normed, residual = self.norms.add_rms_norm(chunk, residual, norm.weight, norm.eps)
        return self._gather(ctx, b, normed), residual

    def _dp_all_reduce_slice_add_norm_gather(
        self, ctx: ForwardContext, b: Boundary, h: torch.Tensor, residual: torch.Tensor | None,
        norm: NormWeights,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Benchmark-only (``plan_communication(dp_combine="all_reduce")``): the combine as an
        all-reduce of the whole FULL sum, then this rank's chunk; the plan's default is one
        reduce-scatter (``_dp_scatter_add_norm_gather``). Same result, more communication."""
        if residual is None:
            raise PlanViolation(f"{b.site}: missing residual")
        if b.owed != "tp":
            raise PlanViolation(f"{b.site}: the all-reduce combine completes sums owed to tp, not {b.owed!r}")
        chunk = self._all_reduce_slice_full(ctx, b, h)
        normed, residual = self.norms.add_rms_norm(chunk, residual, norm.weight, norm.eps)
        return self._gather(ctx, b, normed), residual

    @staticmethod
    def _geo(ctx: ForwardContext) -> DPGeometry:
        if ctx.geometry is None:
            raise PlanViolation("a DP-attention boundary in a forward begun without DP token counts")
        return ctx.geometry

    def _scatter_local(self, ctx: ForwardContext, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """This DP group's tokens, owed over attn_tp -> this rank's complete chunk.
        h: [n_d, H] -> [chunk_rows[rank], H]"""
        geo, me, group = self._geo(ctx), self.groups.coords, self.groups.attn_tp
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

    def _scatter_full(self, ctx: ForwardContext, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """All DP groups' tokens, owed over tp -> this rank's complete chunk (one reduce-scatter).
        h: [full_rows, H] -> [chunk_rows[rank], H]"""
        geo, me, group = self._geo(ctx), self.groups.coords, self.groups.tp
        if geo.padding is Padding.MAX_LEN:
            return self.collectives.reduce_scatter(h, group, b.site)
        width = geo.max_chunk
        buf = h.new_zeros((group.size * width, h.shape[1]))
        for r, n in enumerate(geo.chunk_rows):
            off = geo.chunk_offset(r)
            buf[r * width : r * width + n] = h[off : off + n]
        return self.collectives.reduce_scatter(buf, group, b.site)[: geo.chunk_rows[me.rank]]

    def _all_reduce_slice_full(self, ctx: ForwardContext, b: Boundary, h: torch.Tensor) -> torch.Tensor:
        """All DP groups' tokens, owed over tp -> all-reduced in place -> this rank's chunk rows
        (a view, no copy). h: [full_rows, H] -> [chunk_rows[rank], H]"""
        geo, me = self._geo(ctx), self.groups.coords
        h = self.collectives.all_reduce(h, self.groups.tp, b.site)
        off = geo.chunk_offset(me.rank)
        return h[off : off + geo.chunk_rows[me.rank]]

    def _gather(self, ctx: ForwardContext, b: Boundary, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk -> the layout of the next block. chunk: [chunk_rows[rank], H]"""
        geo, me = self._geo(ctx), self.groups.coords
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
