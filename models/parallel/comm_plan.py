"""The communication plan: which collectives run where, decided once, as a pure value.

A model is a sequence of *blocks* (attention, MLP, MoE, Mamba mixer), each of which
returns an ``Unreduced`` sum owed to one group. Between two blocks sits a *boundary*: it
completes what the previous block owes, adds the residual, applies the next block's input
norm and moves the tokens into the next block's layout. The plan lists, for each boundary,
its kind and the collectives it runs; the communicator executes exactly that and the
ledger records it, so plan and execution can be compared.

Deferral is a plan decision: with fusion, the MLP's sum is not all-reduced at the end of
layer i but completed by the fused all-reduce + add + RMSNorm at layer i+1's input.

Fusion is gated as in sglang: tp > 1, no DP attention, 0 < tokens <= 2048, and never at
the final norm. Because the token gate depends on the batch, the plan holds one variant
per gate outcome; ``CommPlan.select`` picks one per forward.

DP attention (dp > 1): the residual stream stays SCATTERED (see ``dp_geometry.py``). A
boundary completes the owed sum straight into this rank's chunk with ONE reduce-scatter
over the owing group (attn_tp after attention/Mamba, tp after an MLP/MoE that ran on all
DP groups' tokens), adds the residual and norms the chunk, then gathers the normed chunk
into the next block's layout (all-gather over attn_tp for ATTN_TP_FULL; all-gather over tp
for FULL with MAX_LEN padding, or all-reduce of a zero-filled buffer with SUM_LEN). So an
MoE layer's sum is completed by exactly one reduce-scatter and never all-reduced.

Benchmark-only: ``plan_communication(..., dp_combine="all_reduce")`` plans the combine of a
block owing ``tp`` (MLP/MoE over all DP groups' tokens) as an all-reduce of the whole FULL
tensor followed by taking this rank's chunk (``DP_ALL_REDUCE_SLICE_ADD_NORM_GATHER``), the
pre-PR #28102 shape, so a benchmark can measure what the one reduce-scatter saves. It is not
a serving option: no spec, config or CLI reaches it; models always build the default plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .dp_geometry import Padding
from .groups import ParallelConfig
from .layouts import Layout

FUSION_MAX_TOKENS = 2048

# How a DP-attention boundary completes a sum owed to tp. "reduce_scatter" is the plan;
# "all_reduce" (all-reduce, then take this rank's chunk) exists for benchmarks only.
DP_COMBINES = ("reduce_scatter", "all_reduce")


class BoundaryKind(enum.Enum):
    # Model input: complete the embedding's sum; residual := h; h := norm(h).
    FIRST = "first"
    # Complete the owed sum with an all-reduce (none on a size-1 group), then add + norm.
    ALL_REDUCE_ADD_NORM = "all_reduce_add_norm"
    # Complete the owed sum inside the fused all-reduce + add + RMSNorm.
    FUSED_AR_ADD_NORM = "fused_ar_add_norm"
    # DP attention, model input: the embedding's sum is completed into this rank's chunk
    # (reduce-scatter over attn_tp); residual := chunk; norm; gather to the next layout.
    DP_FIRST = "dp_first"
    # DP attention: reduce-scatter the owed sum into this rank's chunk, add + norm, gather.
    DP_SCATTER_ADD_NORM_GATHER = "dp_scatter_add_norm_gather"
    # Benchmark-only (``dp_combine="all_reduce"``): all-reduce the FULL sum owed to tp, take this
    # rank's chunk, add + norm, gather. Never in a plan a model builds for serving.
    DP_ALL_REDUCE_SLICE_ADD_NORM_GATHER = "dp_all_reduce_slice_add_norm_gather"


@dataclass(frozen=True)
class Step:
    op: str  # ledger op name
    group: str
    # "complete": finishes a sum owed by the previous block; "gather": moves complete (normed)
    # tokens into the next block's layout (e.g. SUM_LEN's all-reduce of a zero-filled buffer).
    purpose: str = "complete"


@dataclass(frozen=True)
class BlockSpec:
    """What the communicator must know about one block of a model."""

    name: str  # e.g. "layers.3.mlp"
    layout: Layout  # where the block wants its tokens
    owes: str  # group its output owes a sum to, e.g. "attn_tp", "tp"


@dataclass(frozen=True)
class Boundary:
    site: str  # "<next block>.in" or "final.in"
    kind: BoundaryKind
    owed: str  # group the incoming value owes its sum to
    steps: tuple[Step, ...]
    gather_to: Layout = Layout.ATTN_TP_FULL  # DP attention: the layout the next block wants


@dataclass(frozen=True)
class ForwardPlan:
    fused: bool
    padding: Padding | None  # DP attention only
    boundaries: tuple[Boundary, ...]  # one before each block, then the final norm
    lm_head: tuple[Step, ...]

    def expected(self) -> list[tuple[str, str, str]]:
        """(site, op, group) of every collective of one forward, in order."""
        rows = [(b.site, s.op, s.group) for b in self.boundaries for s in b.steps]
        rows += [("lm_head", s.op, s.group) for s in self.lm_head]
        return rows

    def table(self) -> list[str]:
        """Human-readable rows, one per boundary with collectives."""
        return plan_table(self.expected())


def plan_table(rows: list[tuple[str, str, str]]) -> list[str]:
    """(site, op, group) rows -> one line per site, in order: "layers.1.mlp.in: all_reduce(tp)"."""
    sites: dict[str, list[str]] = {}
    for site, op, group in rows:
        sites.setdefault(site, []).append(f"{op}({group})")
    return [f"{site}: " + ", ".join(ops) for site, ops in sites.items()]


@dataclass(frozen=True)
class CommPlan:
    config: ParallelConfig
    fusion: bool
    unfused: ForwardPlan  # without DP attention; with it, the MAX_LEN variant
    fused: ForwardPlan | None  # None when fusion can never apply
    sum_len: ForwardPlan | None = None  # DP attention, SUM_LEN padding
    dp_combine: str = "reduce_scatter"  # benchmark-only alternative: "all_reduce" (see DP_COMBINES)

    def select(self, num_tokens: int, padding: Padding | None = None) -> ForwardPlan:
        if self.config.dp_attention:
            if padding is None:
                raise ValueError("DP attention needs the forward's padding mode")
            assert self.sum_len is not None
            return self.sum_len if padding is Padding.SUM_LEN else self.unfused
        if self.fused is not None and 0 < num_tokens <= FUSION_MAX_TOKENS:
            return self.fused
        return self.unfused

    def variants(self) -> list[ForwardPlan]:
        return [p for p in (self.unfused, self.fused, self.sum_len) if p is not None]


def vocab_group(config: ParallelConfig) -> str:
    """The group a vocab-parallel embedding / LM head is split over."""
    return "tp" if config.dp == 1 else "attn_tp"


def _group_size(config: ParallelConfig, name: str) -> int:
    sizes = {"tp": config.tp, "attn_tp": config.attn_tp, "dp": config.dp,
             "moe_ep": config.ep, "moe_tp": config.moe_tp}
    return sizes[name]


def _forward_plan(config: ParallelConfig, blocks: list[BlockSpec], fused: bool) -> ForwardPlan:
    def size(name: str) -> int:
        return _group_size(config, name)

    embed_group = vocab_group(config)
    boundaries: list[Boundary] = [
        Boundary(
            site=f"{blocks[0].name}.in",
            kind=BoundaryKind.FIRST,
            owed=embed_group,
            steps=(Step("all_reduce", embed_group),) if size(embed_group) > 1 else (),
        )
    ]
    for prev, nxt in zip(blocks, blocks[1:]):
        boundaries.append(_between(config, prev.owes, f"{nxt.name}.in", fused))
    # The final norm never takes the fused kernel (as in sglang: not the last layer).
    boundaries.append(_between(config, blocks[-1].owes, "final.in", fused=False))
    lm_head = (Step("all_gather", embed_group, "gather"),) if size(embed_group) > 1 else ()
    return ForwardPlan(fused=fused, padding=None, boundaries=tuple(boundaries), lm_head=lm_head)


def _dp_forward_plan(config: ParallelConfig, blocks: list[BlockSpec], padding: Padding,
                     dp_combine: str = "reduce_scatter") -> ForwardPlan:
    def scatter(owed: str) -> tuple[Step, ...]:
        if owed not in ("attn_tp", "tp"):
            raise NotImplementedError(f"DP attention: a block owing its sum to {owed!r} is not supported")
        if _group_size(config, owed) == 1:
            return ()
        return (Step(_combine_op(owed, dp_combine), owed),)

    def gather(layout: Layout) -> tuple[Step, ...]:
        if layout is Layout.FULL:
            return (Step("all_gather" if padding is Padding.MAX_LEN else "all_reduce", "tp", "gather"),)
        return (Step("all_gather", "attn_tp", "gather"),) if config.attn_tp > 1 else ()

    targets = [(f"{b.name}.in", b.layout) for b in blocks] + [("final.in", Layout.ATTN_TP_FULL)]
    owed = ["attn_tp"] + [b.owes for b in blocks]
    boundaries = []
    for i, ((site, layout), debt) in enumerate(zip(targets, owed)):
        if i == 0:
            kind = BoundaryKind.DP_FIRST
        elif _combine_op(debt, dp_combine) == "all_reduce":
            kind = BoundaryKind.DP_ALL_REDUCE_SLICE_ADD_NORM_GATHER
        else:
            kind = BoundaryKind.DP_SCATTER_ADD_NORM_GATHER
        boundaries.append(Boundary(site, kind, debt, scatter(debt) + gather(layout), gather_to=layout))
    lm_head = (Step("all_gather", "attn_tp", "gather"),) if config.attn_tp > 1 else ()
    return ForwardPlan(fused=False, padding=padding, boundaries=tuple(boundaries), lm_head=lm_head)


def _combine_op(owed: str, dp_combine: str) -> str:
    """The collective completing a sum owed to ``owed`` at a DP-attention boundary. Only the
    combine of blocks over all DP groups' tokens (owed to tp) has the benchmark alternative."""
    return "all_reduce" if owed == "tp" and dp_combine == "all_reduce" else "reduce_scatter"


def _between(config: ParallelConfig, owed: str, site: str, fused: bool) -> Boundary:
    if _group_size(config, owed) == 1:
        return Boundary(site, BoundaryKind.ALL_REDUCE_ADD_NORM, owed, ())
    if fused:
        return Boundary(site, BoundaryKind.FUSED_AR_ADD_NORM, owed, (Step("fused_ar_add_rmsnorm", owed),))
    return Boundary(site, BoundaryKind.ALL_REDUCE_ADD_NORM, owed, (Step("all_reduce", owed),))


def plan_communication(config: ParallelConfig, blocks: list[BlockSpec], fusion: bool, *,
                       dp_combine: str = "reduce_scatter") -> CommPlan:
    """The plan for a model's blocks under (tp, dp, ep) with fusion available or not.

    ``dp_combine`` is benchmark-only (bench/dp_ep_combine.py): "all_reduce" replaces, under DP
    attention, each reduce-scatter over tp by an all-reduce + this rank's chunk. Models never
    pass it; without DP attention it changes nothing.
    """
    if not blocks:
        raise ValueError("a model needs at least one block")
    if dp_combine not in DP_COMBINES:
        raise ValueError(f"dp_combine must be one of {DP_COMBINES}, not {dp_combine!r}")
    if config.dp_attention:
        return CommPlan(
            config=config,
            fusion=fusion,
            unfused=_dp_forward_plan(config, blocks, Padding.MAX_LEN, dp_combine),
            fused=None,
            sum_len=_dp_forward_plan(config, blocks, Padding.SUM_LEN, dp_combine),
            dp_combine=dp_combine,
        )
    can_fuse = fusion and config.tp > 1 and not config.dp_attention
    return CommPlan(
        config=config,
        fusion=fusion,
        unfused=_forward_plan(config, blocks, fused=False),
        fused=_forward_plan(config, blocks, fused=True) if can_fuse else None,
    )
