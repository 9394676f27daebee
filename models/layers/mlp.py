"""Feed-forward blocks split over a group; the down projection leaves a sum owed to it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .fp8_block import BlockFP8
from .linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

# (x [n, K], weight [2I, K] = [gate; up], bias) -> silu(x gate^T) * (x up^T) [n, I]: a matmul and the activation
# as one op (``linear_triton.decode_gate_up_silu``).
GateUpActFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The plain reference of the gated activation. x: [n, 2*I] (gate | up) -> [n, I]"""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). ``act``: a fused ``silu_and_mul``; ``gate_up_act``: the gate/up
    matmul and the activation as one op (bf16/fp16 weights; ``fp8``: block-FP8 weights, ``linear.py``, never
    through it) — both chosen at construction."""

    def __init__(self, hidden: int, intermediate: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None, fp8: BlockFP8 | None = None,
                 gate_up_act: GateUpActFn | None = None) -> None:
        super().__init__()
        self.group = group
        self.act = act or silu_and_mul
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], group, bias,
                                                       dtype, device, fp8)
        self.down_proj = RowParallelLinear(intermediate, hidden, group, bias, dtype, device, fp8)
        self.gate_up_act = gate_up_act if fp8 is None else None
        self.activated: Callable[[torch.Tensor], torch.Tensor] = (
            self._fused if self.gate_up_act is not None else self._separate)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_act is not None
        return self.gate_up_act(x, self.gate_up_proj.weight, self.gate_up_proj.bias)

    def _separate(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> Unreduced:
        # x: [n, hidden] -> owed [n, hidden]
        return Unreduced(self.down_proj(self.activated(x)), self.group.name)


class Relu2MLP(nn.Module):
    """Non-gated squared-ReLU MLP (Nemotron-H): down(relu(up(x))**2)."""

    def __init__(self, hidden: int, intermediate: int, group: Group, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.group = group
        self.up_proj = ColumnParallelLinear(hidden, intermediate, group, bias, dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, group, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> Unreduced:
        # x: [n, hidden] -> owed [n, hidden]
        return Unreduced(self.down_proj(torch.relu(self.up_proj(x)).square()), self.group.name)
