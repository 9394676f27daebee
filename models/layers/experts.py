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
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from .fused_moe import FusedExpertsFn
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu2": lambda x: torch.relu(x).square(),
    "gelu": F.gelu,
}

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<module>.+\.experts)\.(?P<part>gate_up_proj|up_proj|down_proj)$")
FUSED = "fused"  # shard id of a fused [E, ...] checkpoint tensor


@dataclass(frozen=True)
class ExpertTensorName:
    """A checkpoint tensor of routed experts: module path, expert (None = fused), part."""

    module: str  # e.g. "layers.3.mlp.experts"
    expert: int | None
    part: str  # gate_proj | up_proj | down_proj | gate_up_proj


def parse_expert_name(name: str) -> ExpertTensorName | None:
    """Recognise a routed-expert tensor name (``shared_experts`` are not routed experts)."""
    m = _PER_EXPERT.match(name)
    if m:
        return ExpertTensorName(m["module"], int(m["expert"]), m["part"])
    m = _FUSED.match(name)
    if m:
        return ExpertTensorName(m["module"], None, m["part"])
    return None


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise WeightShapeError(f"{what}={total} does not split over {parts} ranks")
    return total // parts


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, in_dim: int, intermediate: int, ep: Group, moe_tp: Group,
                 gated: bool = True, activation: str = "silu", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, fused: FusedExpertsFn | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}")
        self.num_experts = num_experts
        self.num_local = _split(num_experts, ep.size, "n_routed_experts")
        self.first = ep.rank * self.num_local  # global id of the first local expert
        self.moe_tp = moe_tp
        self.intermediate = intermediate
        self.inter_local = _split(intermediate, moe_tp.size, "moe_intermediate_size")
        self.in_dim = in_dim
        self.gated = gated
        self.act = ACTIVATIONS[activation]
        up_rows = (2 if gated else 1) * self.inter_local
        up = nn.Parameter(torch.empty(self.num_local, up_rows, in_dim, dtype=dtype, device=device),
                          requires_grad=False)
        if gated:
            self.gate_up_proj = up
        else:
            self.up_proj = up
        self.down_proj = nn.Parameter(
            torch.empty(self.num_local, in_dim, self.inter_local, dtype=dtype, device=device), requires_grad=False)
        # The block computation (``fused_moe.py``: no host sync, CUDA-graph capturable) for gated
        # SiLU experts, chosen at construction; None = the per-expert loop below.
        self.fused = fused if (gated and activation == "silu") else None

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"

    def is_local(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    # --- loading ----------------------------------------------------------------------

    def shard_ids(self) -> dict[str, list[tuple[str, int]]]:
        """Parameter name -> the shard ids a complete per-expert load delivers."""
        local = range(self.first, self.first + self.num_local)
        ups = ["gate_proj", "up_proj"] if self.gated else ["up_proj"]
        return {
            self.up_name: [(part, e) for e in local for part in ups],
            "down_proj": [("down_proj", e) for e in local],
        }

    def checkpoint_target(self, name: ExpertTensorName) -> tuple[str, object] | None:
        """(our parameter, relative to this module; shard id) or None for another rank's expert."""
        if name.expert is None:
            param = "down_proj" if name.part == "down_proj" else self.up_name
            if name.part not in ("down_proj", self.up_name):
                raise WeightShapeError(f"{name.module}.{name.part}: not a tensor of "
                                       f"{'gated' if self.gated else 'non-gated'} experts")
            return param, FUSED
        if not 0 <= name.expert < self.num_experts:
            raise WeightShapeError(f"{name.module}.{name.expert}: expert id outside the "
                                   f"{self.num_experts} routed experts of config.json")
        if not self.is_local(name.expert):
            return None
        if name.part == "gate_proj" and not self.gated:
            raise WeightShapeError(f"{name.module}.{name.expert}.gate_proj: non-gated experts have no gate")
        param = "down_proj" if name.part == "down_proj" else self.up_name
        return param, (name.part, name.expert)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None
                      ) -> list[object] | None:
        """Load one per-expert tensor, or this rank's experts of a fused one (returns the shard
        ids a fused tensor filled)."""
        i_l, r = self.inter_local, self.moe_tp.rank
        if shard_id == FUSED:
            return self._load_fused(param, source)
        if not isinstance(shard_id, tuple):
            raise TypeError(f"{source.name}: expert weights load per expert (shard id (part, expert))")
        part, expert = shard_id
        j = expert - self.first
        if part == "down_proj":
            expect_dim(source, 0, self.in_dim)
            expect_dim(source, 1, self.intermediate)
            copy_checked(param[j], source.narrow(1, r * i_l, i_l), source.name)
            return None
        expect_dim(source, 0, self.intermediate)
        expect_dim(source, 1, self.in_dim)
        offset = i_l if (self.gated and part == "up_proj") else 0
        copy_checked(param[j].narrow(0, offset, i_l), source.narrow(0, r * i_l, i_l), source.name)
        return None

    def _load_fused(self, param: nn.Parameter, source: WeightSource) -> list[object]:
        i_l, r, n = self.inter_local, self.moe_tp.rank, self.num_local
        expect_dim(source, 0, self.num_experts)
        mine = source.narrow(0, self.first, n)  # only this rank's experts are read
        ids: dict[str, list[object]] = {k: list(v) for k, v in self.shard_ids().items()}
        if param is self.down_proj:
            expect_dim(source, 1, self.in_dim)
            expect_dim(source, 2, self.intermediate)
            copy_checked(param, mine[:, :, r * i_l : (r + 1) * i_l], source.name)
            return ids["down_proj"]
        parts = 2 if self.gated else 1
        expect_dim(source, 1, parts * self.intermediate)
        expect_dim(source, 2, self.in_dim)
        slices = [mine[:, p * self.intermediate + r * i_l : p * self.intermediate + (r + 1) * i_l]
                  for p in range(parts)]
        copy_checked(param, torch.cat(slices, dim=1), source.name)
        return ids[self.up_name]

    # --- compute ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's addend of the routed output.

        x: [n, in]; ids: [n, k] global expert ids (-1 = none); weights: [n, k] -> partial [n, in]
        """
        if self.fused is not None:
            mine = (ids >= self.first) & (ids < self.first + self.num_local)
            return self.fused(x, torch.where(mine, ids - self.first, -1), weights, self.gate_up_proj, self.down_proj)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_local)
        token, slot = mine.nonzero(as_tuple=True)
        expert = local[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot, expert = token[order], slot[order], expert[order]
        counts = torch.bincount(expert, minlength=self.num_local).tolist()
        up = self.gate_up_proj if self.gated else self.up_proj
        out = torch.zeros(x.shape[0], self.in_dim, dtype=torch.float32, device=x.device)
        start = 0
        for j, count in enumerate(counts):
            if count == 0:
                continue
            rows = token[start : start + count]
            h = F.linear(x[rows], up[j])
            if self.gated:
                gate, h_up = h.chunk(2, dim=-1)
                h = self.act(gate) * h_up
            else:
                h = self.act(h)
            y = F.linear(h, self.down_proj[j]).float() * weights[rows, slot[start : start + count], None]
            out.index_add_(0, rows, y)
            start += count
        return out.to(x.dtype)
