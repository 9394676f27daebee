"""The rejection rule for sampled chains of temperature-only requests, from the verify's raw logits, in one
Triton launch (GPU): the fast path of ``rejection_sampler.accept_chains_at_temperature``.

Plain reference: ``accept_chains_at_temperature`` — each chain's k + 1 target rows turned into probabilities
(softmax of logits / T, float32), then ``accept_chains_sampled`` in float64: draft i accepted while
u_i * q_i(x_i) < p_i(x_i); at the first rejection the token drawn from max(0, p - q) at that row (p where that
is all zero), after k acceptances the bonus from p_k; drawn with the next uniform number by the inverse CDF.
torch ran that as ~30 kernels a round over float64 copies of [S, k + 1, vocab].

Here a program per target row takes its max and sum of exp(logits / T - max) (``sample_triton.row_stats``);
the last of a chain's k + 1 programs to finish (``arrival_counters``, as the split attention's last split
combines) tests the chain's k drafts at once (each needs one logit, its row's statistics, q at the draft and
u), finds the first rejection and draws the emitted token in two passes over that row (the residual's total,
then its running sum against u times it; the bonus in one, its total known). The weights are float32 where the
reference's are float64 (the tests float64 of the float32 probabilities, as there): outcomes differ only where
u lands within float32 rounding of a test's threshold or of a boundary between two tokens. It was two launches
(the statistics, then a program a chain) until the fourteenth session: on the GPU machine's host a Triton
launch outside a graph costs ~44-60 us, and a sampled round is host-bound there
(bench/results/2026-12-06-round-host-time-h100.json).

``chain_outcomes_triton`` then spreads the outcome over every chain of the round in one launch (one program a
chain), the fast path of ``rejection_sampler.chain_outcomes`` (about fourteen torch kernels and views: the greedy
rule's compare, scan and sum, the sampled rows' concatenation, scatter and two index copies).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.arrival_counters import arrival_counters
from ...models.layers.pdl import pdl_launch, pdl_open
from ..engine.sample_triton import BLOCK, draw_scaled, row_stats, scan_chunk


@triton.jit
def _rule_kernel(x_ptr, stride_x, first_ptr, temp_ptr, d_ptr, stride_db, q_ptr, stride_qb, stride_qk, u_ptr, m_ptr,
                 s_ptr, cnt_ptr, count_ptr, tok_ptr, rows_ptr, K, V, K_PAD: tl.constexpr, K1_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A program per target row of every chain (chain b's k + 1 rows from first_rows[b]): the row's max and sum of
    exp(logits / T - max) stored; the last of a chain's rows to arrive (its count, acquire-release, GPU scope)
    tests the chain's drafts and draws its token (``_accept_chain``), then sets the count back to 0."""
    pdl_open(PDL)
    i = tl.program_id(0)
    b = i // (K + 1)
    row = (tl.load(first_ptr + b) + i % (K + 1)).to(tl.int64)
    m, s, _ = row_stats(x_ptr + row * stride_x, V, tl.load(temp_ptr + b), BLOCK)
    tl.store(m_ptr + i, m)
    tl.store(s_ptr + i, s)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if arrived == K:
        _accept_chain(b.to(tl.int64), x_ptr, stride_x, first_ptr, temp_ptr, d_ptr, stride_db, q_ptr, stride_qb,
                      stride_qk, u_ptr, m_ptr, s_ptr, count_ptr, tok_ptr, rows_ptr, K, V, K_PAD, K1_PAD, BLOCK)
        tl.atomic_xchg(cnt_ptr + b, 0, sem="relaxed", scope="gpu")


@triton.jit
def _residual(x_row, q_row, c, V, t, m, s):
    """A chunk of max(0, p - q) with p = exp(x / t - m) / s (0 past the row's end)."""
    z = tl.load(x_row + c, mask=c < V, other=float("-inf")).to(tl.float32) / t
    p = tl.where(z == float("-inf"), 0.0, tl.exp(z - m)) / s
    return tl.maximum(p - tl.load(q_row + c, mask=c < V, other=0.0), 0.0)


@triton.jit
def _accept_chain(b, x_ptr, stride_x, first_ptr, temp_ptr, d_ptr, stride_db, q_ptr, stride_qb, stride_qk, u_ptr,
                  m_ptr, s_ptr, count_ptr, tok_ptr, rows_ptr, K, V, K_PAD: tl.constexpr, K1_PAD: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Chain b's rule: its k drafts tested at once (each needs one logit, its row's statistics, q at the draft
    and u), the first rejection, and the emitted token drawn in two passes over that row (the residual's total,
    then its running sum against u times it; the bonus in one, its total known). The rows' statistics were
    stored by other programs: read past L1 (``.cg``). Its row of tokens after the root (``chain_rows``): the
    drafts with the emitted token at the count and last."""
    first = tl.load(first_ptr + b).to(tl.int64)
    t = tl.load(temp_ptr + b)
    i = tl.arange(0, K_PAD)
    ok = i < K
    drafts = tl.load(d_ptr + b * stride_db + i, mask=ok, other=0).to(tl.int64)
    z = tl.load(x_ptr + (first + i) * stride_x + drafts, mask=ok, other=0.0).to(tl.float32) / t
    m = tl.load(m_ptr + b * (K + 1) + i, mask=ok, other=0.0, cache_modifier=".cg")
    s = tl.load(s_ptr + b * (K + 1) + i, mask=ok, other=1.0, cache_modifier=".cg")
    p_hit = tl.where(z == float("-inf"), 0.0, tl.exp(z - m)) / s
    q_hit = tl.load(q_ptr + b * stride_qb + i * stride_qk + drafts, mask=ok, other=0.0)
    u = tl.load(u_ptr + b * (K + 1) + i, mask=ok, other=1.0).to(tl.float64)
    rejected = ok & ~(u * q_hit.to(tl.float64) < p_hit.to(tl.float64))
    count = tl.min(tl.where(rejected, i, K), axis=0)
    x_row = x_ptr + (first + count) * stride_x
    mf = tl.load(m_ptr + b * (K + 1) + count, cache_modifier=".cg")
    sf = tl.load(s_ptr + b * (K + 1) + count, cache_modifier=".cg")
    uf = tl.load(u_ptr + b * (K + 1) + tl.minimum(count + 1, K)).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    total = 0.0
    q_row = q_ptr + b * stride_qb + tl.minimum(count, K - 1) * stride_qk
    if count < K:
        for start in range(0, V, BLOCK):
            total += tl.sum(_residual(x_row, q_row, start + cols, V, t, mf, sf), axis=0)
    if total > 0.0:
        target = uf * total
        carry = 0.0
        found = V
        last = 0
        for start in range(0, V, BLOCK):
            c = start + cols
            carry, found, last = scan_chunk(_residual(x_row, q_row, c, V, t, mf, sf), c, V, target, carry, found, last)
        tok = tl.minimum(found, last)
    else:  # the bonus after k acceptances, or a residual that rounding emptied: p itself
        tok = draw_scaled(x_row, V, t, mf, uf * sf, x_row, sf, False, BLOCK)
    tl.store(count_ptr + b, count.to(tl.int64))
    tl.store(tok_ptr + b, tok.to(tl.int64))
    j = tl.arange(0, K1_PAD)
    row = tl.load(d_ptr + b * stride_db + j, mask=j < K, other=0).to(tl.int64)
    row = tl.where((j < K) & (j != count), row, tok.to(tl.int64))
    tl.store(rows_ptr + b * (K + 1) + j, row, mask=j <= K)


def accept_chains_triton(logits: torch.Tensor, first_rows: torch.Tensor, temperatures: torch.Tensor,
                         drafts: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rejection_sampler.accept_chains_at_temperature`` in one launch. logits: [rows, vocab] raw (unit stride
    along the vocabulary), chain b's k + 1 rows from ``first_rows[b]``; temperatures: [S] float32 (> 0);
    drafts: [S, k]; q: [S, k, vocab] float32 (unit stride along the vocabulary); uniforms: [S, k + 1]
    -> (accepted drafts [S] int64 in 0..k, the emitted token after them [S] int64, each chain's tokens after its
    root [S, k + 1] int64 (``rejection_sampler.chain_rows``))"""
    chains, k = drafts.shape
    vocab = logits.shape[1]
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if drafts.stride(-1) != 1:
        drafts = drafts.contiguous()
    uniforms, first_rows, temperatures = uniforms.contiguous(), first_rows.contiguous(), temperatures.contiguous()
    count = torch.empty(chains, dtype=torch.int64, device=device)
    token = torch.empty(chains, dtype=torch.int64, device=device)
    rows = torch.empty((chains, k + 1), dtype=torch.int64, device=device)
    if not chains:
        return count, token, rows
    m = torch.empty(chains * (k + 1), dtype=torch.float32, device=device)
    s = torch.empty_like(m)
    counters = arrival_counters(device, chains)
    if counters is None:
        raise RuntimeError("accept_chains_triton: its arrival counts are made outside a CUDA-graph capture; "
                           "call it once before capturing it")
    _rule_kernel[(chains * (k + 1),)](logits, logits.stride(0), first_rows, temperatures, drafts, drafts.stride(0), q,
                                      q.stride(0), q.stride(1), uniforms, m, s, counters, count, token, rows, k, vocab,
                                      K_PAD=max(2, triton.next_power_of_2(k)), K1_PAD=triton.next_power_of_2(k + 1),
                                      BLOCK=BLOCK, num_warps=8, **pdl_launch())
    return count, token, rows


@triton.jit
def _outcomes_kernel(d_ptr, stride_d, t_ptr, stride_t, pick_ptr, S, cnt_ptr, tok_ptr, counts_ptr, tokens_ptr, K,
                     K_PAD: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    drafts = tl.load(d_ptr + b * stride_d + j, mask=j < K, other=0)
    targets = tl.load(t_ptr + b * stride_t + j, mask=j <= K, other=0)
    greedy = tl.min(tl.where((j < K) & (drafts != targets), j, K), axis=0)
    i = tl.arange(0, S_PAD)
    hit = tl.load(pick_ptr + i, mask=i < S, other=-1) == b
    sampled = tl.max(hit.to(tl.int32), axis=0) > 0
    at = tl.sum(tl.where(hit, i, 0), axis=0)  # the row's place among the sampled (0 where none: then unused)
    count = tl.where(sampled, tl.load(cnt_ptr + at, mask=S > 0, other=0), greedy).to(tl.int64)
    token = tl.load(tok_ptr + at, mask=S > 0, other=0)
    row = tl.where(sampled, tl.where((j < K) & (j != count), drafts, token), targets)
    tl.store(counts_ptr + b, count)
    tl.store(tokens_ptr + b * (K + 1) + j, row.to(tl.int64), mask=j <= K)


def chain_outcomes_triton(drafts: torch.Tensor, targets: torch.Tensor, pick: torch.Tensor | None,
                          count: torch.Tensor | None, token: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rejection_sampler.chain_outcomes`` in one launch. drafts [B, k] and targets [B, k + 1]: int64, unit
    stride along a row (any row stride: a slice of the verdict is one); pick [S] (or None: every chain greedy),
    count / token [S] int64 -> (counts [B], tokens [B, k + 1])"""
    b, k = drafts.shape
    if drafts.stride(-1) != 1:
        drafts = drafts.contiguous()
    if targets.stride(-1) != 1:
        targets = targets.contiguous()
    counts = torch.empty(b, dtype=torch.int64, device=drafts.device)
    tokens = torch.empty((b, k + 1), dtype=torch.int64, device=drafts.device)
    if not b:
        return counts, tokens
    if pick is None or count is None or token is None:
        pick = count = token = counts  # (S = 0: never read)
        s = 0
    else:
        pick, count, token = pick.contiguous(), count.contiguous(), token.contiguous()
        s = int(pick.shape[0])
    _outcomes_kernel[(b,)](drafts, drafts.stride(0), targets, targets.stride(0), pick, s, count, token, counts,
                           tokens, k, K_PAD=triton.next_power_of_2(k + 1), S_PAD=max(2, triton.next_power_of_2(s)),
                           num_warps=1)
    return counts, tokens
