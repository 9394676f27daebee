"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): composition of layers only.

Each decoder layer is two blocks: MLA attention (heads over attn_tp, owes attn_tp) and an MLP
block (owes tp): a dense SwiGLU MLP for layers < ``first_k_dense_replace`` (and layers off the
``moe_layer_freq`` stride), else the MoE (sigmoid router with ``e_score_correction_bias`` and
grouped top-k, routed experts over moe_ep x moe_tp, shared experts over tp). The communicator
completes every owed sum at the boundaries in front of the blocks (``parallel/comm_plan.py``).

Config variants: ``q_lora_rank`` None (plain q_proj, V2-Lite style), ``n_group`` 1 (Kimi-K2),
YaRN rope with ``mscale_all_dim`` (DeepSeek-V3, Kimi-K2), ``rope_interleave``. Tensors of
layers >= ``num_hidden_layers`` (the MTP module) are ignored, as transformers does.

``fp8``: the release format (``layers/fp8_block.py``) kept as it is: every attention projection and
MLP / expert weight in block FP8 with its ``weight_scale_inv``, multiplied by the kernel set's
``block_fp8_matmul`` and ``fused_moe_fp8``; embeddings, LM head, norms and router in ``dtype``.
None (also for an FP8 checkpoint under ``quantization: none``: the loader dequantizes) = plain weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .decoder_stack import (
    GATE_UP_STACKED,
    PreNormLayer,
    Stacked,
    decoder_forward,
    pre_norm_blocks,
    stacked_name,
)
from .forward_batch import ForwardBatch
from .interface import ModelOutput
from .layers.experts import parse_expert_name
from .layers.fp8_block import BlockFP8
from .layers.kernels import Kernels
from .layers.linear import use_fp8_matmul
from .layers.mamba_state import MambaStateShape
from .layers.mla import MERGED_QKV_A, MLADims, MLAttention
from .layers.mla_rotary import MLARotary, mla_softmax_scale
from .layers.mlp import GatedMLP
from .layers.moe import MoE, expert_stacked_params
from .layers.norm import RMSNorm
from .layers.rotary import rope_parameters
from .layers.router import RouterConfig
from .layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from .layers.weight_source import WeightShapeError, named
from .parallel.collectives import Collectives
from .parallel.comm_plan import BlockSpec, plan_communication, vocab_group
from .parallel.communicator import Communicator, ForwardContext
from .parallel.groups import ParallelGroups
from .parallel.layouts import Unreduced


def is_moe_layer(config: Any, layer_id: int) -> bool:
    freq = int(getattr(config, "moe_layer_freq", None) or 1)
    return (bool(getattr(config, "n_routed_experts", None)) and layer_id >= int(config.first_k_dense_replace or 0)
            and layer_id % freq == 0)


class DeepseekV3DecoderLayer(PreNormLayer):
    self_attn: MLAttention

    def __init__(self, config: Any, layer_id: int, groups: ParallelGroups, rotary: MLARotary, scale: float,
                 dtype: torch.dtype, device: torch.device | str | None, kernels: Kernels | None = None,
                 fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        kernels = kernels or Kernels.reference()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.self_attn = named(f"layers.{layer_id}.self_attn", lambda: MLAttention(
            layer_id, MLADims.from_hf(config), groups.attn_tp, rotary, scale, dtype, device,
            attention_backend=kernels.attention, fp8=fp8, assemble=kernels.mla_assemble,
            norm_kernel=kernels.norms.rms_norm, absorb=kernels.mla_absorb))
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.mlp: MoE | GatedMLP
        if is_moe_layer(config, layer_id):
            self.mlp = named(f"layers.{layer_id}.mlp", lambda: MoE(
                h, config.moe_intermediate_size, RouterConfig.from_hf(config), groups,
                shared_intermediate=config.moe_intermediate_size * (config.n_shared_experts or 0), dtype=dtype,
                device=device, fused_experts=kernels.fused_moe, fp8=fp8, fused_experts_fp8=kernels.fused_moe_fp8,
                select_experts=kernels.select_experts, logits=kernels.router_logits, shared_act=kernels.silu_and_mul))
        else:
            self.mlp = named(f"layers.{layer_id}.mlp", lambda: GatedMLP(
                h, config.intermediate_size, groups.tp, dtype=dtype, device=device, act=kernels.silu_and_mul, fp8=fp8))

    def mlp_out(self, h: torch.Tensor, ctx: ForwardContext) -> Unreduced:
        # the MoE block takes the rows that are real tokens (DP attention pads); a dense MLP all of them
        return self.mlp(h, ctx.valid_rows) if isinstance(self.mlp, MoE) else self.mlp(h)


class DeepseekV3ForCausalLM(nn.Module):
    """``kernels``: attention, norms, activation and routed-expert implementations (default: the
    torch references and the per-expert loop); a ``graph_safe`` set (``Kernels.triton()`` on a
    GPU) makes the decode forward capturable by the executor's CUDA graphs (``worker/executor/step_graphs.py``)."""

    def __init__(self, config: Any, groups: ParallelGroups, collectives: Collectives,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 kernels: Kernels | None = None, *, dp_combine: str = "reduce_scatter",
                 fp8: BlockFP8 | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels or Kernels.reference()
        self.fp8 = fp8
        theta, rope = rope_parameters(config)
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        rotary = MLARotary(config.qk_rope_head_dim, theta, rope, config.max_position_embeddings,
                           bool(getattr(config, "rope_interleave", True))).to(device)
        scale = mla_softmax_scale(qk_head_dim, rope)
        vgroup = groups.by_name(vocab_group(groups.config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, vgroup, dtype, device,
                                                   lookup=self.kernels.embedding)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, groups, rotary, scale, dtype, device, self.kernels, fp8)
            for i in range(config.num_hidden_layers)
        )
        if fp8 is not None:
            use_fp8_matmul(self, self.kernels.block_fp8_matmul)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, vgroup, dtype, device)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.embed_tokens)
        moe = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)), None)
        if any(layer.self_attn.fused_qkv_a_proj_with_mqa is not None for layer in self.decoder_layers()):
            self.dense_stacked_params = type(self).dense_stacked_params + MERGED_QKV_A
        # Instance attribute: the routed-expert shard ids depend on this rank's EP slice.
        self.stacked_params = self.dense_stacked_params + tuple(
            expert_stacked_params(moe.experts) if moe is not None else ())
        # The plan fuses exactly when this rank has a fused kernel (fusion/selection.py decided it);
        # dp_combine is benchmark-only (see comm_plan.py): no spec or CLI reaches it.
        plan = plan_communication(groups.config, self.blocks(config), collectives.fused is not None,
                                  dp_combine=dp_combine)
        self.comm = Communicator(plan, groups, collectives, norms=self.kernels.norms)

    @staticmethod
    def blocks(config: Any) -> list[BlockSpec]:
        return pre_norm_blocks(config.num_hidden_layers)

    def kv_shapes(self) -> dict[int, tuple[int, ...]]:
        return {layer.layer_id: layer.self_attn.kv_shape() for layer in self.decoder_layers()}

    def state_shapes(self) -> dict[int, MambaStateShape]:
        return {}

    def decoder_layers(self) -> list[DeepseekV3DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DeepseekV3DecoderLayer)]

    # HF checkpoint names -> (our parameter, shard id): dense MLPs and shared experts.
    dense_stacked_params: Stacked = GATE_UP_STACKED

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for an HF tensor name; None = not ours to load
        (rotary buffers, tied LM head, MTP layers, other EP ranks' experts)."""
        name = name.removeprefix("model.")
        if "rotary_emb." in name:
            return None
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= self.config.num_hidden_layers:
            return None  # MTP (next-token prediction) module
        expert = parse_expert_name(name)
        if expert is not None:
            moe = self.get_submodule(expert.module.rsplit(".", 1)[0])
            if not isinstance(moe, MoE):
                raise WeightShapeError(f"{name}: routed-expert tensor in a dense layer (first_k_dense_replace="
                                       f"{self.config.first_k_dense_replace} in config.json)")
            target = moe.experts.checkpoint_target(expert)
            return None if target is None else (f"{expert.module}.{target[0]}", target[1])
        if ".mlp.shared_experts." in name:  # folded into the routed experts (moe.py) where the kernels allow
            block, rest = name.split(".mlp.", 1)
            moe = self.get_submodule(f"{block}.mlp")
            folded = moe.shared_checkpoint_target(rest) if isinstance(moe, MoE) else None
            if folded is not None:
                return f"{block}.mlp.{folded[0]}", folded[1]
        return stacked_name(name, self.dense_stacked_params)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Logits for ``batch.logits_indices`` rows (all rows if None), [n, vocab_size], and the aux
        states of ``batch.aux_layers``."""
        return decoder_forward(batch, self.comm, self.embed_tokens, self.layers, len(self.layers) * 2, self.norm,
                               self.lm_head, self.config.vocab_size)
