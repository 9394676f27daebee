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

The logits themselves (``router.router_logits``: the rows made fp32, then cuBLAS's fp32 GEMM, two launches) come
from ``router_logits_triton`` for up to ``LOGITS_ROWS`` rows: one launch, a program per ``BLOCK_E`` experts reading
their fp32 gate rows once for all of x's rows, one row after another (bf16 rows converted in registers), the first tile read before the
PDL wait (``pdl.py``), as sglang's DeepSeek-V3 router GEMM does for small batches.

The experts come out best first (``torch.topk(sorted=False)`` leaves the order open; no consumer
reads it). Ties between exactly equal choices go to the lower expert id. Group sizes and group
counts that are not powers of two are padded with -inf. Logits are fp32, as the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_release, pdl_wait
from .router import RouterConfig, router_logits, select_experts


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


@triton.jit
def _logits_kernel(x_ptr, w_ptr, y_ptr, M, E, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr):
    """y [M, E] = x [M, K] @ w [E, K]^T in fp32, a program per BLOCK_E experts: each [BLOCK_E, BLOCK_K] tile of w
    read once and multiplied with x's rows one after another (the next tile loaded meanwhile)."""
    re = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + re[:, None] * stride_wn + rk[None, :]
    live_e = re[:, None] < E
    if EVEN_K:
        w = tl.load(w_ptrs, mask=live_e, other=0.0)
    else:
        w = tl.load(w_ptrs, mask=live_e & (rk[None, :] < K), other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
    for k in range(0, K, BLOCK_K):
        w_now = w
        if k + BLOCK_K < K:  # the next tile loaded while this one is multiplied
            if EVEN_K:
                w = tl.load(w_ptrs + k + BLOCK_K, mask=live_e, other=0.0)
            else:
                w = tl.load(w_ptrs + k + BLOCK_K, mask=live_e & (rk[None, :] + k + BLOCK_K < K), other=0.0)
        for r in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + r * stride_xm + k + rk, mask=(rk + k < K) & (rk * 0 + r < M), other=0.0).to(tl.float32)
            row = tl.sum(w_now * x[None, :], axis=1)  # [BLOCK_E]
            acc += tl.where(rm[:, None] == r, row[None, :], 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + re[None, :], acc, mask=(rm[:, None] < M) & (re[None, :] < E))


# Rows of x up to which the router's logits take ``_logits_kernel`` (more: ``router.router_logits``; 0: never). On an
# H100 (bench/router_logits_probe.py, DeepSeek-V3's gate, 16 copies back to back in one graph) the kernel at
# LOGITS_TILE took 4.3 / 5.3 / 7.4 / 12.4 / 21.0 us at 1 / 2 / 4 / 8 / 16 rows against cuBLAS's cast + fp32 GEMM's
# 9.6 / 19.0 / 18.9 / 24.2 / 23.8 (2026-12-07-router-logits-h100.json).
LOGITS_ROWS = 16
# (experts a program, K columns a step, warps) of ``_logits_kernel``: DeepSeek-V3's 256 experts over 128 programs.
# Of 23 cuts swept on an H100 at 1-16 rows (the same record) this one was within 4 % of each row count's best;
# (2, 2048, 4) took 5.6 / 7.5 / 10.8 / 18.4 / 33.1 us.
LOGITS_TILE = (2, 4096, 4)


def logits_tile(m: int) -> tuple[int, int, int, int]:
    """(block_m, block_e, block_k, num_warps) of ``_logits_kernel`` for m rows."""
    block_e, block_k, warps = LOGITS_TILE
    return triton.next_power_of_2(max(m, 1)), block_e, block_k, warps


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As ``router.router_logits`` (fp32 logits [n, E] of rows x [n, hidden] and the fp32 gate [E, hidden]) in one
    launch for up to ``LOGITS_ROWS`` rows; the reference otherwise (more rows, another weight dtype, strided
    columns)."""
    n, k = x.shape
    if not 1 <= n <= LOGITS_ROWS or weight.dtype != torch.float32 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return router_logits(x, weight)
    e = weight.shape[0]
    block_m, block_e, block_k, warps = logits_tile(n)
    block_k = min(block_k, triton.next_power_of_2(k))
    y = torch.empty(n, e, dtype=torch.float32, device=x.device)
    _logits_kernel[(triton.cdiv(e, block_e),)](
        x, weight, y, n, e, k, x.stride(0), weight.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps, **pdl_launch())
    return y
