"""MoE routers: which experts each token goes to, and with what weight.

Two families, as DeepSeek's checkpoints define them (HF transformers is the oracle):

- ``softmax`` (DeepSeek-V2): scores = softmax(logits). ``topk_method="greedy"`` takes the
  top-k scores; ``"group_limited_greedy"`` first keeps the ``topk_group`` expert groups with
  the highest *max* score, then takes the top-k among their experts.
- ``sigmoid`` (DeepSeek-V3 / Kimi-K2 / Nemotron-H, ``topk_method="noaux_tc"``): scores =
  sigmoid(logits); the *choice* uses scores + ``e_score_correction_bias``: a group's score is
  the sum of its two best biased scores, the best ``topk_group`` of ``n_group`` groups are kept,
  and the top-k biased scores among their experts win. The *weights* are the unbiased sigmoid
  scores of the winners.

Then, for both: weights are normalised to sum 1 if ``norm_topk_prob`` and multiplied by
``routed_scaling_factor``. Example (sigmoid, 8 experts in 4 groups of 2, topk_group 2, k 2):
group scores [1.3, 0.4, 1.1, 0.9] keep groups 0 and 2; the two best biased scores among
experts {0, 1, 4, 5} are chosen.

``shared_experts`` > 0 (``moe.py`` folds the shared experts into the fused routed ones): each token also
gets ids ``num_experts`` .. ``num_experts + shared_experts - 1`` in its last slots, weight 1 (the shared
experts' output is added unscaled, as in HF): top-2 of 4 plus one shared -> ids [[1, 3, 4]], weights
[[0.6, 0.4, 1.0]] (times the scaling factor on the routed two only).

The router is replicated on every rank and computes in fp32 whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .weight_source import WeightSource, copy_checked

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "sigmoid"  # "softmax" | "sigmoid"
    topk_method: str = "noaux_tc"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0  # always-on experts appended (ids num_experts.., weight 1): folded shared experts

    @property
    def slots(self) -> int:
        """Ids per token: the routed top-k, then the folded shared experts."""
        return self.top_k + self.shared_experts

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring must be one of {SCORINGS}, not {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, not {self.topk_method!r}")
        if (self.topk_method == "noaux_tc") != (self.scoring == "sigmoid"):
            raise ValueError(f"topk_method {self.topk_method!r} does not go with {self.scoring} scoring")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group} do not fit "
                             f"{self.num_experts} experts")
        if self.grouped and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"{self.topk_group} groups of {self.num_experts // self.n_group} experts "
                             f"cannot hold top_k={self.top_k}")
        if self.shared_experts < 0:
            raise ValueError(f"shared_experts={self.shared_experts} must be >= 0")
        if self.scoring == "sigmoid" and self.num_experts // self.n_group < 2:
            raise ValueError("sigmoid routing scores a group by its two best experts: need >= 2 per group")

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @staticmethod
    def from_hf(config: Any) -> RouterConfig:
        """From a DeepseekV2/V3 (also Kimi-K2) or NemotronH HF config."""
        v2 = getattr(config, "model_type", "") == "deepseek_v2"
        scoring = getattr(config, "scoring_func", None) or ("softmax" if v2 else "sigmoid")
        method = getattr(config, "topk_method", None) or ("greedy" if scoring == "softmax" else "noaux_tc")
        return RouterConfig(
            num_experts=int(config.n_routed_experts),
            top_k=int(config.num_experts_per_tok),
            scoring=scoring,
            topk_method=method,
            n_group=int(getattr(config, "n_group", None) or 1),
            topk_group=int(getattr(config, "topk_group", None) or 1),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
        )


def _group_mask(choice: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """Bool [n, E]: experts in the ``topk_group`` best groups of each token."""
    n, e = choice.shape
    grouped = choice.view(n, cfg.n_group, e // cfg.n_group)
    if cfg.scoring == "sigmoid":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(n, cfg.n_group, e // cfg.n_group).reshape(n, e)


def select_experts(
    logits: torch.Tensor, cfg: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, slots] fp32, expert ids [n, slots] int64) from router logits [n, E] (fp32); slots = top_k
    + the folded shared experts."""
    logits = logits.float()
    if cfg.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        choice = scores
        if cfg.grouped:  # HF DeepseekV2: experts outside the kept groups score 0
            choice = scores.masked_fill(~_group_mask(scores, cfg), 0.0)
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False).indices
    else:
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if cfg.grouped and cfg.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, cfg), float("-inf"))
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return with_shared(weights * cfg.routed_scaling_factor, ids, cfg)


def with_shared(weights: torch.Tensor, ids: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (weights, ids) [n, top_k] with the folded shared experts' slots appended (weight 1)."""
    if not cfg.shared_experts:
        return weights, ids
    n = ids.shape[0]
    shared = torch.arange(cfg.num_experts, cfg.num_experts + cfg.shared_experts, device=ids.device)
    return (torch.cat([weights, weights.new_ones(n, cfg.shared_experts)], 1),
            torch.cat([ids, shared.to(ids.dtype).expand(n, -1)], 1))


# (hidden rows [n, hidden], the gate's weight [E, hidden] fp32) -> logits [n, E] fp32: ``router_logits`` or a kernel
# that equals it but for the order of its sums (``router_triton.router_logits_triton``).
RouterLogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate's logits in fp32, as HF computes them (the rows made fp32, then the product)."""
    return F.linear(x.float(), weight)


# (logits [n, E] fp32, config, correction bias [E] or None) -> (weights [n, slots] fp32, ids [n, slots] int64):
# ``select_experts`` or a kernel that equals it (``router_triton.py``).
SelectExpertsFn = Callable[[torch.Tensor, RouterConfig, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


class TopKRouter(nn.Module):
    """The replicated gate: ``weight`` [E, hidden] and, for noaux_tc, ``e_score_correction_bias``
    [E]; both fp32 (HF keeps them in fp32 too). ``select``: how the experts are chosen from the
    logits, ``logits``: how the logits are made (both chosen once, at construction: ``Kernels.select_experts``,
    ``Kernels.router_logits``)."""

    def __init__(self, hidden: int, cfg: RouterConfig, device: torch.device | str | None = None,
                 select: SelectExpertsFn = select_experts, logits: RouterLogitsFn = router_logits) -> None:
        super().__init__()
        self.cfg = cfg
        self.select = select
        self.logits = logits
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.has_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        copy_checked(param, source.full(), source.name)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [n, hidden] -> weights [n, slots] fp32, ids [n, slots]
        return self.select(self.logits(x, self.weight), self.cfg, self.e_score_correction_bias)
