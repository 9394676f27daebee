"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), heads split over attention-TP, absorbed.

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) when q_lora_rank is None
             -> per head [q_nope | q_rope]
    c, k_r = kv_a_proj_with_mqa(x) -> [kv_lora_rank | rope];  c = kv_a_layernorm(c)
    kv_b_proj's weight per head = [W_UK (nope x kv_lora_rank) ; W_UV (v x kv_lora_rank)]
    HF's expanded form:  k = [W_UK c | rope(k_r)],  v = W_UV c,  out = o_proj(softmax(q k^T * scale) v)

The same attention, absorbed (as sglang and vLLM serve DeepSeek-V3): q_nope . (W_UK c) = (q_nope W_UK) . c
and softmax(.) (W_UV c) = W_UV (softmax(.) c), so with

    q_abs = q_nope W_UK                      [n, heads, kv_lora_rank]
    q     = [q_abs | rope(q_r)]              [n, heads, kv_lora_rank + rope]
    K     = [c | rope(k_r)]                  [n, 1, kv_lora_rank + rope]   one KV head shared by every head
    V     = c = K's first kv_lora_rank columns
    out   = o_proj(W_UV (softmax(q K^T * scale) V))

attention runs as GQA with a single KV head (the group = this rank's heads) over a latent cache that
holds one [c | rope(k_r)] row per token: ``KVShape(1, kv_lora_rank + rope, kv_lora_rank, v_in_k=True)``,
K alone stored and V read as its first kv_lora_rank columns (``KVCache.v_in_k``), so a token costs
(512 + 64) x 2 bytes per layer in bf16 on DeepSeek-V3 — not heads x (192 + 128) x 2 (80 KiB at 128
heads) as the expanded cache did — and a decode step reads each cached token once for all heads.
The scale is unchanged (1/sqrt(qk_head_dim), times YaRN's mscale²). Every step kind (prefill,
chunked prefill over a cached prefix, decode, chain and tree verify) runs this one form: absorbed
prefill does more attention FLOPs than the expanded form would (K 576 / V 512 per head against
192 / 128), the price of one cache layout and one mechanism.

The latent projections (q_a, kv_a and their norms) are replicated, q_a and kv_a as one matmul of x
(``fused_qkv_a_proj_with_mqa``, loaded from the checkpoint's two tensors; in block FP8 when q_lora_rank is
whole blocks); q_b / q_proj and kv_b are column-parallel over heads (W_UK / W_UV are this rank's heads'
slices), o_proj is row-parallel and leaves a sum owed to the attention-TP group. ``kv_b_proj`` holds the
checkpoint's weight and is not multiplied by: ``derive_from_weights`` (run by the loader and by random
init once the weights are in) copies its halves into ``w_uk`` / ``w_uv`` in the compute dtype, dequantized
from block FP8 when the layer keeps FP8 weights (what sglang does). Chosen at construction (see
``kernels.py``): ``attention_backend`` attends over the cache; ``assemble`` builds its query and key rows
(RoPE, the latent norm, the concatenations: ``mla_assemble`` or one Triton launch); ``norm_kernel`` runs
the latent norms; ``absorb``: the products with W_UK and W_UV (``absorb_q`` / ``absorb_v``: the bmm with the
compute-dtype halves; on a GPU, at one row, ``mla_absorb_triton.py`` reads kv_b's block-FP8 weight itself). With
``fp8`` every projection keeps block-FP8 weights (``linear.py``); the latent norms stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..forward_batch import ForwardBatch, KVShape
from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .attention import AttentionBackend, paged_attention_reference
from .fp8_block import BlockFP8, dequantize_weight
from .linear import ColumnParallelLinear, MergedReplicatedLinear, ReplicatedLinear, RowParallelLinear
from .mla_rotary import MLARotary
from .norm import RMSNorm
from .weight_source import WeightShapeError, named


def mla_assemble(q_abs: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 positions: torch.Tensor, rotary: MLARotary, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed attention's query and key rows, plain reference: q = [q_abs | rope(q_rope)],
    k = [norm(latent) | rope(k_rope)].

    q_abs: [n, heads, rank]; q_rope: [n, heads, rope]; latent: [n, rank]; k_rope: [n, rope]; positions: [n]
    -> q [n, heads, rank + rope], k [n, 1, rank + rope]. ``mla_assemble_triton.py``: the same in one launch.
    """
    (n, rank), rope = latent.shape, k_rope.shape[-1]
    q_rope, k_rope = rotary(positions, q_rope, k_rope.view(n, 1, rope))
    return torch.cat((q_abs, q_rope), dim=-1), torch.cat((norm(latent).view(n, 1, rank), k_rope), dim=-1)


# q_a_proj and kv_a_proj_with_mqa's checkpoint tensors -> the merged matmul's parts (``stacked_params`` rows)
MERGED_QKV_A: tuple[tuple[str, str, object], ...] = (
    (".fused_qkv_a_proj_with_mqa.", ".q_a_proj.", 0),
    (".fused_qkv_a_proj_with_mqa.", ".kv_a_proj_with_mqa.", 1),
)

MLAAssembleFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, MLARotary, RMSNorm],
                         tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVBFP8:
    """``kv_b_proj``'s block-FP8 weight as loaded (this rank's heads): e4m3 ``weight`` [heads x (nope + v), rank],
    its ``scale_inv`` per block of ``fmt``, and each head's split into W_UK's ``nope`` rows and W_UV's ``v`` rows."""
    weight: torch.Tensor
    scale_inv: torch.Tensor
    fmt: BlockFP8
    nope: int
    v: int


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor, fp8: KVBFP8 | None = None) -> torch.Tensor:
    """q_abs = q_nope W_UK per head: [n, heads, nope] x [heads, nope, rank] -> [n, heads, rank] (plain reference:
    the compute-dtype W_UK; ``mla_absorb_triton.py`` reads the block-FP8 weight instead at one row)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def absorb_v(o: torch.Tensor, w_uv: torch.Tensor, fp8: KVBFP8 | None = None) -> torch.Tensor:
    """W_UV's product per head: [n, heads, rank] x [heads, v, rank]^T -> [n, heads, v] (plain reference, as
    ``absorb_q``)."""
    return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


# (rows [n, heads, d_in], the compute-dtype W_UK / W_UV, kv_b in block FP8 or None) -> [n, heads, d_out]
MLAAbsorbFn = Callable[[torch.Tensor, torch.Tensor, "KVBFP8 | None"], torch.Tensor]


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
                 attention_backend: AttentionBackend = paged_attention_reference, fp8: BlockFP8 | None = None,
                 assemble: MLAAssembleFn = mla_assemble,
                 norm_kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
                 absorb: tuple[MLAAbsorbFn, MLAAbsorbFn] = (absorb_q, absorb_v)) -> None:
        super().__init__()
        self.attention = attention_backend
        self.assemble = assemble
        self.absorb_q, self.absorb_v = absorb
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
        kv_out = d.kv_lora_rank + d.qk_rope_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        self.kv_a_proj_with_mqa: ReplicatedLinear | None = None
        self.fused_qkv_a_proj_with_mqa: MergedReplicatedLinear | None = None
        if d.q_lora_rank is None:
            self.q_proj = named("q_proj", lambda: ColumnParallelLinear(h, q_out, group, dtype=dtype, device=device,
                                                                       fp8=fp8))
        else:
            rank = d.q_lora_rank
            if fp8 is None or rank % fp8.block_n == 0:  # q_a and kv_a as one matmul of x (as sglang does)
                self.fused_qkv_a_proj_with_mqa = MergedReplicatedLinear(h, [rank, kv_out], d.bias, dtype, device, fp8)
            else:
                self.q_a_proj = ReplicatedLinear(h, rank, d.bias, dtype, device, fp8)
            self.q_a_layernorm = RMSNorm(rank, d.latent_eps, dtype, device, norm_kernel)
            self.q_b_proj = named("q_b_proj", lambda: ColumnParallelLinear(rank, q_out, group, dtype=dtype,
                                                                           device=device, fp8=fp8))
        if self.fused_qkv_a_proj_with_mqa is None:
            self.kv_a_proj_with_mqa = ReplicatedLinear(h, kv_out, d.bias, dtype, device, fp8)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.latent_eps, dtype, device, norm_kernel)
        self.kv_b_proj = named("kv_b_proj", lambda: ColumnParallelLinear(
            d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), group, dtype=dtype, device=device,
            fp8=fp8))
        self.o_proj = named("o_proj", lambda: RowParallelLinear(d.num_heads * d.v_head_dim, h, group, d.bias, dtype,
                                                                device, fp8))
        # kv_b_proj's halves per local head, made by derive_from_weights (NaN until then, so a forward
        # before it shows): W_UK [heads, nope, kv_lora_rank], W_UV [heads, v, kv_lora_rank].
        nan = float("nan")
        self.w_uk: torch.Tensor
        self.w_uv: torch.Tensor
        self.register_buffer("w_uk", torch.full((self.heads, d.qk_nope_head_dim, d.kv_lora_rank), nan, dtype=dtype,
                                                device=device), persistent=False)
        self.register_buffer("w_uv", torch.full((self.heads, d.v_head_dim, d.kv_lora_rank), nan, dtype=dtype,
                                                device=device), persistent=False)
        # kv_b_proj's block-FP8 weight for the absorbed products' FP8 kernels (derive_from_weights; None: bf16 / fp32
        # weights)
        self.kv_b_fp8: KVBFP8 | None = None

    @torch.no_grad()
    def derive_from_weights(self) -> None:
        """W_UK / W_UV from ``kv_b_proj``'s loaded weight (dequantized once when it is block FP8)."""
        d, proj = self.dims, self.kv_b_proj
        w: torch.Tensor = proj.weight
        if proj.weight_scale_inv is not None:
            assert proj.fp8 is not None
            self.kv_b_fp8 = KVBFP8(proj.weight, proj.weight_scale_inv, proj.fp8, d.qk_nope_head_dim, d.v_head_dim)
            w = dequantize_weight(w, proj.weight_scale_inv, proj.fp8, self.w_uk.dtype)
        w = w.view(self.heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        self.w_uk.copy_(w[:, : d.qk_nope_head_dim])
        self.w_uv.copy_(w[:, d.qk_nope_head_dim :])

    def kv_shape(self) -> KVShape:
        """The latent cache this rank keeps: one KV head of [c | rope] (kv_lora_rank + rope), V = c."""
        d = self.dims
        return KVShape(1, d.kv_lora_rank + d.qk_rope_head_dim, d.kv_lora_rank, v_in_k=True)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [n, hidden] -> q [n, heads, qk_head_dim], kv_a's output [n, kv_lora_rank + rope]
        d = self.dims
        if self.fused_qkv_a_proj_with_mqa is not None:
            assert d.q_lora_rank is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q_latent, kv = self.fused_qkv_a_proj_with_mqa(x).split(
                [d.q_lora_rank, d.kv_lora_rank + d.qk_rope_head_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_latent))
        else:
            assert self.kv_a_proj_with_mqa is not None
            kv = self.kv_a_proj_with_mqa(x)
            if self.q_proj is not None:
                q = self.q_proj(x)
            else:
                assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.heads, d.qk_head_dim), kv

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> Unreduced:
        # x: [n, hidden] -> owed [n, hidden] to the attention-TP group
        d, n, rank = self.dims, x.shape[0], self.dims.kv_lora_rank
        q, kv = self._projections(x)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent, k_rope = kv.split([rank, d.qk_rope_head_dim], dim=-1)
        q_abs = self.absorb_q(q_nope, self.w_uk, self.kv_b_fp8)  # [n, heads, rank]
        # q [n, heads, rank + rope], k [n, 1, rank + rope]
        q, k = self.assemble(q_abs, q_rope, latent, k_rope, batch.positions, self.rotary, self.kv_a_layernorm)
        o = self.attention(q, k, k[..., :rank], self.layer_id, batch, self.scale)  # [n, heads, rank]
        o = self.absorb_v(o, self.w_uv, self.kv_b_fp8)  # [n, heads, v]
        return Unreduced(self.o_proj(o.reshape(n, self.heads * d.v_head_dim)), self.group.name)
