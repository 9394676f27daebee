"""A model of any registered architecture with random weights, built where it will run (no checkpoint).

For benchmarks and tests at real shapes (e.g. Llama-3-8B on one GPU in seconds): the model class
from ``registry.py`` is constructed as the loader would, then every parameter is drawn on its
device: matrices ~ N(0, std^2), norm weights ~ U(0.8, 1.2) (not ones, so a wrong norm shows),
other vectors (biases) zero. The same seed gives the same weights on every rank, so replicated
parameters agree across a tensor-parallel group. A block-FP8 weight (``layers/fp8_block.py``) is drawn
the same way in float32, one matrix at a time (a 256-expert tensor never exists in float32), and
quantized into it and its ``_scale_inv``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers.fp8_block import FP8_DTYPE, BlockFP8, quantize_weight
from .parallel.collectives import Collectives
from .parallel.groups import ParallelGroups
from .registry import model_class


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Draw every parameter in place, in name order."""
    params = dict(model.named_parameters())
    for name, p in sorted(params.items()):
        gen = torch.Generator(device=p.device).manual_seed(seed + _stable_hash(name))
        if p.dtype == FP8_DTYPE:
            _draw_fp8_(p, params[name + "_scale_inv"], _format_of(model, name), gen, std)
        elif name.endswith("_scale_inv"):
            continue  # drawn with its weight
        elif p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            p.uniform_(0.8, 1.2, generator=gen)
        else:
            p.zero_()
    return model


def random_model(config: Any, groups: ParallelGroups, collectives: Collectives,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, seed: int = 0,
                 **model_kwargs: Any) -> Any:
    """config: an HF config with ``architectures`` set; model_kwargs go to the model class (e.g. kernels).
    The plan fuses when ``collectives.fused`` is set (as ``load_model``)."""
    archs = getattr(config, "architectures", None) or []  # an HF config (not a model): getattr is its API
    if not archs:
        raise ValueError("the config names no architecture ('architectures' is empty)")
    cls = model_class(str(archs[0]))
    model = cls(config, groups, collectives, dtype=dtype, device=device, **model_kwargs)
    return init_random_(model, seed).eval()


def _format_of(model: nn.Module, name: str) -> BlockFP8:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    fmt = getattr(owner, "fp8", None)
    if not isinstance(fmt, BlockFP8):
        raise TypeError(f"{name}: an FP8 parameter in a module without a block-FP8 format")
    return fmt


def _draw_fp8_(weight: torch.Tensor, scale: torch.Tensor, fmt: BlockFP8, gen: torch.Generator, std: float) -> None:
    """weight [..., rows, cols] e4m3 and its scales, from N(0, std^2) drawn one matrix at a time."""
    rows, cols = weight.shape[-2:]
    flat_w, flat_s = weight.view(-1, rows, cols), scale.view(-1, *scale.shape[-2:])
    for i in range(flat_w.shape[0]):
        w = torch.empty(rows, cols, dtype=torch.float32, device=weight.device).normal_(0.0, std, generator=gen)
        q, s = quantize_weight(w, fmt)
        flat_w[i].copy_(q)
        flat_s[i].copy_(s)


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1_000_003
    return h
