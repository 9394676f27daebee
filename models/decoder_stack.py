"""What every decoder-only model here shares: the forward over its layers, and checkpoint renaming.

The model files only say which embedding, layers, final norm and head they have; the order of
work lives here once: begin the forward (its ``ForwardContext``), run each layer's input
boundary, capture the EAGLE3 aux states there, run the layer, complete the last owed sum in the
final boundary, keep the rows whose logits are wanted, gather the vocabulary shards.

The aux capture rule (seed bug 1, sglang PR #28343): the aux state of layer i is the residual
stream *after* layer i's input boundary completed every sum owed to it (the complete output of
layer i-1, pre-norm) — never ``hidden + residual`` before it, which under a deferred all-reduce
is each rank's own partial sum. Boundaries return a fresh residual that nothing writes into
later, so the captured tensor needs no copy.

Asked for layer N (the number of layers: one past the last), the stream entering the final norm,
completed by the final boundary: what the LM head reads before its norm (``fusedserve train-draft``
keeps it instead of the target's logits, ~28x smaller for SmolLM2's 16 384-token draft vocabulary).

Benchmark-only: ``aux_capture="before_completion"`` captures ``incoming.partial + residual`` in front
of the boundary instead — sglang's capture before PR #28343, each rank's own partial sum wherever the
plan defers a sum into the boundary — so ``bench/seed_bug_capture.py`` can measure what the rule is
worth. A model keyword like ``dp_combine`` (``build_rank(**model_kwargs)``): no spec, config or CLI
reaches it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from .forward_batch import ForwardBatch
from .interface import ModelOutput
from .layers.norm import RMSNorm
from .parallel.comm_plan import BlockSpec
from .parallel.communicator import Communicator, ForwardContext, NormWeights
from .parallel.layouts import Layout, Unreduced

Stacked = tuple[tuple[str, str, object], ...]  # (our fused name part, HF name part, shard id)

# Where the EAGLE3 aux state is read: "complete" is the rule; "before_completion" exists for benchmarks only.
AUX_CAPTURES = ("complete", "before_completion")


def check_aux_capture(aux_capture: str) -> str:
    if aux_capture not in AUX_CAPTURES:
        raise ValueError(f"aux_capture must be one of {AUX_CAPTURES}, not {aux_capture!r}")
    return aux_capture


class DecoderLayer(Protocol):
    """A layer after its input boundary: ``input_boundary`` (its index in the plan) and
    ``input_norm`` say where its input is completed and normed; the call runs the rest."""

    layer_id: int
    input_boundary: int

    @property
    def input_norm(self) -> NormWeights: ...

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
                 ctx: ForwardContext) -> tuple[Unreduced, torch.Tensor]: ...


class PreNormLayer(nn.Module):
    """A Llama-shaped layer (Llama, DeepSeek-V3): boundary 2i completes and norms its input with
    ``input_layernorm``, attention runs, boundary 2i + 1 completes the attention's sum into the residual
    and norms it with ``post_attention_layernorm``, then the MLP (``mlp_out``); a subclass builds the
    four parts."""

    layer_id: int
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    self_attn: Any  # a subclass's attention: (h, batch) -> its owed sum
    mlp: Any

    @property
    def input_boundary(self) -> int:
        return 2 * self.layer_id

    @property
    def input_norm(self) -> RMSNorm:
        return self.input_layernorm

    def mlp_out(self, h: torch.Tensor, ctx: ForwardContext) -> Unreduced:
        return self.mlp(h)  # type: ignore[no-any-return]

    def forward(self, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
                ctx: ForwardContext) -> tuple[Unreduced, torch.Tensor]:
        # h: [n, hidden] normed input (the decoder stack ran boundary 2i) -> the MLP's owed sum
        h, residual = ctx.boundary(2 * self.layer_id + 1, self.self_attn(h, batch), residual,
                                   self.post_attention_layernorm)
        return self.mlp_out(h, ctx), residual


def pre_norm_blocks(num_layers: int) -> list[BlockSpec]:
    """The comm plan's blocks of a stack of ``PreNormLayer``: per layer its attention (over attn_tp, the
    sum owed at boundary 2i + 1) and its MLP (over tp, owed at the next layer's boundary 2i + 2)."""
    out: list[BlockSpec] = []
    for i in range(num_layers):
        out.append(BlockSpec(f"layers.{i}.attn", Layout.ATTN_TP_FULL, "attn_tp"))
        out.append(BlockSpec(f"layers.{i}.mlp", Layout.FULL, "tp"))
    return out


def decoder_forward(batch: ForwardBatch, comm: Communicator, embed: Any, layers: Iterable[Any],
                    final_boundary: int, final_norm: Any, lm_head: Any, vocab_size: int,
                    aux_capture: str = "complete") -> ModelOutput:
    """Logits for ``batch.logits_indices`` rows (all rows if None), [n, vocab_size], and the aux
    states of ``batch.aux_layers`` ([num_tokens, hidden] each, in that order). ``layers``: each a
    ``DecoderLayer`` (an ``nn.ModuleList`` of them). ``aux_capture``: benchmark-only (see the
    module's docstring)."""
    ctx = comm.begin_forward(batch.num_tokens, batch.dp_num_tokens, batch.dp_padding, batch.dp_real_tokens)
    wanted = frozenset(batch.aux_layers)
    aux: dict[int, torch.Tensor] = {}
    x: Unreduced = embed(batch.input_ids)
    residual: torch.Tensor | None = None
    early = aux_capture == "before_completion"
    end = 0  # one past the last layer: "layer N" is the final norm
    for layer in layers:
        if early and layer.layer_id in wanted:  # benchmark-only: the pre-#28343 capture
            aux[layer.layer_id] = x.partial if residual is None else x.partial + residual
        h, residual = ctx.boundary(layer.input_boundary, x, residual, layer.input_norm)
        if layer.layer_id in wanted and not early:
            aux[layer.layer_id] = residual  # the complete stream entering this layer
        x, residual = layer(h, residual, batch, ctx)
        end = layer.layer_id + 1
    h, final_stream = ctx.boundary(final_boundary, x, residual, final_norm)
    if end in wanted:
        aux[end] = final_stream  # the complete stream entering the final norm
    if batch.logits_indices is not None:
        h = h.index_select(0, batch.logits_indices)  # not h[...]: its index kernel costs 2x
    logits = ctx.gather_vocab(lm_head.logits_shard(h))
    missing = wanted - aux.keys()
    if missing:
        raise ValueError(f"aux states asked of layers {sorted(missing)}, which this model does not have")
    return ModelOutput(logits[:, :vocab_size], tuple(aux[i] for i in batch.aux_layers))


# HF checkpoint names -> (our parameter, shard id): q/k/v stacked into one projection, gate/up into another.
QKV_STACKED: Stacked = ((".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"),
                        (".qkv_proj.", ".v_proj.", "v"))
GATE_UP_STACKED: Stacked = ((".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))


def stacked_name(name: str, stacked: Stacked) -> tuple[str, object | None]:
    """An HF tensor name -> our parameter name and shard id (None: loaded whole)."""
    for ours, theirs, shard in stacked:
        if theirs in name:
            return name.replace(theirs, ours), shard
    return name, None
