"""The block-quantized FP8 weight format (DeepSeek-V3 / Kimi-K2 releases) and its reference maths.

A checkpoint in this format says so in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and stores every quantized linear weight W [out, in] as ``<name>.weight`` in float8_e4m3fn plus
``<name>.weight_scale_inv`` [ceil(out / bn), ceil(in / bk)] in float32, one scale per bn x bk block
(``weight_block_size = [bn, bk]``): W = weight * scale_inv, block by block. The last block of a
dimension that is not a multiple of the block may be partial (DeepSeek-V3's kv_a_proj_with_mqa has
576 = 4.5 x 128 rows: 5 scale rows). Fused expert tensors ([E, out, in]) carry ``<name>_scale_inv``
[E, ceil(out / bn), ceil(in / bk)]. Embeddings, the LM head, norms and the MoE router stay bf16.

Activations are quantized on the fly ("dynamic"), one scale per token and group of bk input
features (1 x 128 in the release): s = max|x_group| / 448, q = x / s in e4m3. A block-scaled GEMM
multiplies q by the FP8 weight tile by tile and rescales each partial product by s x scale_inv.

References here (the CPU path and the oracle of every fast kernel, ``fp8_block_triton.py``):

- ``dequantize_weight``: the compute-dtype weight (what loading with ``quantization: none`` keeps);
- ``block_fp8_linear_reference``: y = x @ dequantize(W)^T in the activation dtype (FP8 weights
  stored, nothing else approximated: equals the dequantized model);
- ``block_fp8_linear_w8a8_reference``: what the fast kernels compute (activations quantized per
  token group too, products accumulated in fp32);
- ``quantize_weight`` / ``quantize_activation``: the writers (tests, dummy weights, benchmarks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ACT_SCALE_MIN = 1e-10  # a group of zeros still gets a finite scale (as sglang's per-token-group quant)


class QuantizationConfigError(ValueError):
    """A ``quantization_config`` this server cannot load; the message says which key and why."""


@dataclass(frozen=True)
class BlockFP8:
    """One scale per ``block_n`` output rows x ``block_k`` input columns of every quantized weight;
    activations quantized per token and ``block_k`` columns."""

    block_n: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_k < 1:
            raise QuantizationConfigError(f"weight_block_size must be positive, not {list(self.block)}")

    @property
    def block(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.block_n), -(-cols // self.block_k)

    def describe(self) -> str:
        return f"fp8 e4m3, {self.block_n}x{self.block_k} weight blocks, 1x{self.block_k} dynamic activation groups"

    @staticmethod
    def from_hf(config: Any) -> BlockFP8 | None:
        """The format of an HF config (or config.json dict); None when it is not quantized.

        Raises ``QuantizationConfigError`` for a quantization this server does not load (another
        method, e5m2, static activation scales, per-tensor FP8, UE8M0 scales)."""
        q = config.get("quantization_config") if isinstance(config, Mapping) else \
            getattr(config, "quantization_config", None)
        if q is None:
            return None
        if not isinstance(q, Mapping):
            q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
        method = str(q.get("quant_method", ""))
        where = "config.json quantization_config"
        if method != "fp8":
            raise QuantizationConfigError(f"{where}: quant_method {method!r} is not supported (only block FP8, "
                                          "quant_method 'fp8' with weight_block_size)")
        if str(q.get("fmt", "e4m3")) != "e4m3":
            raise QuantizationConfigError(f"{where}: fmt {q.get('fmt')!r} is not supported (only e4m3)")
        if str(q.get("activation_scheme", "dynamic")) != "dynamic":
            raise QuantizationConfigError(f"{where}: activation_scheme {q.get('activation_scheme')!r} is not "
                                          "supported (only dynamic)")
        if q.get("scale_fmt") not in (None, "float"):
            raise QuantizationConfigError(f"{where}: scale_fmt {q.get('scale_fmt')!r} is not supported "
                                          "(only float32 scales)")
        block = q.get("weight_block_size")
        if block is None:
            raise QuantizationConfigError(f"{where}: no weight_block_size (per-tensor FP8 is not supported, "
                                          "only block FP8)")
        if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) for b in block):
            raise QuantizationConfigError(f"{where}: weight_block_size must be two integers, not {block!r}")
        return BlockFP8(int(block[0]), int(block[1]))


# (x [n, in], weight fp8 [out, in], scale_inv fp32 [ceil(out/bn), ceil(in/bk)], bias [out] | None,
#  format) -> [n, out] in x's dtype
BlockFP8MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, BlockFP8], torch.Tensor]


def _expand(scale: torch.Tensor, rows: int, cols: int, fmt: BlockFP8) -> torch.Tensor:
    """[..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols]: each block's scale over its elements."""
    s = scale.repeat_interleave(fmt.block_n, dim=-2).repeat_interleave(fmt.block_k, dim=-1)
    return s[..., :rows, :cols]


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: BlockFP8,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight fp8 [..., rows, cols], scale_inv [..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols] in dtype."""
    rows, cols = weight.shape[-2:]
    if tuple(scale_inv.shape[-2:]) != fmt.scale_shape(rows, cols) or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} in "
                         f"{fmt.block_n}x{fmt.block_k} blocks")
    return (weight.float() * _expand(scale_inv.float(), rows, cols, fmt)).to(dtype)


def quantize_weight(weight: torch.Tensor, fmt: BlockFP8) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (fp8 [..., rows, cols], scale_inv fp32 [..., ceil(rows/bn), ceil(cols/bk)]):
    each block's amax maps to 448 (an all-zero block gets scale 1)."""
    rows, cols = weight.shape[-2:]
    sr, sc = fmt.scale_shape(rows, cols)
    w = weight.float()
    padded = F.pad(w, (0, sc * fmt.block_k - cols, 0, sr * fmt.block_n - rows))
    blocks = padded.unflatten(-1, (sc, fmt.block_k)).unflatten(-3, (sr, fmt.block_n))  # [..., sr, bn, sc, bk]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale_inv, rows, cols, fmt)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def quantize_activation(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and group of ``group`` columns: x [n, k] -> (fp8 [n, k], scale fp32 [n, ceil(k/group)]),
    x ~= q * scale (the last group may be partial)."""
    n, k = x.shape
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(n, groups, group)
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp(min=ACT_SCALE_MIN)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(n, groups * group)[:, :k]
    return q, scale


def block_fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                               bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """x [n, in] @ dequantize(weight)^T (+ bias) -> [n, out] in x's dtype: the plain reference (CPU path)."""
    return F.linear(x, dequantize_weight(weight, scale_inv, fmt, x.dtype), bias)


def block_fp8_linear_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                                    bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """What the block-scaled FP8 GEMMs compute: x quantized per token and 1 x bk group, both operands
    dequantized, products in fp32. x [n, in] -> [n, out] in x's dtype."""
    q, s = quantize_activation(x, fmt.block_k)
    xq = q.float() * s.repeat_interleave(fmt.block_k, dim=-1)[:, : x.shape[1]]
    y = xq @ dequantize_weight(weight, scale_inv, fmt).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
