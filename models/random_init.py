"""A model of any registered architecture with random weights, built where it will run (no checkpoint).

For benchmarks and tests at real shapes (e.g. Llama-3-8B on one GPU in seconds): the model class
from ``registry.py`` is constructed as the loader would, then every parameter is drawn on its
device: matrices ~ N(0, std^2), norm weights ~ U(0.8, 1.2) (not ones, so a wrong norm shows),
other vectors (biases) zero. The same seed gives the same weights on every rank, so replicated
parameters agree across a tensor-parallel group. A block-FP8 weight (``layers/fp8_block.py``) is drawn
the same way in float32, one matrix at a time (a 256-expert tensor never exists in float32), and
quantized into it and its ``_scale_inv``. ``dequantized=fmt`` draws a plain model with the values the
same seed gives its block-FP8 twin, dequantized (the weights of an FP8 checkpoint loaded with
``quantization: none``): benchmarks compare the two on the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers.fp8_block import FP8_DTYPE, BlockFP8, dequantize_weight, quantize_weight
from .layers.weight_source import finish_loading
from .parallel.collectives import Collectives
from .parallel.groups import ParallelGroups
from .registry import model_class


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, std: float = 0.02,
                 dequantized: dict[str, BlockFP8] | None = None) -> nn.Module:
    """Draw every parameter in place, in name order, then the tensors derived from weights
    (``finish_loading``); ``dequantized``: parameter -> the FP8 format whose dequantized values it
    takes (as its FP8 twin draws them)."""
    params = dict(model.named_parameters())
    for name, p in sorted(params.items()):
        gen = torch.Generator(device=p.device).manual_seed(seed + _stable_hash(name))
        if p.dtype == FP8_DTYPE:
            _draw_fp8_(p, params[name + "_scale_inv"], _format_of(model, name), gen, std)
        elif dequantized is not None and name in dequantized:
            _draw_fp8_(p, None, dequantized[name], gen, std)
        elif name.endswith("_scale_inv"):
            continue  # drawn with its weight
        elif p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            p.uniform_(0.8, 1.2, generator=gen)
        else:
            p.zero_()
    finish_loading(model)
    return model


def random_model(config: Any, groups: ParallelGroups, collectives: Collectives,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, seed: int = 0,
                 dequantized: BlockFP8 | None = None, **model_kwargs: Any) -> Any:
    """config: an HF config with ``architectures`` set; model_kwargs go to the model class (e.g. kernels,
    ``fp8``). The plan fuses when ``collectives.fused`` is set (as ``load_model``). ``dequantized``: a
    plain model whose weights are its block-FP8 twin's (built on the meta device to name them), dequantized."""
    archs = getattr(config, "architectures", None) or []  # an HF config (not a model): getattr is its API
    if not archs:
        raise ValueError("the config names no architecture ('architectures' is empty)")
    cls = model_class(str(archs[0]))
    model = cls(config, groups, collectives, dtype=dtype, device=device, **model_kwargs)
    twin: dict[str, BlockFP8] | None = None
    if dequantized is not None:
        meta = cls(config, groups, Collectives(collectives.device_path), dtype=dtype, device="meta",
                   fp8=dequantized, **model_kwargs)
        twin = {n: _format_of(meta, n) for n, p in meta.named_parameters() if p.dtype == FP8_DTYPE}
    return init_random_(model, seed, dequantized=twin).eval()


def _format_of(model: nn.Module, name: str) -> BlockFP8:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    fmt = getattr(owner, "fp8", None)
    if not isinstance(fmt, BlockFP8):
        raise TypeError(f"{name}: an FP8 parameter in a module without a block-FP8 format")
    return fmt


def _draw_fp8_(weight: torch.Tensor, scale: torch.Tensor | None, fmt: BlockFP8, gen: torch.Generator,
               std: float) -> None:
    """weight [..., rows, cols] (e4m3 with its scales, or plain: the dequantized values) from N(0, std^2)
    drawn one matrix at a time and quantized."""
    rows, cols = weight.shape[-2:]
    flat_w = weight.view(-1, rows, cols)
    flat_s = scale.view(-1, *scale.shape[-2:]) if scale is not None else None
    for i in range(flat_w.shape[0]):
        w = torch.empty(rows, cols, dtype=torch.float32, device=weight.device).normal_(0.0, std, generator=gen)
        q, s = quantize_weight(w, fmt)
        if flat_s is None:
            flat_w[i].copy_(dequantize_weight(q, s, fmt, weight.dtype))
        else:
            flat_w[i].copy_(q)
            flat_s[i].copy_(s)


def _stable_hash(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1_000_003
    return h
