"""Mamba2 mixer (as HF's NemotronHMamba2Mixer computes it), heads split over a TP group.

    zxbcdt = in_proj(h)                       z: gate, xBC: conv input, dt: step per head
    xBC    = silu(causal_conv1d(xBC))         conv window continues from the sequence's state
    x,B,C  = split(xBC)
    dt     = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    y      = scan(x, dt, A, B, C) + D * x     chunked (prefill) or one step (decode), per sequence
    y      = rms_norm_per_group(y * silu(z)) * weight       groups of intermediate / n_groups
    out    = out_proj(y)                      row-parallel: a sum owed to the group

Sequences are packed (``batch.query_lens``); each has its own conv and SSM state in the
batch's ``MambaStateCache`` at ``batch.state_slots[i]``. A sequence with ``context_len ==
query_len`` starts from zero state; otherwise it continues from its slot (decode, chunked
prefill). dt is clamped in decode as in prefill (HF's torch decode step skips the clamp), so a
decode step equals the same token in a longer prefill. Each rank's heads cover whole norm
groups, so the gated norm needs no collective: that holds when the group size divides
n_groups (checked at construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from ..forward_batch import ForwardBatch
from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .linear import RowParallelLinear
from .mamba2_sharding import Mamba2Conv1d, Mamba2InProj, Mamba2Sharding
from .mamba_state import MambaStateCache, MambaStateShape
from .ssd_scan import ssd_chunk_scan, ssm_step
from .weight_source import WeightShapeError, WeightSource, copy_checked, expect_dim


@dataclass(frozen=True)
class Mamba2Config:
    hidden: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    time_step_limit: tuple[float, float]
    norm_eps: float
    proj_bias: bool = False
    conv_bias: bool = True
    activation: str = "silu"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim


class GatedRMSNorm(nn.Module):
    """rms_norm(x * silu(gate)) over groups of ``group_size`` channels; weight split like x."""

    def __init__(self, channels: int, group_size: int, channel_start: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        if channels % group_size:
            raise WeightShapeError(f"{channels} channels on this rank are not whole norm groups of {group_size}")
        self.group_size = group_size
        self.channel_start = channel_start
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels, dtype=dtype, device=device), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        if len(source.shape) != 1 or source.shape[0] < self.channel_start + param.shape[0]:
            raise WeightShapeError(f"{source.name}: checkpoint shape {source.shape} is too small for this rank")
        copy_checked(param, source.narrow(0, self.channel_start, param.shape[0]), source.name)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [n, channels] -> [n, channels] in x's dtype
        n, channels = x.shape
        h = x.float() * F.silu(gate.float())
        h = h.view(n, channels // self.group_size, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(n, channels).to(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, layer_id: int, cfg: Mamba2Config, group: Group, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if cfg.activation != "silu":
            raise WeightShapeError(f"mamba_hidden_act={cfg.activation!r} is not supported (only silu)")
        if cfg.n_groups % group.size:
            raise WeightShapeError(
                f"n_groups={cfg.n_groups} does not split over {group.size} attention-TP ranks: the gated "
                f"norm's groups (intermediate / n_groups channels) would span ranks")
        self.layer_id = layer_id
        self.cfg = cfg
        self.group = group
        self.sharding = s = Mamba2Sharding.for_group(cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size,
                                                     group)
        self.in_proj = Mamba2InProj(cfg.hidden, s, cfg.proj_bias, dtype, device)
        self.conv1d = Mamba2Conv1d(s, cfg.conv_kernel, cfg.conv_bias, dtype, device)
        # A_log, D and dt_bias stay in float32 whatever the model dtype (as sglang keeps A).
        self.A_log = nn.Parameter(torch.empty(s.heads, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.empty(s.heads, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(s.heads, device=device), requires_grad=False)
        self.norm = GatedRMSNorm(s.inner, cfg.intermediate // cfg.n_groups, s.head_start * cfg.head_dim,
                                 cfg.norm_eps, dtype, device)
        self.out_proj = RowParallelLinear(cfg.intermediate, cfg.hidden, group, cfg.proj_bias, dtype, device)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        """A_log, D, dt_bias: one value per head; this rank's heads."""
        expect_dim(source, 0, self.cfg.num_heads)
        copy_checked(param, source.narrow(0, self.sharding.head_start, self.sharding.heads), source.name)

    def state_shape(self) -> MambaStateShape:
        s = self.sharding
        return MambaStateShape(conv=(s.conv_channels, self.cfg.conv_kernel - 1),
                               ssm=(s.heads, self.cfg.head_dim, self.cfg.state_size))

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> Unreduced:
        # h: [n, hidden] -> owed [n, hidden]
        cache, slots = batch.state_cache, batch.state_slots
        if not isinstance(cache, MambaStateCache) or slots is None:
            raise ValueError("Mamba layers need batch.state_cache (a MambaStateCache) and batch.state_slots")
        if len(slots) != len(batch.query_lens):
            raise ValueError(f"{len(slots)} state slots for {len(batch.query_lens)} sequences")
        s = self.sharding
        z, xbc, dt = self.in_proj(h).split([s.inner, s.conv_channels, s.heads], dim=-1)
        conv_state, ssm_state = cache.conv[self.layer_id], cache.ssm[self.layer_id]
        fresh = [slot for slot, q, c in zip(slots, batch.query_lens, batch.context_lens) if q and c == q]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.long, device=conv_state.device)
            conv_state[index] = 0
            ssm_state[index] = 0
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.cfg.time_step_limit)
        y = torch.empty((h.shape[0], s.heads, self.cfg.head_dim), dtype=torch.float32, device=h.device)
        x_all = torch.empty((h.shape[0], s.heads, self.cfg.head_dim), dtype=torch.float32, device=h.device)
        starts = [0, *accumulate(batch.query_lens)][:-1]
        steps = [(start, slot) for start, slot, q in zip(starts, slots, batch.query_lens) if q == 1]
        if steps:
            self._decode(xbc, dt, A, steps, conv_state, ssm_state, y, x_all)
        for start, slot, q in zip(starts, slots, batch.query_lens):
            if q > 1:
                self._prefill(xbc[start : start + q], dt[start : start + q], A, slot, conv_state, ssm_state,
                              y[start : start + q], x_all[start : start + q])
        y = y + self.D.float()[:, None] * x_all
        y = self.norm(y.view(h.shape[0], s.inner), z)
        return Unreduced(self.out_proj(y.to(h.dtype)), self.group.name)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # xbc: [n, conv_channels] (after the conv) -> x [n, heads, hd], B, C [n, groups, state]
        s, n = self.sharding, xbc.shape[0]
        gn = s.groups * self.cfg.state_size
        x, B, C = xbc.split([s.inner, gn, gn], dim=-1)
        N = self.cfg.state_size
        return x.reshape(n, s.heads, self.cfg.head_dim), B.reshape(n, s.groups, N), C.reshape(n, s.groups, N)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, slot: int, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor, y_out: torch.Tensor, x_out: torch.Tensor) -> None:
        """One sequence of L > 1 tokens; continues from (and updates) its slot.
        xbc: [L, conv_channels]; dt: [L, heads]; y_out, x_out: [L, heads, hd] written"""
        conv = F.silu(self.conv1d.prefill(xbc, conv_state[slot]))
        x, B, C = self._split_xbc(conv)
        y, final = ssd_chunk_scan(x, dt, A, B, C, self.cfg.chunk_size, ssm_state[slot])
        ssm_state[slot] = final.to(ssm_state.dtype)
        y_out.copy_(y)
        x_out.copy_(x.float())

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, steps: list[tuple[int, int]],
                conv_state: torch.Tensor, ssm_state: torch.Tensor, y_out: torch.Tensor,
                x_out: torch.Tensor) -> None:
        """One token of each of several sequences, batched. steps: (row, slot) per sequence."""
        device = xbc.device
        rows = torch.tensor([r for r, _ in steps], dtype=torch.long, device=device)
        index = torch.tensor([slot for _, slot in steps], dtype=torch.long, device=device)
        conv, window = self.conv1d.step(xbc[rows], conv_state[index])
        conv_state[index] = window.to(conv_state.dtype)
        x, B, C = self._split_xbc(F.silu(conv))
        state = ssm_state[index]
        y = ssm_step(state, x, dt[rows], A, B, C)
        ssm_state[index] = state
        y_out[rows] = y
        x_out[rows] = x.float()
