"""Rotary embedding of MLA's rope dims: YaRN scaling and DeepSeek's interleaved pairs.

As HF ``DeepseekV3`` does it:
- frequencies: default, or YaRN (``rope_type "yarn"``: ``factor``, ``beta_fast``/``beta_slow``,
  ``original_max_position_embeddings``, ``truncate``), or the types ``rotary.py`` knows;
- YaRN's ``attention_factor`` (from ``mscale``/``mscale_all_dim``) multiplies cos and sin;
- the softmax scale is ``qk_head_dim**-0.5``, times ``yarn_mscale(factor, mscale_all_dim)**2``
  when the rope is scaled and ``mscale_all_dim`` is set (``mla_softmax_scale``);
- ``rope_interleave``: dims are pairs (x0, x1), (x2, x3), ... each rotated by one frequency,
  and the result is laid out de-interleaved, ``[x_even rotated, x_odd rotated]`` (HF's
  ``apply_rotary_pos_emb_interleave``). Without it: rotate-half as in Llama. Queries and keys
  get the same layout, so their dot products are the checkpoint's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .rotary import rope_inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(params: dict[str, Any] | None) -> str:
    params = params or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def yarn_inv_freq(dim: int, theta: float, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention_factor) exactly as transformers' ``_compute_yarn_parameters``."""
    factor = params.get("factor")
    original = float(params["original_max_position_embeddings"])
    if factor is None:
        factor = max_position / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, params: dict[str, Any] | None) -> float:
    scale = qk_head_dim ** -0.5
    if _rope_type(params) != "default" and params and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLARotary(nn.Module):
    def __init__(self, rope_dim: int, theta: float, params: dict[str, Any] | None, max_position: int,
                 interleave: bool) -> None:
        super().__init__()
        self.interleave = interleave
        if _rope_type(params) == "yarn":
            assert params is not None
            inv_freq, self.attention_factor = yarn_inv_freq(rope_dim, theta, params, max_position)
        else:
            inv_freq, self.attention_factor = rope_inv_freq(rope_dim, theta, params), 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n]; q: [n, heads, rope_dim]; k: [n, 1, rope_dim] -> same shapes
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.attention_factor)[:, None, :]  # [n, 1, rope_dim/2]
        sin = (freqs.sin() * self.attention_factor)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
