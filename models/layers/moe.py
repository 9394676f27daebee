"""Mixture-of-experts block: replicated router, routed experts split over moe_ep x moe_tp,
optional shared experts split over tp, optional latent projection. Returns ONE sum owed to tp.

    x ─┬─ router (fp32, replicated) ──────────────── weights, ids   (padding rows: no expert)
       ├─ [fc1_latent_proj H→L, replicated] ─ routed experts (local ones, moe_tp slice)
       │        ─ [fc2_latent_proj L→H, bias on tp rank 0] ─────────────── partial ─┐
       └─ shared experts (tp-split MLP on full H) ───────────────────────── partial ─┴─ + ─ Unreduced(tp)

Every tp rank holds one (moe_ep_rank, moe_tp_rank) pair, so the sum over the tp group adds
every expert's every intermediate slice exactly once, and the shared experts' tp slices too.
The block never reduces: the communicator completes the sum where the plan says (an
all-reduce, a fused all-reduce + add + RMSNorm, or under DP attention a reduce-scatter).

Constructor choices (one class for DeepSeek-V2/V3, Kimi-K2 and Nemotron-H):
- ``router``: a ``RouterConfig`` (softmax or sigmoid scoring, grouped top-k, ...).
- ``gated``/``activation``: DeepSeek = gated SwiGLU (``True, "silu"``); Nemotron-H = non-gated
  squared ReLU (``False, "relu2"``). Shared experts use the same kind (``GatedMLP`` /
  ``Relu2MLP`` over tp), so only those two pairs are accepted when ``shared_intermediate > 0``.
- ``shared_intermediate``: total intermediate size of the shared experts (DeepSeek:
  ``moe_intermediate_size * n_shared_experts``; Nemotron-H: ``moe_shared_expert_intermediate_size``);
  0 = none.
- ``shared_act``: the gated shared experts' SiLU-and-mul kernel (None = the torch reference).
- ``select_experts``: the router's expert choice from its logits (``router.py``; on a GPU
  ``router_triton.py``, one launch); ``logits``: the router's fp32 logits (the same files).
- ``fused_experts``: the routed experts' block computation (``fused_moe.py``, CUDA-graph
  capturable; gated SiLU experts only); None = their per-expert loop.
- ``fp8``: block-FP8 routed and shared experts (``fp8_block.py``; DeepSeek-V3 / Kimi-K2 releases),
  computed by ``fused_experts_fp8`` (or the per-expert loop, dequantizing); the router stays unquantized
  (fp32, as HF computes it).
- ``latent_size``: Nemotron-H latent MoE (``moe_latent_size``): routed experts work in L dims
  between ``fc1_latent_proj`` (H→L) and ``fc2_latent_proj`` (L→H); shared experts see full H.
  ``latent_bias`` and ``shared_bias`` are Nemotron-H's ``mlp_bias`` (routed experts have no
  bias in any HF model). fc2 is linear, so applying it to this rank's partial (bias
  added on tp rank 0 only) keeps the output a partial sum owed to tp.

Shared experts folded into the routed ones (sglang's shared-experts fusion), chosen at construction where
the fused block computation runs them (``fused_experts`` / ``fused_experts_fp8`` given), there is one
gated SiLU shared expert of the routed experts' size without bias, and no expert parallelism (moe_tp is tp:
the shared expert's tp slice is a routed expert's moe_tp slice): the router appends its id with weight 1
(``RouterConfig.shared_experts``) and ``RoutedExperts`` holds its weights after the routed ones, so one launch
per projection computes both (DeepSeek-V3's shared expert at batch 8 had been two GEMMs, two activation
quantizations and a SiLU-and-mul launch of its own). ``shared_experts`` is then None; the checkpoint's
``shared_experts.*`` tensors load into the experts (``shared_checkpoint_target``).

Parameter names follow HF (``gate``, ``experts``, ``shared_experts``, ``fc1_latent_proj``,
``fc2_latent_proj``), with the shared experts' gate/up merged as in ``GatedMLP``.
Checkpoint names of the routed experts are mapped by ``RoutedExperts.checkpoint_target``
(see ``experts.py``); ``expert_stacked_params`` lists the shard ids the loader must see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import ParallelGroups
from ..parallel.layouts import Unreduced
from .experts import SCALE, RoutedExperts
from .fp8_block import BlockFP8
from .fused_moe import FusedExpertsFn, FusedFP8ExpertsFn
from .linear import ReplicatedLinear
from .mlp import GatedMLP, Relu2MLP
from .router import RouterConfig, RouterLogitsFn, SelectExpertsFn, TopKRouter, router_logits, select_experts


class MoE(nn.Module):
    def __init__(self, hidden: int, expert_intermediate: int, router: RouterConfig, groups: ParallelGroups,
                 gated: bool = True, activation: str = "silu", shared_intermediate: int = 0,
                 latent_size: int | None = None, latent_bias: bool = False, shared_bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 fused_experts: FusedExpertsFn | None = None, fp8: BlockFP8 | None = None,
                 fused_experts_fp8: FusedFP8ExpertsFn | None = None,
                 select_experts: SelectExpertsFn = select_experts, logits: RouterLogitsFn = router_logits,
                 shared_act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.tp = groups.tp
        fused = fused_experts_fp8 if fp8 is not None else fused_experts
        fold = int(fused is not None and shared_intermediate == expert_intermediate and (gated, activation) == (
            True, "silu") and not latent_size and not shared_bias and groups.moe_ep.size == 1
            and groups.moe_tp.ranks == groups.tp.ranks)
        if fold:
            router = replace(router, shared_experts=1)
            shared_intermediate = 0
        self.gate = TopKRouter(hidden, router, device, select_experts, logits)
        expert_dim = latent_size or hidden
        self.fc1_latent_proj: ReplicatedLinear | None = None
        self.fc2_latent_proj: ReplicatedLinear | None = None
        if latent_size:
            self.fc1_latent_proj = ReplicatedLinear(hidden, latent_size, latent_bias, dtype, device)
            self.fc2_latent_proj = ReplicatedLinear(latent_size, hidden, latent_bias, dtype, device)
        self.experts = RoutedExperts(router.num_experts, expert_dim, expert_intermediate, groups.moe_ep,
                                     groups.moe_tp, gated, activation, dtype, device, fused=fused_experts, fp8=fp8,
                                     fused_fp8=fused_experts_fp8, shared=fold)
        self.shared_experts: GatedMLP | Relu2MLP | None = None
        if shared_intermediate:
            if (gated, activation) == (True, "silu"):
                self.shared_experts = GatedMLP(hidden, shared_intermediate, groups.tp, shared_bias, dtype, device,
                                               act=shared_act, fp8=fp8)
            elif (gated, activation) == (False, "relu2") and fp8 is None:
                self.shared_experts = Relu2MLP(hidden, shared_intermediate, groups.tp, shared_bias, dtype, device)
            else:
                raise ValueError(f"shared experts support gated silu or non-gated relu2 (block FP8: gated silu), "
                                 f"not gated={gated} {activation}" + (" in FP8" if fp8 else ""))

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> Unreduced:
        """x: [n, hidden]; valid: bool [n] real rows (None = all) -> owed [n, hidden] to "tp".

        Rows with valid False (DP-attention padding) route to no expert and get zero output.
        """
        weights, ids = self.gate(x)
        if valid is not None:
            ids = ids.masked_fill(~valid[:, None], -1)
        routed_in = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        partial = self.experts(routed_in, ids, weights)
        if self.fc2_latent_proj is not None:
            bias = self.fc2_latent_proj.bias if self.tp.rank == 0 else None
            partial = F.linear(partial, self.fc2_latent_proj.weight, bias)
        if self.shared_experts is not None:  # split over tp by construction: owes the same group
            partial = partial + self.shared_experts(x).partial
        if valid is not None:
            partial = partial.masked_fill(~valid[:, None], 0.0)
        return Unreduced(partial, self.tp.name)

    def shared_checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """(our parameter relative to this block, shard id) of a checkpoint tensor ``shared_experts.<part>.weight``
        (or its ``_scale_inv``) where the shared expert is folded into the routed ones; None where it is not
        (the ``shared_experts`` module loads it) or for another name."""
        parts = name.split(".")
        if not self.experts.shared or len(parts) != 3 or parts[0] != "shared_experts" or \
                parts[2] not in ("weight", "weight" + SCALE):
            return None
        param, shard = self.experts.shared_checkpoint_target(parts[1], parts[2].endswith(SCALE))
        return f"experts.{param}", shard


def expert_stacked_params(experts: RoutedExperts) -> list[tuple[str, str, object]]:
    """``stacked_params`` rows (ours, theirs, shard id) for a model's routed-expert parameters (and a folded
    shared expert's), so the loader expects every local expert's tensors (the same ids in every MoE layer), e.g.
    (".experts.gate_up_proj", ".experts.5.up_proj.weight", ("up_proj", 5))."""
    return [(f".experts.{param}", f".{experts.checkpoint_name(part, expert)}.weight"
             + (SCALE if param.endswith(SCALE) else ""), (part, expert))
            for param, ids in experts.shard_ids().items() for part, expert in ids]
