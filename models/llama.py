"""Llama-style dense model (GQA, RoPE, SwiGLU): composition of layers only.

Each decoder layer is two blocks, attention and MLP; the communicator completes every owed
sum at the boundaries in front of them (see ``parallel/comm_plan.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .decoder_stack import (
    GATE_UP_STACKED,
    QKV_STACKED,
    PreNormLayer,
    check_aux_capture,
    decoder_forward,
    pre_norm_blocks,
    stacked_name,
)
from .forward_batch import ForwardBatch
from .interface import ModelOutput
from .layers.attention_layout import AttentionDims
from .layers.kernels import Kernels
from .layers.linear import use_matmul
from .layers.mamba_state import MambaStateShape
from .layers.mlp import GatedMLP
from .layers.norm import RMSNorm
from .layers.rotary import RotaryEmbedding, rope_parameters
from .layers.self_attention import SelfAttention
from .layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from .parallel.collectives import Collectives
from .parallel.comm_plan import BlockSpec, plan_communication, vocab_group
from .parallel.communicator import Communicator
from .parallel.groups import ParallelGroups


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LlamaDecoderLayer(PreNormLayer):
    self_attn: SelfAttention
    mlp: GatedMLP

    def __init__(self, config: Any, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device | str | None, kernels: Kernels | None = None) -> None:
        super().__init__()
        kernels = kernels or Kernels.reference()
        h = config.hidden_size
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.self_attn = SelfAttention(
            layer_id, h, config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
            groups.attn_tp, rotary, qkv_bias=getattr(config, "attention_bias", False),
            o_bias=getattr(config, "attention_bias", False), dtype=dtype, device=device,
            attention_backend=kernels.attention, qkv_rope=kernels.qkv_rope)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(h, config.intermediate_size, groups.tp, getattr(config, "mlp_bias", False),
                            dtype, device, act=kernels.silu_and_mul, gate_up_act=kernels.gate_up_act)


class LlamaForCausalLM(nn.Module):
    """``kernels``: the implementation of attention, norms, RoPE and activation (default: the torch
    references); ``Kernels.triton()`` on a GPU, and any ``graph_safe`` set for CUDA graphs."""

    def __init__(self, config: Any, groups: ParallelGroups, collectives: Collectives,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 kernels: Kernels | None = None, *, dp_combine: str = "reduce_scatter",
                 aux_capture: str = "complete") -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels or Kernels.reference()
        theta, scaling = rope_parameters(config)
        rotary = RotaryEmbedding(head_dim_of(config), theta, scaling, kernel=self.kernels.rope).to(device)
        vgroup = groups.by_name(vocab_group(groups.config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, vgroup, dtype, device,
                                                   lookup=self.kernels.embedding)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, groups, rotary, dtype, device, self.kernels)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, vgroup, dtype, device)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.embed_tokens)
        if self.kernels.matmul is not None:
            use_matmul(self, self.kernels.matmul)
        # The plan fuses exactly when this rank has a fused kernel (fusion/selection.py decided it);
        # dp_combine and aux_capture are benchmark-only (comm_plan.py, decoder_stack.py): no spec or CLI
        # reaches them.
        self.aux_capture = check_aux_capture(aux_capture)
        plan = plan_communication(groups.config, self.blocks(config), collectives.fused is not None,
                                  dp_combine=dp_combine)
        self.comm = Communicator(plan, groups, collectives, norms=self.kernels.norms)

    @staticmethod
    def blocks(config: Any) -> list[BlockSpec]:
        return pre_norm_blocks(config.num_hidden_layers)

    def kv_shapes(self) -> dict[int, tuple[int, int]]:
        layers: list[LlamaDecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        return {layer.layer_id: layer.self_attn.kv_shape() for layer in layers}

    def state_shapes(self) -> dict[int, MambaStateShape]:
        return {}

    def attention_dims(self) -> AttentionDims:
        return self.layers[0].self_attn.attention_dims()  # type: ignore[union-attr, operator, no-any-return]

    # HF checkpoint names -> (our parameter, shard id) for stacked parameters.
    stacked_params = QKV_STACKED + GATE_UP_STACKED

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for an HF tensor name; None = not ours to load."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        return stacked_name(name, self.stacked_params)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Logits for ``batch.logits_indices`` rows (all rows if None), [n, vocab_size], and the aux
        states of ``batch.aux_layers``."""
        return decoder_forward(batch, self.comm, self.embed_tokens, self.layers, len(self.layers) * 2, self.norm,
                               self.lm_head, self.config.vocab_size, self.aux_capture)
