"""Rotary position embedding (rotate-half layout, as HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "linear":
        assert scaling is not None
        return inv_freq / float(scaling["factor"])
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config of either transformers 4 or 5 style."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return theta, params
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


# (positions [n], q [n, heads, d], k [n, kv_heads, d], inv_freq [rotary_dim/2]) -> (q, k) rotated
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding(nn.Module):
    """``kernel``: a fused implementation of ``forward`` (e.g. ``rope_triton.rope_triton``), chosen at
    construction; None = the torch ops below (its reference)."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 kernel: RopeKernel | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.kernel = kernel
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta, scaling), persistent=False)
        self.inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n]; q: [n, heads, head_dim]; k: [n, kv_heads, head_dim]
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.inv_freq)
        return rope_reference(positions, q, k, self.inv_freq)


def rope_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on the first 2*len(inv_freq) dims, fp32 math, output in the input dtype.
    positions: [n]; q: [n, heads, head_dim]; k: [n, kv_heads, head_dim]"""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot[..., : d // 2], rot[..., d // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out
