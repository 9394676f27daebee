"""Which implementation of each per-token op a model runs, decided once at construction.

Three sets, each op's fast version checked against its plain reference in tests:

===========  =====================================  ==========================================
name         attention                              norms, RoPE, SiLU-and-mul; routed experts
===========  =====================================  ==========================================
reference    ``paged_attention_reference``          the torch references; per-expert loop
torch        ``paged_attention_torch`` (graphable)  the torch references; ``fused_experts_torch``
triton       ``paged_decode_attention_triton``      Triton kernels (``*_triton.py``; GPU only);
             (decode; several new tokens per        matmuls of <= 64 rows ``decode_linear``, else cuBLAS
             sequence: the flash kernel of          (2..64 rows: RoPE / SiLU-and-mul in the qkv / gate-up
             ``prefill_attention_triton.py``;       matmul's epilogue); ``fused_experts_triton``;
                                                    greedy sampling's argmax ``argmax_triton``; the
                                                    MoE router's logits and choice
                                                    (``router_triton``, one launch each), MLA's
                                                    query / key rows ``mla_assemble_triton`` (and, at
                                                    one row, its absorbed products from block-FP8
                                                    kv_b: ``mla_absorb_triton``) and an
                                                    EAGLE3 draft's input row / greedy choice
                                                    (``draft_input_triton``, ``argmax_to_triton``; one
                                                    launch each); the token embedding's rows
                                                    (``embedding_triton``, one launch);
             trees: the torch one)
flashinfer   ``flashinfer_attention``, planned      as ``triton``
             once per forward (``planner``)
===========  =====================================  ==========================================

Block-FP8 models (``fp8_block.py``) also take ``block_fp8_matmul`` (reference: the weight dequantized,
then ``F.linear``; triton: per-token-group activation quantization + a block-scaled FP8 GEMM, the
project's Triton one or cuBLASLt's ``scaled_mm`` by shape, ``fp8_block_gemm.py``) and ``fused_moe_fp8`` (torch: dequantize + ``fused_experts_torch``; triton:
``fused_moe_fp8_triton.py``; reference: the per-expert loop, dequantizing). ``draft_head``: an EAGLE3 draft's LM head
in block FP8 where the GPU has it (``eagle3.py``; the fast sets' format is ``fp8_block_gemv_triton.draft_head()``,
none by default).

``graph_safe`` says whether a forward reads its layout from device tensors (or a plan made before
it) only, so that the executor may capture it as a CUDA graph (``worker/executor/step_graphs.py``).
``planner`` makes the attention's per-forward planner (``attention_layout.AttentionPlanner``) for a
KV cache; None = the attention needs none. Triton and FlashInfer are imported only by their sets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..parallel.fusion.reference import NormKernels
from .attention import AttentionBackend, paged_attention_reference
from .attention_layout import PlannerFactory
from .draft_input import ArgmaxToFn, DraftInputFn, argmax_to, draft_input
from .fp8_block import BlockFP8, BlockFP8MatmulFn, block_fp8_linear_reference
from .fused_moe import FusedExpertsFn, FusedFP8ExpertsFn, fused_experts_fp8_torch, fused_experts_torch
from .linear import MatmulFn
from .mla import MLAAbsorbFn, MLAAssembleFn, absorb_q, absorb_v, mla_assemble
from .mlp import GateUpActFn, silu_and_mul
from .paged_attention_torch import paged_attention_torch
from .rotary import RopeKernel
from .router import RouterLogitsFn, SelectExpertsFn, router_logits, select_experts
from .self_attention import QKVRopeFn
from .vocab_embedding import EmbeddingFn, embedding_lookup

KERNEL_SETS = ("reference", "torch", "triton", "flashinfer")


@dataclass(frozen=True)
class Kernels:
    name: str = "reference"
    attention: AttentionBackend = paged_attention_reference
    norms: NormKernels = field(default_factory=NormKernels)
    rope: RopeKernel | None = None  # None = RotaryEmbedding's torch ops
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
    matmul: MatmulFn | None = None  # None = F.linear (cuBLAS)
    # A decode batch's matmul with the op after it in its epilogue (``linear_triton``): the qkv projection with
    # RoPE, the gate/up projection with SiLU-and-mul; None = the matmul, then the op's own kernel.
    qkv_rope: QKVRopeFn | None = None
    gate_up_act: GateUpActFn | None = None
    # The greedy choice of each logits row ([n, vocab] -> [n] int64); None = torch.argmax.
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    # An EAGLE3 draft step's glue (``draft_input.py``): its input row (embedding and hidden state, each normed,
    # side by side) and its greedy choice through the draft-to-target table (triton: one launch each).
    draft_input: DraftInputFn = draft_input
    argmax_to: ArgmaxToFn = argmax_to
    # An EAGLE3 draft's LM head in block FP8, quantized at load where the GPU has FP8 (``eagle3.py``), run through
    # ``block_fp8_matmul``; None = the checkpoint's dtype through ``matmul``.
    draft_head: BlockFP8 | None = None
    # Routed MoE experts (``fused_moe.py``); None = RoutedExperts' per-expert loop (host sync).
    fused_moe: FusedExpertsFn | None = None
    # Block-FP8 layers: the linear kernel, and the routed experts' (None = the per-expert loop, dequantizing).
    block_fp8_matmul: BlockFP8MatmulFn = block_fp8_linear_reference
    fused_moe_fp8: FusedFP8ExpertsFn | None = None
    # The MoE router's expert choice from its logits (``router.py``; triton: one launch, ``router_triton.py``).
    select_experts: SelectExpertsFn = select_experts
    # The MoE router's fp32 logits (``router.py``: the rows made fp32, then the GEMM; triton: one launch up to
    # ``router_triton.LOGITS_ROWS`` rows).
    router_logits: RouterLogitsFn = router_logits
    # MLA's query / key rows: RoPE, the latent norm, the concatenations (``mla.py``; triton: one launch).
    mla_assemble: MLAAssembleFn = mla_assemble
    # MLA's absorbed products with W_UK / W_UV (``mla.py``: a bmm with the compute-dtype halves; triton: for a few
    # rows, from kv_b's block-FP8 weight where the layer keeps one, ``mla_absorb_triton.py``).
    mla_absorb: tuple[MLAAbsorbFn, MLAAbsorbFn] = (absorb_q, absorb_v)
    # The token embedding's rows from this rank's vocab shard (``vocab_embedding.py``; triton: one launch).
    embedding: EmbeddingFn = embedding_lookup
    graph_safe: bool = False
    planner: PlannerFactory | None = None

    @staticmethod
    def reference() -> Kernels:
        return Kernels()

    @staticmethod
    def torch_native() -> Kernels:
        return Kernels(name="torch", attention=paged_attention_torch, fused_moe=fused_experts_torch,
                       fused_moe_fp8=fused_experts_fp8_torch, graph_safe=True)

    @staticmethod
    def triton() -> Kernels:
        """GPU kernels; raises ImportError without Triton. Launched with programmatic dependent launch
        where the GPU has it (``pdl.py``)."""
        from . import fp8_block_gemv_triton
        from .argmax_triton import argmax_to_triton, argmax_triton
        from .decode_attention_triton import paged_decode_attention_triton
        from .draft_input_triton import draft_input_triton
        from .embedding_triton import embedding_triton
        from .fp8_block_gemm import block_fp8_linear_fast
        from .fused_moe_fp8_triton import fused_experts_fp8_triton
        from .fused_moe_triton import fused_experts_triton
        from .linear_triton import decode_gate_up_silu, decode_linear, decode_qkv_rope
        from .mla_absorb_triton import absorb_q_triton, absorb_v_triton
        from .mla_assemble_triton import mla_assemble_triton
        from .rms_norm_triton import add_rms_norm_triton, rms_norm_triton
        from .rope_triton import rope_triton
        from .router_triton import router_logits_triton, select_experts_triton
        from .silu_mul_triton import silu_and_mul_triton

        return Kernels(name="triton", attention=paged_decode_attention_triton,
                       norms=NormKernels(rms_norm=rms_norm_triton, add_rms_norm=add_rms_norm_triton),
                       rope=rope_triton, silu_and_mul=silu_and_mul_triton,
                       matmul=decode_linear, qkv_rope=decode_qkv_rope, gate_up_act=decode_gate_up_silu,
                       argmax=argmax_triton, draft_input=draft_input_triton, argmax_to=argmax_to_triton,
                       draft_head=fp8_block_gemv_triton.draft_head(), fused_moe=fused_experts_triton,
                       block_fp8_matmul=block_fp8_linear_fast, fused_moe_fp8=fused_experts_fp8_triton,
                       select_experts=select_experts_triton, router_logits=router_logits_triton,
                       mla_assemble=mla_assemble_triton, mla_absorb=(absorb_q_triton, absorb_v_triton),
                       embedding=embedding_triton, graph_safe=True)

    @staticmethod
    def flashinfer() -> Kernels:
        """The GPU's fast set: FlashInfer paged attention (planned per forward) and the Triton
        norm / RoPE / activation kernels; raises ImportError without FlashInfer or Triton."""
        import flashinfer  # noqa: F401

        from .attention_flashinfer import flashinfer_attention, flashinfer_planner

        base = Kernels.triton()
        return Kernels(name="flashinfer", attention=flashinfer_attention, norms=base.norms, rope=base.rope,
                       silu_and_mul=base.silu_and_mul, matmul=base.matmul, qkv_rope=base.qkv_rope,
                       gate_up_act=base.gate_up_act, argmax=base.argmax, draft_input=base.draft_input,
                       argmax_to=base.argmax_to, draft_head=base.draft_head, fused_moe=base.fused_moe,
                       block_fp8_matmul=base.block_fp8_matmul, fused_moe_fp8=base.fused_moe_fp8,
                       select_experts=base.select_experts, router_logits=base.router_logits,
                       mla_assemble=base.mla_assemble, mla_absorb=base.mla_absorb,
                       embedding=base.embedding, graph_safe=True, planner=flashinfer_planner)

    @staticmethod
    def named(name: str) -> Kernels:
        if name not in KERNEL_SETS:
            raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")
        return {"reference": Kernels.reference, "torch": Kernels.torch_native, "triton": Kernels.triton,
                "flashinfer": Kernels.flashinfer}[name]()
