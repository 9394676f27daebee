"""The routed experts of one MoE layer that live on this rank, and how their weights load.

Experts are split over the ``moe_ep`` group: with E experts and ep ranks, global expert e lives
on moe_ep rank ``e // (E / ep)``. Each expert's intermediate dimension is split over the
``moe_tp`` group (column-parallel up/gate, row-parallel down). A rank therefore computes, for
every token, the contribution of its experts' intermediate slice: a partial sum that the sum
over all tp ranks (moe_ep x moe_tp = tp) completes. Nothing here communicates.

Compute: a Python loop over the local experts (reads their row counts on the host), or, chosen
at construction, ``fused``: the block computation of ``fused_moe.py`` (gated SiLU experts only;
no host sync, so CUDA graphs can capture it).

Two kinds of expert, chosen at construction:
- gated (DeepSeek SwiGLU): ``down(act(gate(x)) * up(x))``; parameter ``gate_up_proj``
  [E_local, 2*I_local, in] (gate rows first) and ``down_proj`` [E_local, in, I_local];
- non-gated (Nemotron-H relu²): ``down(act(up(x)))``; ``up_proj`` [E_local, I_local, in].

Checkpoint layouts, both accepted:
- per expert (real DeepSeek/Kimi/Nemotron checkpoints and what transformers' ``save_pretrained``
  writes): ``<prefix>.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` [I, in] / [in, I];
  other ranks' experts are skipped by name, never read.
- fused (transformers' in-memory layout, ``save_pretrained(save_original_format=False)``):
  ``<prefix>.experts.gate_up_proj`` [E, 2I, in] (or ``up_proj`` [E, I, in]) and
  ``<prefix>.experts.down_proj`` [E, in, I]; only this rank's experts are read.

Block FP8 (``fp8_block.py``, chosen at construction with ``fp8``): the weights are float8_e4m3fn
and ``gate_up_proj_scale_inv`` [E_local, 2*I_local/bn, ceil(in/bk)] / ``down_proj_scale_inv``
[E_local, ceil(in/bn), I_local/bk] hold their block scales, loaded from ``...{e}.{part}.weight_scale_inv``
(or the fused ``<prefix>.experts.{param}_scale_inv``). I_local must be whole blocks (gate and up
are concatenated, down's columns split over moe_tp): sglang's and vLLM's rule, refused otherwise.
Compute: ``fused_fp8`` (``fused_moe_fp8_triton.py`` on a GPU), else the loop with each expert
dequantized.

Folded shared experts (``shared`` > 0, chosen by ``moe.py``; ep 1 only): the layer's shared experts stored
as experts ``num_experts`` .. after the routed ones (global ids, and local slots, past the routed experts),
loaded from the checkpoint's ``<prefix>.shared_experts.{gate_proj,up_proj,down_proj}.weight`` (and scales),
their intermediate split over moe_tp like a routed expert's. The router gives every token their ids with
weight 1, so one fused launch computes routed and shared experts (sglang's shared-experts fusion).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from .fp8_block import FP8_DTYPE, BlockFP8, dequantize_weight
from .fused_moe import FusedExpertsFn, FusedFP8ExpertsFn
from .linear import fp8_block_aligned
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu2": lambda x: torch.relu(x).square(),
    "gelu": F.gelu,
}

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
                         r"\.weight(?P<scale>_scale_inv)?$")
_FUSED = re.compile(r"^(?P<module>.+\.experts)\.(?P<part>gate_up_proj|up_proj|down_proj)(?P<scale>_scale_inv)?$")
FUSED = "fused"  # shard id of a fused [E, ...] checkpoint tensor
SCALE = "_scale_inv"  # suffix of a block-FP8 weight's scales: ``gate_up_proj`` -> ``gate_up_proj_scale_inv``


@dataclass(frozen=True)
class ExpertTensorName:
    """A checkpoint tensor of routed experts: module path, expert (None = fused), part."""

    module: str  # e.g. "layers.3.mlp.experts"
    expert: int | None
    part: str  # gate_proj | up_proj | down_proj | gate_up_proj
    scale: bool = False  # the block-FP8 scales of that weight (``weight_scale_inv``)


def parse_expert_name(name: str) -> ExpertTensorName | None:
    """Recognise a routed-expert tensor name (``shared_experts`` are not routed experts)."""
    m = _PER_EXPERT.match(name)
    if m:
        return ExpertTensorName(m["module"], int(m["expert"]), m["part"], m["scale"] is not None)
    m = _FUSED.match(name)
    if m:
        return ExpertTensorName(m["module"], None, m["part"], m["scale"] is not None)
    return None


@dataclass(frozen=True)
class _ExpertDims:
    inter: int  # intermediate size in the checkpoint (elements or scale blocks)
    inter_local: int  # this rank's share of it
    start: int  # where this rank's share starts
    in_dim: int  # the expert's input / output width


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise WeightShapeError(f"{what}={total} does not split over {parts} ranks")
    return total // parts


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, in_dim: int, intermediate: int, ep: Group, moe_tp: Group,
                 gated: bool = True, activation: str = "silu", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, fused: FusedExpertsFn | None = None,
                 fp8: BlockFP8 | None = None, fused_fp8: FusedFP8ExpertsFn | None = None, shared: int = 0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}")
        if shared not in (0, 1) or (shared and ep.size > 1):
            raise ValueError(f"{shared} shared experts cannot fold into the routed ones (one, without expert "
                             f"parallelism: ep {ep.size})")
        self.num_experts = num_experts
        self.num_local = _split(num_experts, ep.size, "n_routed_experts")
        self.first = ep.rank * self.num_local  # global id of the first local expert
        self.shared = shared  # 1: the folded shared expert, id (and local slot) num_experts
        self.moe_tp = moe_tp
        self.intermediate = intermediate
        self.inter_local = _split(intermediate, moe_tp.size, "moe_intermediate_size")
        self.in_dim = in_dim
        self.gated = gated
        self.act = ACTIVATIONS[activation]
        up_rows = (2 if gated else 1) * self.inter_local
        self.fp8 = fp8
        if fp8 is not None:
            fp8_block_aligned(self.inter_local, fp8.block_n, f"expert intermediate rows {intermediate}: a shard",
                              fp8, moe_tp.size)
            if moe_tp.size > 1:
                fp8_block_aligned(self.inter_local, fp8.block_k, f"expert down-projection columns {intermediate}: "
                                  "a shard", fp8, moe_tp.size)
        wdtype = FP8_DTYPE if fp8 is not None else dtype

        def param(*shape: int, dt: torch.dtype = wdtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(self.num_local + shared, *shape, dtype=dt, device=device),
                                requires_grad=False)

        if gated:
            self.gate_up_proj = param(up_rows, in_dim)
        else:
            self.up_proj = param(up_rows, in_dim)
        self.down_proj = param(in_dim, self.inter_local)
        if fp8 is not None:  # registered after the weights: named_parameters order stays weights first
            up_scale = param(*fp8.scale_shape(up_rows, in_dim), dt=torch.float32)
            if gated:
                self.gate_up_proj_scale_inv = up_scale
            else:
                self.up_proj_scale_inv = up_scale
            self.down_proj_scale_inv = param(*fp8.scale_shape(in_dim, self.inter_local), dt=torch.float32)
        # The block computation (``fused_moe.py``: no host sync, CUDA-graph capturable) for gated
        # SiLU experts, chosen at construction; None = the per-expert loop below.
        silu = gated and activation == "silu"
        self.fused = fused if (silu and fp8 is None) else None
        self.fused_fp8 = fused_fp8 if (silu and fp8 is not None) else None

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"

    def is_local(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    @property
    def shared_ids(self) -> range:
        """The global (= local: ep 1) id of the folded shared expert, if any."""
        return range(self.num_experts, self.num_experts + self.shared)

    # --- loading ----------------------------------------------------------------------

    def shard_ids(self) -> dict[str, list[tuple[str, int]]]:
        """Parameter name -> the shard ids a complete per-expert load delivers."""
        local = [*range(self.first, self.first + self.num_local), *self.shared_ids]
        ups = ["gate_proj", "up_proj"] if self.gated else ["up_proj"]
        ids = {
            self.up_name: [(part, e) for e in local for part in ups],
            "down_proj": [("down_proj", e) for e in local],
        }
        if self.fp8 is None:
            return ids
        return {**{name + SCALE: list(v) for name, v in ids.items()}, **ids}  # scales first: longer names

    def checkpoint_target(self, name: ExpertTensorName) -> tuple[str, object] | None:
        """(our parameter, relative to this module; shard id) or None for another rank's expert."""
        if name.scale and self.fp8 is None:
            raise WeightShapeError(f"{name.module}: FP8 scales ({name.part} ...scale_inv) but this model keeps "
                                   "plain weights (config.json has no block-FP8 quantization_config)")
        suffix = SCALE if name.scale else ""
        if name.expert is None:
            param = "down_proj" if name.part == "down_proj" else self.up_name
            if name.part not in ("down_proj", self.up_name):
                raise WeightShapeError(f"{name.module}.{name.part}: not a tensor of "
                                       f"{'gated' if self.gated else 'non-gated'} experts")
            return param + suffix, FUSED
        if not 0 <= name.expert < self.num_experts:
            raise WeightShapeError(f"{name.module}.{name.expert}: expert id outside the "
                                   f"{self.num_experts} routed experts of config.json")
        if not self.is_local(name.expert):
            return None
        if name.part == "gate_proj" and not self.gated:
            raise WeightShapeError(f"{name.module}.{name.expert}.gate_proj: non-gated experts have no gate")
        param = "down_proj" if name.part == "down_proj" else self.up_name
        return param + suffix, (name.part, name.expert)

    def shared_checkpoint_target(self, part: str, scale: bool) -> tuple[str, object]:
        """(our parameter, shard id) of a folded shared expert's ``part`` (gate_proj / up_proj / down_proj):
        ``shared_experts.up_proj.weight`` -> ("gate_up_proj", ("up_proj", num_experts))."""
        if part not in ("gate_proj", "up_proj", "down_proj"):
            raise WeightShapeError(f"shared_experts.{part}: not a part of a gated expert")
        param = "down_proj" if part == "down_proj" else self.up_name
        return param + (SCALE if scale else ""), (part, self.num_experts)

    def checkpoint_name(self, part: str, expert: int) -> str:
        """The checkpoint's name of an expert's part, relative to the MoE block (messages, ``stacked_params``)."""
        return f"shared_experts.{part}" if expert in self.shared_ids else f"experts.{expert}.{part}"

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None
                      ) -> list[object] | None:
        """Load one per-expert tensor, or this rank's experts of a fused one (returns the shard
        ids a fused tensor filled)."""
        if shard_id == FUSED:
            return self._load_fused(param, source)
        if not isinstance(shard_id, tuple):
            raise TypeError(f"{source.name}: expert weights load per expert (shard id (part, expert))")
        part, expert = shard_id
        j = expert - self.first
        d = self._dims(param, part)
        if part == "down_proj":
            expect_dim(source, 0, d.in_dim)
            expect_dim(source, 1, d.inter)
            copy_checked(param[j], source.narrow(1, d.start, d.inter_local), source.name)
            return None
        expect_dim(source, 0, d.inter)
        expect_dim(source, 1, d.in_dim)
        offset = d.inter_local if (self.gated and part == "up_proj") else 0
        copy_checked(param[j].narrow(0, offset, d.inter_local), source.narrow(0, d.start, d.inter_local),
                     source.name)
        return None

    def _dims(self, param: nn.Parameter, part: str) -> _ExpertDims:
        """This rank's slice of an expert tensor, in elements (weights) or in blocks (FP8 scales)."""
        if self.fp8 is None or not any(param is p for n, p in self.named_parameters(recurse=False)
                                       if n.endswith(SCALE)):
            return _ExpertDims(self.intermediate, self.inter_local, self.moe_tp.rank * self.inter_local, self.in_dim)
        assert self.fp8 is not None
        # intermediate: rows of gate/up (block_n), columns of down (block_k); in_dim: the other side
        inter_unit, in_unit = (self.fp8.block_k, self.fp8.block_n) if part == "down_proj" else \
            (self.fp8.block_n, self.fp8.block_k)
        local = self.inter_local // inter_unit
        return _ExpertDims(self.intermediate // inter_unit, local, self.moe_tp.rank * local, -(-self.in_dim // in_unit))

    def _load_fused(self, param: nn.Parameter, source: WeightSource) -> list[object]:
        n = self.num_local
        expect_dim(source, 0, self.num_experts)
        mine = source.narrow(0, self.first, n)  # only this rank's experts are read
        ids: dict[str, list[object]] = {k: list(v) for k, v in self.shard_ids().items()}
        name = next(k for k, p in self.named_parameters(recurse=False) if p is param)
        d = self._dims(param, "down_proj" if name.startswith("down_proj") else "up_proj")
        routed = [sid for sid in ids[name] if sid[1] not in self.shared_ids]  # type: ignore[index]
        if name.startswith("down_proj"):
            expect_dim(source, 1, d.in_dim)
            expect_dim(source, 2, d.inter)
            copy_checked(param[:n], mine[:, :, d.start : d.start + d.inter_local], source.name)
            return routed
        parts = 2 if self.gated else 1
        expect_dim(source, 1, parts * d.inter)
        expect_dim(source, 2, d.in_dim)
        slices = [mine[:, p * d.inter + d.start : p * d.inter + d.start + d.inter_local] for p in range(parts)]
        copy_checked(param[:n], torch.cat(slices, dim=1), source.name)
        return routed

    # --- compute ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's addend of the routed output.

        x: [n, in]; ids: [n, k] global expert ids (-1 = none); weights: [n, k] -> partial [n, in]
        """
        if self.fused is not None or self.fused_fp8 is not None:
            local_ids = ids  # every expert here (ep 1): the global ids are the local ones, -1 stays -1
            if self.num_local != self.num_experts:
                mine = (ids >= self.first) & (ids < self.first + self.num_local)
                local_ids = torch.where(mine, ids - self.first, -1)
            if self.fused_fp8 is not None:
                assert self.fp8 is not None
                return self.fused_fp8(x, local_ids, weights, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                      self.down_proj, self.down_proj_scale_inv, self.fp8)
            assert self.fused is not None
            return self.fused(x, local_ids, weights, self.gate_up_proj, self.down_proj)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_local + self.shared)
        token, slot = mine.nonzero(as_tuple=True)
        expert = local[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        counts = torch.bincount(expert, minlength=self.num_local + self.shared).tolist()
        out = torch.zeros(x.shape[0], self.in_dim, dtype=torch.float32, device=x.device)
        start = 0
        for j, count in enumerate(counts):
            if count == 0:
                continue
            rows = token[start : start + count]
            h = F.linear(x[rows], self._expert_weight(self.up_name, j, x.dtype))
            if self.gated:
                gate, h_up = h.chunk(2, dim=-1)
                h = self.act(gate) * h_up
            else:
                h = self.act(h)
            y = F.linear(h, self._expert_weight("down_proj", j, x.dtype)).float() \
                * weights[rows, slot[start : start + count], None]
            out.index_add_(0, rows, y)
            start += count
        return out.to(x.dtype)

    def _expert_weight(self, name: str, j: int, dtype: torch.dtype) -> torch.Tensor:
        """Local expert j's ``name`` weight in the compute dtype (block FP8: dequantized, the reference)."""
        w: torch.Tensor = getattr(self, name)[j]
        if self.fp8 is None:
            return w
        return dequantize_weight(w, getattr(self, name + SCALE)[j], self.fp8, dtype)
