"""Which kernels a rank's model runs and whether its steps are captured as CUDA graphs, decided once.

``kernel_choice(device, cuda_graphs, model_config, dtype, libraries)`` (pure) -> ``KernelChoice``:
the kernel set's name (``models/layers/kernels.py``) and whether the executor is built for CUDA
graphs. ``libraries()`` says which optional GPU libraries import here (the one place that looks).

- CPU: the torch references ("reference"); "torch" (graph-safe, the same maths) when graphs are
  asked for (off CUDA their padded static-shape forwards run eagerly: tests).
- CUDA, the fast set by default: "flashinfer" (FlashInfer paged attention for decode, prefill,
  chain and tree verify and the draft's steps, planned once per forward; Triton norms, RoPE,
  SiLU-and-mul; cuBLAS matmuls) for GQA models whose heads FlashInfer takes (head dim 64/128/256,
  bf16/fp16); else "triton" (Triton decode attention, fused MoE) for the graph-safe architectures
  (DeepSeek-V3's MLA always: its latent cache, K 576 / V 512 with V inside K, is no FlashInfer shape
  here, and asking for "flashinfer" there is refused); else the references. No torch gather attention
  on the GPU's fast path.
- CUDA graphs: on by default on CUDA for the architectures whose graphed steps are tested on a GPU
  (``GRAPH_ARCHITECTURES``); ``cuda_graphs=True`` asks for them wherever a graph-safe forward exists;
  ``False`` turns them off. A recurrent (Mamba) model has no graph-safe forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...models.layers.attention_layout import flashinfer_supports
from ...models.layers.kernels import Kernels

# Architectures whose step forwards the engine captures by default on CUDA.
GRAPH_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# Architectures with a graph-safe forward (no recurrent state; attention and experts graph-safe).
GRAPH_SAFE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "DeepseekV3ForCausalLM"})
# Architectures whose attention is GQA over a plain paged K/V cache (what FlashInfer's wrappers take).
GQA_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# MLA over the latent cache (one KV head of K 576 / V 512, V inside K): FlashInfer's paged wrappers as
# shipped here (FA2, head dims 64/128/256, K and V of one dim) cannot take it; the Triton set serves it.
MLA_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM"})


class KernelChoiceError(ValueError):
    """A kernel or graph setting this model or device cannot honour."""


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # a name of ``Kernels.named``
    graphs: bool  # the executor captures CUDA graphs (off CUDA: runs their padded forwards eagerly)

    def kernel_set(self) -> Kernels:
        return Kernels.named(self.kernels)


def libraries() -> frozenset[str]:
    """The optional GPU libraries that import on this machine ("triton", "flashinfer")."""
    found = set()
    for name in ("triton", "flashinfer"):
        try:
            __import__(name)
        except ImportError:
            continue
        found.add(name)
    return frozenset(found)


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kernel_choice(device: torch.device | str, cuda_graphs: bool | None, model_config: Any, dtype: torch.dtype,
                  available: frozenset[str], requested: str = "auto") -> KernelChoice:
    """``requested``: "auto" (the rules above) or a kernel set's name, taken as it is (graphs need a
    graph-safe one)."""
    architecture = str((getattr(model_config, "architectures", None) or ["?"])[0])
    cuda = torch.device(device).type == "cuda"
    if cuda_graphs is None:
        graphs = cuda and architecture in GRAPH_ARCHITECTURES
    elif cuda_graphs and architecture not in GRAPH_SAFE_ARCHITECTURES:
        raise KernelChoiceError(f"cuda_graphs: the engine captures {', '.join(sorted(GRAPH_SAFE_ARCHITECTURES))} "
                                f"only, not {architecture}")
    else:
        graphs = cuda_graphs
    plain = "torch" if graphs else "reference"
    if requested != "auto":
        if requested == "flashinfer" and architecture in MLA_ARCHITECTURES:
            raise KernelChoiceError(f"the flashinfer kernel set has no MLA attention (the latent cache's K 576 / V 512 "
                                    f"are no head dims of its wrappers here): {architecture} runs the triton set")
        if graphs and not Kernels.named(requested).graph_safe:
            raise KernelChoiceError(f"the {requested} kernel set is not graph-safe: use cuda_graphs=False or "
                                    "another set")
        return KernelChoice(requested, graphs)
    if not cuda:
        return KernelChoice(plain, graphs)
    if (architecture in GQA_ARCHITECTURES and {"flashinfer", "triton"} <= available
            and flashinfer_supports(head_dim_of(model_config), dtype)):
        return KernelChoice("flashinfer", graphs)
    if architecture in GRAPH_SAFE_ARCHITECTURES and "triton" in available:
        return KernelChoice("triton", graphs)
    return KernelChoice(plain, graphs)
