"""Rotary position embedding (rotate-half layout, as HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
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


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta, scaling), persistent=False)
        self.inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n]; q: [n, heads, head_dim]; k: [n, kv_heads, head_dim]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
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
