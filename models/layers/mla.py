"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), heads split over attention-TP.

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) when q_lora_rank is None
             -> per head [nope | rope]
    c, k_r = kv_a_proj_with_mqa(x) -> [kv_lora_rank | rope]   (k_r: one rope key shared by all heads)
    k_nope, v = kv_b_proj(kv_a_layernorm(c)) -> per head [nope | v]
    k      = [k_nope | rope(k_r)],  q = [q_nope | rope(q_r)]
    out    = o_proj(softmax(q k^T * scale) v)

The latent projections (q_a, kv_a and their norms) are replicated; q_b / q_proj and kv_b are
column-parallel over heads, o_proj is row-parallel and leaves a sum owed to the attention-TP
group. The cache holds the expanded per-head K ([heads, nope+rope]) and V ([heads, v]) in the
paged ``KVCache`` (simplest correct choice; a latent cache of kv_lora_rank+rope per token with
absorbed kv_b is the memory-saving variant for later). ``attention_backend`` (chosen at
construction, see ``kernels.py``) attends over that cache; K and V have different head dims.
With ``fp8`` every projection keeps block-FP8 weights (``linear.py``); the latent norms stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .attention import AttentionBackend, paged_attention_reference
from .fp8_block import BlockFP8
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .mla_rotary import MLARotary
from .norm import RMSNorm
from .weight_source import WeightShapeError, named


@dataclass(frozen=True)
class MLADims:
    hidden: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj
    # eps of q_a_layernorm / kv_a_layernorm: DeepSeek's own code and HF leave these norms at
    # their default 1e-6 whatever rms_norm_eps says.
    latent_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @staticmethod
    def from_hf(config: Any) -> MLADims:
        return MLADims(
            hidden=int(config.hidden_size),
            num_heads=int(config.num_attention_heads),
            q_lora_rank=getattr(config, "q_lora_rank", None) or None,
            kv_lora_rank=int(config.kv_lora_rank),
            qk_nope_head_dim=int(config.qk_nope_head_dim),
            qk_rope_head_dim=int(config.qk_rope_head_dim),
            v_head_dim=int(config.v_head_dim),
            bias=bool(getattr(config, "attention_bias", False)),
        )


class MLAttention(nn.Module):
    def __init__(self, layer_id: int, dims: MLADims, group: Group, rotary: MLARotary, scale: float,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 attention_backend: AttentionBackend = paged_attention_reference, fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        self.attention = attention_backend
        if dims.num_heads % group.size:
            raise WeightShapeError(f"num_attention_heads={dims.num_heads} does not split over {group.size} ranks")
        self.layer_id = layer_id
        self.dims = dims
        self.group = group
        self.heads = dims.num_heads // group.size  # on this rank
        self.rotary = rotary
        self.scale = scale
        d, h = dims, dims.hidden
        q_out = d.num_heads * d.qk_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if d.q_lora_rank is None:
            self.q_proj = named("q_proj", lambda: ColumnParallelLinear(h, q_out, group, dtype=dtype, device=device,
                                                                       fp8=fp8))
        else:
            rank = d.q_lora_rank
            self.q_a_proj = ReplicatedLinear(h, rank, d.bias, dtype, device, fp8)
            self.q_a_layernorm = RMSNorm(rank, d.latent_eps, dtype, device)
            self.q_b_proj = named("q_b_proj", lambda: ColumnParallelLinear(rank, q_out, group, dtype=dtype,
                                                                           device=device, fp8=fp8))
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, d.kv_lora_rank + d.qk_rope_head_dim, d.bias, dtype, device,
                                                   fp8)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.latent_eps, dtype, device)
        self.kv_b_proj = named("kv_b_proj", lambda: ColumnParallelLinear(
            d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), group, dtype=dtype, device=device,
            fp8=fp8))
        self.o_proj = named("o_proj", lambda: RowParallelLinear(d.num_heads * d.v_head_dim, h, group, d.bias, dtype,
                                                                device, fp8))

    def kv_shape(self) -> tuple[int, int, int]:
        """(heads, k_dim, v_dim) this rank caches."""
        return self.heads, self.dims.qk_head_dim, self.dims.v_head_dim

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, heads, qk_head_dim]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.heads, self.dims.qk_head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> Unreduced:
        # x: [n, hidden] -> owed [n, hidden] to the attention-TP group
        d, n = self.dims, x.shape[0]
        q_nope, q_rope = self._queries(x).split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope.view(n, 1, d.qk_rope_head_dim))
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(n, self.heads, d.qk_nope_head_dim + d.v_head_dim)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(n, self.heads, d.qk_rope_head_dim)), dim=-1)
        o = self.attention(q, k, v.contiguous(), self.layer_id, batch, self.scale)  # [n, heads, v]
        return Unreduced(self.o_proj(o.reshape(n, self.heads * d.v_head_dim)), self.group.name)
