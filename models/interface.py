"""What the worker relies on in a model: the ``CausalLM`` protocol and the value a forward returns.

Every architecture (``llama.py``, ``deepseek_v3.py``, ``nemotron_h.py``) and the EAGLE3 draft
(``eagle3.py``) is called as ``model(batch) -> ModelOutput``: the logits of the rows the batch asks
for and, beside them, the per-row hidden states it asked for (the target's EAGLE3 aux states of
``batch.aux_layers``; the draft's next hidden state). Nothing is passed back by writing into the
model or its communicator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .forward_batch import ForwardBatch
from .layers.attention_layout import AttentionDims
from .layers.kernels import Kernels
from .layers.mamba_state import MambaStateShape
from .parallel.communicator import Communicator


@dataclass(frozen=True)
class ModelOutput:
    """logits: [rows with logits, vocab]; hidden: per-row states, each [num_tokens, width].

    For a target model ``hidden[i]`` is the complete residual stream entering layer
    ``batch.aux_layers[i]`` (EAGLE3's aux state, captured after that layer's input boundary
    completed every owed sum); for the EAGLE3 draft ``hidden == (next_hidden,)``.
    """

    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...] = ()


class StepModel(Protocol):
    """What an executor runs: a forward over a batch, and the shapes of its caches."""

    def __call__(self, batch: ForwardBatch) -> ModelOutput: ...

    def kv_shapes(self) -> dict[int, tuple[int, ...]]:
        """Attention layer id -> (kv_heads, head_dim) or (kv_heads, k_dim, v_dim) on this rank."""
        ...

    def state_shapes(self) -> dict[int, MambaStateShape]:
        """Recurrent (Mamba) layer id -> per-sequence state shapes on this rank; empty for none."""
        ...

    def parameters(self, recurse: bool = True) -> Any: ...


class CausalLM(StepModel, Protocol):
    """A served target model: its HF config, its kernel set and its communicator."""

    config: Any
    kernels: Kernels
    comm: Communicator

    def attention_dims(self) -> AttentionDims:
        """Heads and head dims on this rank (GQA models; what an attention planner needs)."""
        ...
