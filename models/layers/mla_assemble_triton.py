"""MLA's query and key rows in one Triton launch (GPU; CUDA-graph capturable).

Plain reference: ``mla.mla_assemble`` — RoPE of the query and key rope parts (``MLARotary``: cos and sin
of position x inv_freq times YaRN's attention factor, rounded to the activations' dtype; interleaved or
rotate-half pairs), the latent's RMSNorm, two concatenations: about twenty-five torch kernels a layer.
Here a program per (token, block of heads) copies the heads' absorbed queries and rotates their rope
parts into ``q [n, heads, rank + rope]``; one more program per token norms the latent and rotates the key's
rope part into ``k [n, 1, rank + rope]``. Each rounding follows the reference's (a product of two
activations-dtype values rounded before the sum, as torch's bf16 ops do), so the results agree to the
cos / sin kernels' last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mla import mla_assemble
from .mla_rotary import MLARotary
from .norm import RMSNorm

HEADS_PER_PROGRAM = 16


@triton.jit
def _rotate(src, mask, c, s, dtype: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rotated rope part at ``src`` (a pointer, or a column of row pointers) as (first, second) halves."""
    i = tl.arange(0, HALF)
    if INTERLEAVE:
        x1 = tl.load(src + 2 * i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    return first.to(dtype), second.to(dtype)


@triton.jit
def _assemble_kernel(q_abs_ptr, q_rope_ptr, latent_ptr, k_rope_ptr, pos_ptr, inv_ptr, norm_w_ptr, q_ptr, k_ptr,
                     factor, eps, heads, stride_at, stride_ah, stride_rt, stride_rh, stride_lt, stride_kt,
                     stride_qt, stride_qh, stride_ot,
                     RANK: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    i = tl.arange(0, HALF)
    freqs = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i)
    c = (tl.cos(freqs) * factor).to(dtype).to(tl.float32)  # as the reference: cos, sin in the activations' dtype
    s = (tl.sin(freqs) * factor).to(dtype).to(tl.float32)
    r = tl.arange(0, RANK)
    if j * HB < heads:  # a block of heads: [q_abs | rope(q_rope)]
        h = (j * HB + tl.arange(0, HB))[:, None]
        ok = h < heads
        rows = q_ptr + t * stride_qt + h.to(tl.int64) * stride_qh
        q_abs = tl.load(q_abs_ptr + t * stride_at + h.to(tl.int64) * stride_ah + r[None, :], mask=ok, other=0.0)
        tl.store(rows + r[None, :], q_abs, mask=ok)
        q_first, q_second = _rotate(q_rope_ptr + t * stride_rt + h.to(tl.int64) * stride_rh, ok, c, s, dtype,
                                    HALF, INTERLEAVE)
        tl.store(rows + RANK + i[None, :], q_first, mask=ok)
        tl.store(rows + RANK + HALF + i[None, :], q_second, mask=ok)
    else:  # the key: [norm(latent) | rope(k_rope)]
        x = tl.load(latent_ptr + t * stride_lt + r).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / RANK + eps)).to(dtype)
        w = tl.load(norm_w_ptr + r)
        tl.store(k_ptr + t * stride_ot + r, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype))
        k_first, k_second = _rotate(k_rope_ptr + t * stride_kt, True, c, s, dtype, HALF, INTERLEAVE)
        tl.store(k_ptr + t * stride_ot + RANK + i, k_first)
        tl.store(k_ptr + t * stride_ot + RANK + HALF + i, k_second)


def mla_assemble_triton(q_abs: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                        positions: torch.Tensor, rotary: MLARotary, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``mla.mla_assemble`` (same arguments and result); strided views in, fresh rows out."""
    n, heads, rank = q_abs.shape
    rope = q_rope.shape[-1]
    half = rope // 2
    if (rank & (rank - 1) or half & (half - 1) or rotary.inv_freq.shape[0] != half
            or any(t.stride(-1) != 1 for t in (q_abs, q_rope, latent, k_rope))):
        return mla_assemble(q_abs, q_rope, latent, k_rope, positions, rotary, norm)
    positions = positions.contiguous()  # read at unit stride (a no-op for the engine's buffers)
    q = torch.empty(n, heads, rank + rope, dtype=q_abs.dtype, device=q_abs.device)
    k = torch.empty(n, 1, rank + rope, dtype=q_abs.dtype, device=q_abs.device)
    if n:
        blocks = triton.cdiv(heads, HEADS_PER_PROGRAM)
        _assemble_kernel[(n, blocks + 1)](
            q_abs, q_rope, latent, k_rope, positions, rotary.inv_freq, norm.weight, q, k,
            float(rotary.attention_factor), float(norm.eps), heads, q_abs.stride(0), q_abs.stride(1),
            q_rope.stride(0), q_rope.stride(1), latent.stride(0), k_rope.stride(0), q.stride(0), q.stride(1),
            k.stride(0), RANK=rank, HALF=half, HB=HEADS_PER_PROGRAM, INTERLEAVE=rotary.interleave, num_warps=4)
    return q, k
