"""Which kernels a rank's model runs and whether its steps are captured as CUDA graphs, decided once.

``kernel_choice(device, cuda_graphs, architecture)`` (pure) -> ``KernelChoice``: the kernel set's
name (``models/layers/kernels.py``) and whether the executor is built for CUDA graphs.

- CUDA graphs: on by default on a CUDA device for the architectures whose graphed steps are
  tested on a GPU (``GRAPH_ARCHITECTURES``); ``cuda_graphs=True`` asks for them anywhere a
  graph-safe forward exists (off CUDA the same padded static-shape forwards run eagerly: tests),
  ``False`` turns them off. A recurrent (Mamba) model has no graph-safe forward.
- Kernels: graphed steps need a graph-safe set ("torch"); eager steps run the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.layers.kernels import Kernels

# Architectures whose step forwards the engine captures by default on CUDA.
GRAPH_ARCHITECTURES = frozenset({"LlamaForCausalLM"})
# Architectures with a graph-safe forward (no recurrent state; attention and experts graph-safe).
GRAPH_SAFE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "DeepseekV3ForCausalLM"})


class KernelChoiceError(ValueError):
    """A kernel or graph setting this model or device cannot honour."""


@dataclass(frozen=True)
class KernelChoice:
    kernels: str  # a name of ``Kernels.named``
    graphs: bool  # the executor captures CUDA graphs (off CUDA: runs their padded forwards eagerly)

    def kernel_set(self) -> Kernels:
        return Kernels.named(self.kernels)


def kernel_choice(device: torch.device | str, cuda_graphs: bool | None, architecture: str) -> KernelChoice:
    cuda = torch.device(device).type == "cuda"
    if cuda_graphs is None:
        graphs = cuda and architecture in GRAPH_ARCHITECTURES
    elif cuda_graphs and architecture not in GRAPH_SAFE_ARCHITECTURES:
        raise KernelChoiceError(f"cuda_graphs: the engine captures {', '.join(sorted(GRAPH_SAFE_ARCHITECTURES))} "
                                f"only, not {architecture}")
    else:
        graphs = cuda_graphs
    return KernelChoice("torch" if graphs else "reference", graphs)
