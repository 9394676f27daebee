"""Nemotron-H: a hybrid stack of single-mixer layers, composition of layers only.

Each layer is ``h = h + mixer(norm(h))`` with one mixer chosen by the layer pattern
(``hybrid_override_pattern`` / transformers-5 ``layers_block_type``):

    M  Mamba2 mixer        heads split over attn_tp   owes attn_tp   tokens ATTN_TP_FULL
    *  attention (no RoPE)  heads split over attn_tp   owes attn_tp   tokens ATTN_TP_FULL
    -  dense relu² MLP      split over tp              owes tp        tokens FULL
    E  MoE (relu² experts, sigmoid grouped router, optional latent projection, shared expert)
                            experts over moe_ep x moe_tp, owes tp     tokens FULL

Every mixer returns a sum still owed to its group; the communicator completes it at the next
layer's input boundary (boundary ``i``, or ``num_layers`` for the final norm) as
the plan says: an all-reduce, a fused all-reduce + add + RMSNorm, or under DP attention one
reduce-scatter (sglang's per-layer communicators with ``allow_reduce_scatter``).

Mamba layers keep per-sequence state in ``batch.state_cache`` (shapes from
``state_shapes()``); attention layers use the paged KV cache (``kv_shapes()``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .decoder_stack import QKV_STACKED, decoder_forward, stacked_name
from .forward_batch import ForwardBatch
from .interface import ModelOutput
from .layers.experts import parse_expert_name
from .layers.kernels import Kernels
from .layers.mamba2 import Mamba2Config, Mamba2Mixer
from .layers.mamba_state import MambaStateShape
from .layers.mlp import Relu2MLP
from .layers.moe import MoE, expert_stacked_params
from .layers.norm import RMSNorm
from .layers.router import RouterConfig
from .layers.self_attention import SelfAttention
from .layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from .layers.weight_source import WeightShapeError
from .parallel.collectives import Collectives
from .parallel.comm_plan import BlockSpec, plan_communication, vocab_group
from .parallel.communicator import Communicator, ForwardContext
from .parallel.groups import ParallelGroups
from .parallel.layouts import Layout, Unreduced

# transformers 5 layer types (and the 4.x remote-code names) -> pattern letter
_LETTERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
            "mlp": "-", "moe": "E"}
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"


Mixer = Mamba2Mixer | SelfAttention | Relu2MLP | MoE


def layer_pattern(config: Any) -> str:
    """The layer letters, e.g. "M*-EME", from either config spelling."""
    types = getattr(config, "layers_block_type", None)
    if types:
        unknown = sorted(set(types) - set(_LETTERS))
        if unknown:
            raise WeightShapeError(f"layers_block_type has unknown layer types {unknown}")
        return "".join(_LETTERS[t] for t in types)
    pattern = getattr(config, "hybrid_override_pattern", None)
    if not pattern or set(pattern) - {MAMBA, ATTENTION, MLP, MOE}:
        raise WeightShapeError(f"hybrid_override_pattern {pattern!r} must be letters of 'M*-E'")
    return str(pattern)


def mamba2_config(config: Any) -> Mamba2Config:
    return Mamba2Config(
        hidden=config.hidden_size,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        n_groups=config.n_groups,
        state_size=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        # As transformers' NemotronHMamba2Mixer: no upper limit, time_step_min as the floor.
        time_step_limit=(float(config.time_step_min), math.inf),
        norm_eps=config.layer_norm_epsilon,
        proj_bias=bool(getattr(config, "use_bias", False)),
        conv_bias=bool(getattr(config, "use_conv_bias", True)),
        activation=getattr(config, "mamba_hidden_act", "silu"),
    )


def _moe(config: Any, groups: ParallelGroups, dtype: torch.dtype, device: torch.device | str | None) -> MoE:
    if getattr(config, "mlp_hidden_act", "relu2") != "relu2":
        raise WeightShapeError(f"mlp_hidden_act={config.mlp_hidden_act!r}: Nemotron-H experts are relu2")
    # transformers' NemotronHMoE: shared expert of moe_shared_expert_intermediate_size (not times
    # n_shared_experts), latent projections with mlp_bias.
    return MoE(config.hidden_size, config.moe_intermediate_size, RouterConfig.from_hf(config), groups,
               gated=False, activation="relu2", shared_intermediate=config.moe_shared_expert_intermediate_size,
               latent_size=getattr(config, "moe_latent_size", None), latent_bias=bool(config.mlp_bias), shared_bias=bool(config.mlp_bias),
               dtype=dtype, device=device)


class NemotronHLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, kind: str, groups: ParallelGroups, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        h = config.hidden_size
        self.layer_id = layer_id
        self.kind = kind
        self.norm = RMSNorm(h, config.layer_norm_epsilon, dtype, device)
        self.mixer: Mixer
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(layer_id, mamba2_config(config), groups.attn_tp, dtype, device)
        elif kind == ATTENTION:
            # transformers' NemotronHAttention has no biases whatever attention_bias says.
            self.mixer = SelfAttention(layer_id, h, config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim, groups.attn_tp, rotary=None, dtype=dtype, device=device)
        elif kind == MLP:
            self.mixer = Relu2MLP(h, config.intermediate_size, groups.tp, bool(config.mlp_bias), dtype, device)
        else:
            self.mixer = _moe(config, groups, dtype, device)

    @property
    def input_boundary(self) -> int:
        return self.layer_id

    @property
    def input_norm(self) -> RMSNorm:
        return self.norm

    def forward(self, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
                ctx: ForwardContext) -> tuple[Unreduced, torch.Tensor]:
        # h: [n, hidden] normed input (the decoder stack ran this layer's boundary) -> the mixer's owed output
        mixer = self.mixer
        if isinstance(mixer, (Mamba2Mixer, SelfAttention)):
            return mixer(h, batch), residual
        if isinstance(mixer, MoE):
            return mixer(h, ctx.valid_rows), residual
        return mixer(h), residual


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: Any, groups: ParallelGroups, collectives: Collectives,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 kernels: Kernels | None = None, *, dp_combine: str = "reduce_scatter") -> None:
        super().__init__()
        self.config = config
        # Nemotron-H's mixers take no kernel choice yet: the set is kept so the worker sees one
        # (the torch references; not graph-safe: its Mamba state is per sequence).
        self.kernels = kernels or Kernels.reference()
        self.pattern = layer_pattern(config)
        vgroup = groups.by_name(vocab_group(groups.config))
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, vgroup, dtype, device)
        self.layers = nn.ModuleList(
            NemotronHLayer(config, i, kind, groups, dtype, device) for i, kind in enumerate(self.pattern)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, vgroup, dtype, device)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.embeddings)
        moes = [m for _, m in self.mixers() if isinstance(m, MoE)]
        # Stacked parameters for the loader; routed experts are listed so that it expects every
        # local expert (the same ids in every MoE layer).
        self.stacked_params: list[tuple[str, str, object]] = list(QKV_STACKED) + (
            expert_stacked_params(moes[0].experts) if moes else [])
        # The plan fuses exactly when this rank has a fused kernel (fusion/selection.py decided it);
        # dp_combine is benchmark-only (see comm_plan.py): no spec or CLI reaches it.
        plan = plan_communication(groups.config, self.blocks(config), collectives.fused is not None,
                                  dp_combine=dp_combine)
        self.comm = Communicator(plan, groups, collectives, norms=self.kernels.norms)

    @staticmethod
    def blocks(config: Any) -> list[BlockSpec]:
        return [
            BlockSpec(f"layers.{i}.mixer", Layout.ATTN_TP_FULL, "attn_tp") if kind in (MAMBA, ATTENTION)
            else BlockSpec(f"layers.{i}.mixer", Layout.FULL, "tp")
            for i, kind in enumerate(layer_pattern(config))
        ]

    def mixers(self) -> list[tuple[int, Mixer]]:
        """(layer id, mixer) of every layer."""
        layers: list[NemotronHLayer] = list(self.layers)  # type: ignore[arg-type]
        return [(i, layer.mixer) for i, layer in enumerate(layers)]

    def kv_shapes(self) -> dict[int, tuple[int, int]]:
        """Attention layers only: layer id -> (kv_heads, head_dim) on this rank."""
        return {i: m.kv_shape() for i, m in self.mixers() if isinstance(m, SelfAttention)}

    def state_shapes(self) -> dict[int, MambaStateShape]:
        """Mamba layers only: layer id -> per-sequence state shapes on this rank."""
        return {i: m.state_shape() for i, m in self.mixers() if isinstance(m, Mamba2Mixer)}

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for an HF tensor name; None = not ours to load."""
        for prefix in ("backbone.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith("mtp.") or (name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings",
                                                                            False)):
            return None  # multi-token-prediction layers are not served (HF ignores them too)
        expert = parse_expert_name(name)
        if expert is not None:
            moe = self.get_submodule(expert.module.rsplit(".", 1)[0])
            if not isinstance(moe, MoE):
                raise WeightShapeError(f"{name}: routed-expert tensor in a layer that is not MoE")
            target = moe.experts.checkpoint_target(expert)
            return None if target is None else (f"{expert.module}.{target[0]}", target[1])
        return stacked_name(name, QKV_STACKED)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Logits for ``batch.logits_indices`` rows (all rows if None), [n, vocab_size], and the aux
        states of ``batch.aux_layers``."""
        return decoder_forward(batch, self.comm, self.embeddings, self.layers, len(self.layers), self.norm_f,
                               self.lm_head, self.config.vocab_size)
