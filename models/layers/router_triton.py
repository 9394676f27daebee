"""The MoE router's expert choice in one Triton launch (GPU; CUDA-graph capturable).

Plain reference: ``router.select_experts`` (about fifteen torch kernels a layer: sigmoid, bias, the
group scores' top-2, the groups' top-k, a scatter, a mask, the experts' top-k, a gather, the
normalisation). Here one program per token holds its ``E`` router logits as ``[groups, per group]``
and does all of it in registers:

1. scores = sigmoid (or softmax) of the logits; choice = scores (+ ``e_score_correction_bias``);
2. grouped methods: a group's score is the sum of its two best choices (sigmoid) or its best (softmax);
   the ``topk_group`` best groups are kept, one argmax at a time; the others' choices become -inf
   (sigmoid) or 0 (softmax, as HF's DeepSeek-V2);
3. ``top_k`` times: the best choice wins, its unbiased score is its weight, and it leaves the race;
4. weights normalised to sum 1 (``norm_topk_prob``), times ``routed_scaling_factor``;
5. the folded shared experts' slots after them (``RouterConfig.shared_experts``: ids E.., weight 1).

The experts come out best first (``torch.topk(sorted=False)`` leaves the order open; no consumer
reads it). Ties between exactly equal choices go to the lower expert id. Group sizes and group
counts that are not powers of two are padded with -inf. Logits are fp32, as the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .router import RouterConfig, select_experts


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scale,
                   GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, G_PAD: tl.constexpr, J_PAD: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, K_PAD: tl.constexpr,
                   SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)[:, None]
    j = tl.arange(0, J_PAD)[None, :]
    real = (g < GROUPS) & (j < PER_GROUP)
    expert = g * PER_GROUP + j  # [G_PAD, J_PAD]
    logit = tl.load(logits_ptr + row * stride_l + expert, mask=real, other=float("-inf"))
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        e = tl.exp(logit - tl.max(tl.max(logit, 1), 0))
        score = e / tl.sum(tl.sum(e, 1), 0)
    score = tl.where(real, score, 0.0)
    choice = tl.where(real, score, float("-inf"))
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=real, other=0.0)
    if GROUPED:
        best = tl.max(choice, 1)  # [G_PAD]
        if SIGMOID:  # a group scores the sum of its two best choices
            first = tl.argmax(choice, 1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)
            group_score = best + second
        else:
            group_score = best
        group_score = tl.where(tl.arange(0, G_PAD) < GROUPS, group_score, float("-inf"))
        keep = tl.zeros((G_PAD,), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            win = tl.arange(0, G_PAD) == tl.argmax(group_score, 0)
            keep = tl.where(win, 1, keep)
            group_score = tl.where(win, float("-inf"), group_score)
        if SIGMOID:
            choice = tl.where(keep[:, None] != 0, choice, float("-inf"))
        else:  # HF's DeepSeek-V2: the experts of dropped groups score 0 (and can still win a tie)
            choice = tl.where(real, tl.where(keep[:, None] != 0, choice, 0.0), float("-inf"))
    flat_choice = tl.reshape(choice, (G_PAD * J_PAD,))
    flat_score = tl.reshape(score, (G_PAD * J_PAD,))
    flat_expert = tl.reshape(expert, (G_PAD * J_PAD,))
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), tl.int64)
    weights = tl.zeros((K_PAD,), tl.float32)
    for k in tl.static_range(TOP_K):
        at = tl.argmax(flat_choice, 0)
        hit = tl.arange(0, G_PAD * J_PAD) == at
        ids = tl.where(slot == k, tl.sum(tl.where(hit, flat_expert, 0), 0).to(tl.int64), ids)
        weights = tl.where(slot == k, tl.sum(tl.where(hit, flat_score, 0.0), 0), weights)
        flat_choice = tl.where(hit, float("-inf"), flat_choice)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    shared = slot >= TOP_K  # the folded shared experts: ids GROUPS * PER_GROUP + (slot - TOP_K), weight 1
    weights = tl.where(shared, 1.0, weights * scale)
    ids = tl.where(shared, GROUPS * PER_GROUP + slot - TOP_K, ids)
    tl.store(weights_ptr + row * SLOTS + slot, weights, mask=slot < SLOTS)
    tl.store(ids_ptr + row * SLOTS + slot, ids, mask=slot < SLOTS)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def select_experts_triton(logits: torch.Tensor, cfg: RouterConfig,
                          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``router.select_experts``: (weights [n, slots] fp32, expert ids [n, slots] int64) from logits [n, E]
    (more than 4096 experts: the reference)."""
    n, num_experts = logits.shape
    top_k, slots = cfg.top_k, cfg.slots
    groups = cfg.n_group if cfg.grouped else 1
    if num_experts > 4096:
        return select_experts(logits, cfg, correction_bias)
    logits = logits.float().contiguous()
    weights = torch.empty(n, slots, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, slots, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    per_group = num_experts // groups
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    _select_kernel[(n,)](logits, bias, weights, ids, logits.stride(0), float(cfg.routed_scaling_factor),
                         GROUPS=groups, PER_GROUP=per_group, G_PAD=_pow2(groups), J_PAD=_pow2(per_group),
                         TOPK_GROUP=cfg.topk_group, TOP_K=top_k, SLOTS=slots, K_PAD=_pow2(slots), SIGMOID=cfg.scoring == "sigmoid",
                         HAS_BIAS=correction_bias is not None, GROUPED=cfg.grouped and groups > 1,
                         NORM=cfg.norm_topk_prob, num_warps=1 if num_experts <= 512 else 4)
    return weights, ids
