"""How a rank keeps a checkpoint's weights, decided once: ``choose_quantization`` (pure) -> ``Quantization``.

The checkpoint's format comes from config.json (``BlockFP8.from_hf``: DeepSeek-V3 / Kimi-K2's
``quantization_config``); what is asked comes from ``spec.model.quantization`` (or ``--quantization``):

=========  ==========================================================================================
requested  weights kept
=========  ==========================================================================================
auto       an FP8 checkpoint stays FP8 (block-scaled FP8 GEMMs, ``fp8``) where the GPU runs them (CUDA,
           compute capability >= 8.9) and the architecture has FP8 layers; elsewhere it is dequantized
           to the compute dtype at load; an unquantized checkpoint loads as it is
fp8       FP8 weights and block GEMMs required: an FP8 checkpoint stays FP8 (the Triton kernels on a
           GPU, the dequantizing references on CPU: tests); an unquantized checkpoint, an architecture
           without FP8 layers or a GPU below 8.9 is an error (random ``dummy`` weights are drawn in FP8)
none      FP8 refused: an FP8 checkpoint is dequantized to the compute dtype at load (the model runs
           as the dequantized checkpoint would); an unquantized checkpoint loads as it is
=========  ==========================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layers.fp8_block import BlockFP8

QUANTIZATION_MODES = ("auto", "fp8", "none")
# Architectures whose layers keep block-FP8 weights (others load an FP8 checkpoint dequantized).
FP8_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM"})
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor-core MMA (Ada, Hopper and later): what Triton's FP8 dot needs


class QuantizationError(ValueError):
    """A quantization setting this checkpoint, model or device cannot honour; the message says why."""


@dataclass(frozen=True)
class Quantization:
    """``checkpoint``: the checkpoint's format (None = unquantized); ``fp8``: the format the model keeps
    (None = plain weights in the compute dtype)."""

    requested: str = "auto"
    checkpoint: BlockFP8 | None = None
    fp8: BlockFP8 | None = None

    @property
    def dequantize(self) -> bool:
        """The loader dequantizes an FP8 checkpoint into plain weights."""
        return self.checkpoint is not None and self.fp8 is None

    @property
    def weights(self) -> str:
        return "fp8" if self.fp8 is not None else "dequantized" if self.dequantize else "unquantized"

    def describe(self, dtype: str, kernels: str = "triton") -> str:
        """One line for logs, /status and the CR status, e.g. "fp8 e4m3, 128x128 weight blocks, ...: FP8
        weights, Triton block-scaled FP8 GEMMs". ``kernels``: the kernel set's name (``layers/kernels.py``)."""
        if self.fp8 is not None:
            gemm = "Triton block-scaled FP8 GEMMs" if kernels in ("triton", "flashinfer") else \
                "GEMMs by the dequantizing reference"
            return f"{self.fp8.describe()}: FP8 weights, {gemm}"
        if self.checkpoint is not None:
            return f"{self.checkpoint.describe()}: dequantized to {dtype} at load"
        return f"none ({dtype} checkpoint weights)"

    def to_json(self, dtype: str, kernels: str = "triton") -> dict[str, Any]:
        fmt = self.fp8 or self.checkpoint
        return {"requested": self.requested, "checkpoint": None if self.checkpoint is None else "fp8",
                "weight_block_size": None if fmt is None else list(fmt.block), "weights": self.weights,
                "description": self.describe(dtype, kernels)}


def choose_quantization(requested: str, checkpoint: BlockFP8 | None, architecture: str,
                        capability: tuple[int, int] | None, dummy: bool = False) -> Quantization:
    """``capability``: the CUDA GPU's (major, minor), None on CPU; ``dummy``: random weights drawn
    from config.json alone (``quantization: fp8`` then draws them in 128x128 block FP8)."""
    if requested not in QUANTIZATION_MODES:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {requested!r}")
    if requested == "none":
        return Quantization(requested, checkpoint, None)
    supported = architecture in FP8_ARCHITECTURES
    gpu_ok = capability is None or capability >= FP8_MIN_CAPABILITY
    if requested == "auto":
        native = checkpoint is not None and supported and capability is not None and gpu_ok
        return Quantization(requested, checkpoint, checkpoint if native else None)
    if checkpoint is None and not dummy:
        raise QuantizationError("quantization: fp8 needs a block-FP8 checkpoint (config.json quantization_config "
                                "with weight_block_size); quantizing an unquantized checkpoint at load is not "
                                "supported")
    if not supported:
        raise QuantizationError(f"quantization: fp8: {architecture} has no block-FP8 layers (supported: "
                                f"{', '.join(sorted(FP8_ARCHITECTURES))}); use quantization: none or auto to "
                                "dequantize the checkpoint at load")
    if not gpu_ok:
        assert capability is not None
        raise QuantizationError(f"quantization: fp8: this GPU (compute capability {capability[0]}.{capability[1]}) "
                                f"has no FP8 tensor cores (needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+); "
                                "use quantization: none or auto")
    return Quantization(requested, checkpoint, checkpoint or BlockFP8())
