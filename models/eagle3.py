"""EAGLE3 draft model (`LlamaForCausalLMEagle3`), HF-style checkpoint layout.

Checkpoint tensors: ``fc.weight`` [H, 3*H_target], ``midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v take
2H: normed token embedding ++ normed hidden), ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] (draft id + d2t =
target id), optional ``embed_tokens.weight`` (else shared from the target).

One draft step, per token t:  hidden_in = fc(aux_t) on the first step (3H wide), else the
draft's own previous pre-norm output (H wide); residual = hidden_in;
x = cat(input_norm(embed(token)), hidden_norm(hidden_in)); h = attn(x); (h, residual) =
post_norm(h + residual); h = mlp(h); (out, residual) = norm(h + residual);
logits = lm_head(out) over the draft vocab; the next step's hidden is ``residual``.

``kernels``: the target's kernel set (chosen once, at construction): its norms, add + norm, RoPE,
SiLU-and-mul and matmul, as the target's layers run them (on a GPU the Triton kernels: a draft step
of torch ops was some 60 small kernels), ``fc`` and ``lm_head`` included (they had gone to cuBLAS:
~5 us a call in a chain step on an H100, 2026-12-05-decode-gemm-narrow-tiles-ab-smollm2-h100.json);
``attention_backend`` apart, since the draft takes the target's attention only where its heads fit
(``worker/spec_decode/draft_model.py``).

The LM head is a chain step's largest matmul (SmolLM2's draft: [16 384, 576], 7.4 of a step's ~27 us on an H100,
2026-12-06-verify-per-launch-attribution-smollm2-h100.json); a large one is bound by its bytes (a Llama-3-8B-sized
head [32 000, 4 096]: 84.0 us in bf16, 50.5 in FP8; SmolLM2's, bound by latency, 8.86 against 7.75:
2026-12-07-draft-head-probe-h100.json). Where the kernel set names a
block-FP8 format for it (``Kernels.draft_head``) and the GPU has FP8 (compute capability >= 8.9), the head is
quantized at load (``quantize_head``: e4m3, one scale per block) and runs through the set's ``block_fp8_matmul``
(one row: the FP8 GEMV), half the bytes (off until a GPU times it: ``fp8_block_gemv_triton.DRAFT_HEAD_BLOCK``).
A draft only proposes: the target's verify decides every token, so the head's rounding moves the acceptance, never
the text at temperature 0 nor the distribution sampled at 1.

The draft is small and runs on the engine's leader only (no collectives); its KV cache is its
own. Aux states come from the target's forward (``ForwardBatch.aux_layers`` ->
``ModelOutput.hidden``): the complete residual stream entering layers ``aux_layers(...)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decoder_stack import GATE_UP_STACKED, QKV_STACKED, stacked_name
from .forward_batch import ForwardBatch
from .interface import ModelOutput
from .layers.attention import AttentionBackend
from .layers.attention_layout import AttentionDims
from .layers.fp8_block import BlockFP8, BlockFP8MatmulFn, quantize_weight
from .layers.kernels import Kernels
from .layers.linear import MatmulFn, use_matmul
from .layers.mamba_state import MambaStateShape
from .layers.mlp import GatedMLP
from .layers.norm import RMSNorm
from .layers.rotary import RotaryEmbedding, rope_parameters
from .layers.self_attention import SelfAttention
from .parallel.groups import Group
from .quantization import FP8_MIN_CAPABILITY


def aux_layers(num_target_layers: int, draft_config: Any = None) -> list[int]:
    """Target layers whose *input* (complete residual stream) feeds the draft.

    Default ``[2, N//2, N-3]``. A draft config's ``eagle_aux_hidden_state_layer_ids`` name the
    layers whose *output* is wanted, so their input index is id + 1 — sglang's rule adds the
    1 only when the first id is 1 (two conventions exist in published drafts).
    """
    eagle = getattr(draft_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not ids:
        n = num_target_layers
        return [2, n // 2, n - 3]
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)


class Eagle3Draft(nn.Module):
    def __init__(self, config: Any, target_hidden: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, attention_backend: AttentionBackend | None = None,
                 kernels: Kernels | None = None) -> None:
        super().__init__()
        self.config = config
        kernels = kernels or Kernels.reference()
        self.norms = kernels.norms
        self.draft_input = kernels.draft_input
        self.argmax_to = kernels.argmax_to  # the greedy choice through the draft-to-target table
        h = config.hidden_size
        one = Group.single("tp")
        head_dim = int(getattr(config, "head_dim", None) or h // config.num_attention_heads)
        theta, scaling = rope_parameters(config)
        self.draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(3 * target_hidden, h, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h, dtype=dtype, device=device).requires_grad_(False)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.self_attn = SelfAttention(0, h, config.num_attention_heads, config.num_key_value_heads, head_dim,
                                       one, RotaryEmbedding(head_dim, theta, scaling, kernel=kernels.rope).to(device),
                                       input_size=2 * h, dtype=dtype, device=device,
                                       attention_backend=attention_backend, qkv_rope=kernels.qkv_rope)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(h, config.intermediate_size, one, dtype=dtype, device=device, act=kernels.silu_and_mul,
                            gate_up_act=kernels.gate_up_act)
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long, device=device))
        self.d2t: torch.Tensor
        self.has_own_embedding = False
        self.matmul: MatmulFn = F.linear  # fc and lm_head as well as the layer's own (the kernel set's, below)
        if kernels.matmul is not None:
            use_matmul(self, kernels.matmul)
        self.head_format: BlockFP8 | None = kernels.draft_head  # the LM head's block FP8 (``quantize_head``)
        self.block_fp8_matmul: BlockFP8MatmulFn = kernels.block_fp8_matmul
        self.lm_head_fp8: torch.Tensor | None = None  # e4m3 [draft_vocab, H] and its block scales, once quantized
        self.lm_head_scale_inv: torch.Tensor | None = None

    def share_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's (full, unsharded) embedding table when the draft has none."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight[: self.embed_tokens.weight.shape[0]])

    def kv_shapes(self) -> dict[int, tuple[int, int]]:
        return {0: self.self_attn.kv_shape()}

    def state_shapes(self) -> dict[int, MambaStateShape]:
        return {}

    def attention_dims(self) -> AttentionDims:
        return self.self_attn.attention_dims()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """One draft step for every token of ``batch``.

        batch.input_hidden: [n, 3*H_target] (aux states, first step) or [n, H] (previous draft output).
        Returns draft-vocab logits [rows, draft_vocab] (``batch.logits_indices`` rows when set) and
        ``hidden = (next hidden [n, H],)`` for every row.
        """
        hidden = batch.input_hidden
        if hidden is None:
            raise ValueError("the EAGLE3 draft needs batch.input_hidden (aux states or its own hidden state)")
        if hidden.shape[-1] != self.embed_tokens.weight.shape[1]:
            hidden = self.matmul(hidden, self.fc.weight, None)
        residual = hidden
        add_norm = self.norms.add_rms_norm
        x = self.draft_input(batch.input_ids, self.embed_tokens.weight, hidden, self.input_layernorm.weight,
                             self.hidden_norm.weight, self.input_layernorm.eps)
        attn = self.self_attn(x, batch).partial  # size-1 group: already complete
        post = self.post_attention_layernorm
        h, residual = add_norm(attn, residual, post.weight, post.eps)
        h = self.mlp(h).partial
        out, residual = add_norm(h, residual, self.norm.weight, self.norm.eps)
        if batch.logits_indices is not None:
            out = out.index_select(0, batch.logits_indices)  # not out[...]: its index kernel costs 2x
        return ModelOutput(self.head(out), (residual,))

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """[rows, H] -> draft-vocab logits [rows, draft_vocab]: the quantized head once ``quantize_head`` ran,
        else the checkpoint's."""
        if self.lm_head_fp8 is None or self.lm_head_scale_inv is None or self.head_format is None:
            return self.matmul(out, self.lm_head.weight, None)
        return self.block_fp8_matmul(out, self.lm_head_fp8, self.lm_head_scale_inv, None, self.head_format)

    @torch.no_grad()
    def quantize_head(self) -> bool:
        """Quantize the LM head to ``head_format`` where the kernel set names one, the weights sit on a GPU with
        FP8 (compute capability >= 8.9) and the head splits into whole blocks; the checkpoint's head is then freed.
        Says whether it did."""
        w, fmt = self.lm_head.weight, self.head_format
        if fmt is None or not has_fp8(w.device) or w.shape[0] % fmt.block_n or w.shape[1] % fmt.block_k:
            return False
        self.lm_head_fp8, self.lm_head_scale_inv = quantize_weight(w, fmt)
        self.lm_head.weight = nn.Parameter(w.new_empty(0, w.shape[1]), requires_grad=False)
        return True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # --- loading ----------------------------------------------------------------------

    checkpoint_buffers = ("d2t",)
    optional_params = ("embed_tokens.weight",)  # shared from the target when absent

    stacked_params = QKV_STACKED + GATE_UP_STACKED

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object] | None:
        name = name.removeprefix("model.")
        if name == "t2d":
            return None
        name = name.removeprefix("midlayer.")
        if name == "embed_tokens.weight":
            self.has_own_embedding = True
        return stacked_name(name, self.stacked_params)


def has_fp8(device: torch.device) -> bool:
    """Whether ``device`` is a GPU with FP8 tensor cores and e4m3 conversions (``quantization.FP8_MIN_CAPABILITY``,
    the bar block-FP8 checkpoints are served natively above)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def load_eagle3_draft(model_dir: str, target_hidden: int, target_embedding: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                      attention_backend: AttentionBackend | None = None, kernels: Kernels | None = None
                      ) -> Eagle3Draft:
    """Load an EAGLE3 draft checkpoint; ``target_embedding`` ([vocab, H], unsharded) is used
    when the draft ships no embedding of its own. ``attention_backend``: default the reference;
    ``kernels``: the norms, RoPE, activation and matmul (default the references)."""
    from .loader import (
        CheckpointError,
        architecture_of,
        checkpoint_files,
        iter_checkpoint,
        load_config,
        load_weights,
    )

    config = load_config(model_dir)
    arch = architecture_of(config)
    if "Eagle3" not in arch:
        raise CheckpointError(f"{model_dir}: architecture {arch!r} is not an EAGLE3 draft (LlamaForCausalLMEagle3)")
    draft = Eagle3Draft(config, target_hidden, dtype, device, attention_backend, kernels)
    load_weights(draft, iter_checkpoint(checkpoint_files(model_dir)))
    draft.quantize_head()
    if not draft.has_own_embedding:
        if target_embedding is None:
            raise CheckpointError(f"{model_dir}: the draft has no embed_tokens and no target embedding was given")
        draft.share_embedding(target_embedding)
    return draft
