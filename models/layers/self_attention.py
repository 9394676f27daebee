"""GQA self-attention block: qkv projection, optional RoPE, paged attention, output projection.

Heads are split over the attention-TP group; the output projection leaves a sum owed to it.
The attention implementation is chosen at construction (``attention_backend``; default: the
plain reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .attention import AttentionBackend, paged_attention_reference
from .attention_layout import AttentionDims
from .linear import QKVParallelLinear, RowParallelLinear
from .rotary import RotaryEmbedding

# (x [n, K], weight, bias, positions [n], inv_freq [d/2], q_size, kv_size) -> (q, k, v) [n, size]: the qkv
# projection with q and k rotated, as one op (``linear_triton.decode_qkv_rope``); for full-width RoPE only.
QKVRopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int, int],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class SelfAttention(nn.Module):
    def __init__(self, layer_id: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 group: Group, rotary: RotaryEmbedding | None, qkv_bias: bool = False, o_bias: bool = False,
                 input_size: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 attention_backend: AttentionBackend | None = None, qkv_rope: QKVRopeFn | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention: AttentionBackend = attention_backend or paged_attention_reference
        self.group = group
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(input_size or hidden, head_dim, num_heads, num_kv_heads, group,
                                          bias=qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, group, bias=o_bias, dtype=dtype, device=device)
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        # The projection and RoPE as one op where one was given and the rotation covers whole heads.
        self.qkv_rope = qkv_rope if rotary is not None and rotary.rotary_dim == head_dim else None
        self.project: Callable[[torch.Tensor, ForwardBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (
            self._project_fused if self.qkv_rope is not None else self._project)

    def attention_dims(self) -> AttentionDims:
        """Heads and dims on this rank (what an attention planner needs)."""
        return AttentionDims(self.qkv_proj.q_heads, self.qkv_proj.kv_heads, self.head_dim, self.scale)

    def kv_shape(self) -> tuple[int, int]:
        """(kv_heads, head_dim) this rank caches."""
        return self.qkv_proj.kv_heads, self.head_dim

    def _project(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        q, k, v = self.qkv_proj(h)
        q = q.view(n, self.qkv_proj.q_heads, self.head_dim)
        k = k.view(n, self.qkv_proj.kv_heads, self.head_dim)
        v = v.view(n, self.qkv_proj.kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        return q, k, v

    def _project_fused(self, h: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.qkv_rope is not None and self.rotary is not None
        n, proj = h.shape[0], self.qkv_proj
        q, k, v = self.qkv_rope(h, proj.weight, proj.bias, batch.positions, self.rotary.inv_freq, proj.q_size,
                                proj.kv_size)
        return (q.view(n, proj.q_heads, self.head_dim), k.view(n, proj.kv_heads, self.head_dim),
                v.view(n, proj.kv_heads, self.head_dim))

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> Unreduced:
        # h: [n, hidden] (or [n, input_size]) -> owed [n, hidden]
        n = h.shape[0]
        q, k, v = self.project(h, batch)
        o = self.attention(q, k, v, self.layer_id, batch, self.scale)
        return Unreduced(self.o_proj(o.reshape(n, self.qkv_proj.q_size)), self.group.name)
