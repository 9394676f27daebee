"""A token drawn from each logits row at the row's temperature, in one Triton launch (GPU): the fast path of
``sampler.sample_at_temperature`` for requests that set nothing but a temperature.

Plain reference: ``sampler.sample_at_temperature`` — ``softmax(logits.float() / T)`` (one-hot on the argmax
where T = 0), then ``sample_from_probs``: the first index whose float64 cumulative probability passes u times
the total, never past the last token of non-zero probability. torch runs that as ~12 kernels a row set (the
float32 copy, the division, the softmax, the float64 scan, the search, the clamp's flip and argmax, ...); in a
SmolLM2 chain-7 round at temperature 1 they were ~100 of the round's ~690 kernels, eight sets a round
(bench/results/2026-12-05-sampling-profile-smollm2-h100.json).

Here one program per row reads the row twice: an online max and sum of exp(z - max) with z = x / T (and the
argmax, its first index on ties), then the scaled exponentials again, scanned in ``BLOCK``-wide chunks with a
running carry until the sum passes u times the total. The row's probabilities (``with_probs``: a draft's q)
are written in that second pass; ``table`` maps the drawn index (a draft's vocabulary to the target's ids).
The scan is float32 where the reference's is float64, so the two may pick neighbouring tokens when u falls
within float32 rounding (~1e-6 relative) of a boundary between them; nothing else differs (the same division,
the same exponentials up to the sum's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.pdl import pdl_launch, pdl_open

BLOCK = 4096


@triton.jit
def _scaled(x_ptr, cols, V, t):
    """A chunk of the row divided by the temperature (-inf past the row's end)."""
    return tl.load(x_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / t


@triton.jit
def _exp_shifted(z, m):
    """exp(z - m), 0 where z is -inf (also when m is)."""
    return tl.where(z == float("-inf"), 0.0, tl.exp(z - m))


@triton.jit
def row_stats(x_ptr, V, t, BLOCK: tl.constexpr):
    """One row's max of z = x / t, sum of exp(z - max) and first argmax, in one pass. -> (max, sum, argmax)"""
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    at = 0
    for start in range(0, V, BLOCK):
        z = _scaled(x_ptr, start + cols, V, t)
        bm, bi = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
        at = tl.where(bm > m, start + bi, at)
        m_new = tl.maximum(m, bm)
        s = s * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + tl.sum(_exp_shifted(z, m_new), axis=0)
        m = m_new
    return m, s, at


@triton.jit
def scan_chunk(w, c, V, target, carry, found, last):
    """One chunk of an inverse-CDF draw over weights ``w`` at indices ``c``: the running sum ``carry`` before it,
    the first index ``found`` whose running sum passes ``target`` (V while none has), the last index ``last`` of
    non-zero weight. -> the three after it (the draw: min(found, last))"""
    run = tl.cumsum(w, axis=0) + carry
    found = tl.minimum(found, tl.min(tl.where((run > target) & (c < V), c, V), axis=0))
    last = tl.maximum(last, tl.max(tl.where(w > 0.0, c, 0), axis=0))
    return carry + tl.sum(w, axis=0), found, last


@triton.jit
def draw_scaled(x_ptr, V, t, m, target, q_ptr, s, WRITE_Q: tl.constexpr, BLOCK: tl.constexpr):
    """The first index whose running sum of exp(x / t - m) passes ``target`` (clamped to the last index of
    non-zero weight); ``WRITE_Q``: each weight / s stored at q_ptr."""
    cols = tl.arange(0, BLOCK)
    carry = 0.0
    found = V
    last = 0
    for start in range(0, V, BLOCK):
        c = start + cols
        e = _exp_shifted(_scaled(x_ptr, c, V, t), m)
        if WRITE_Q:
            tl.store(q_ptr + c, e / s, mask=c < V)
        carry, found, last = scan_chunk(e, c, V, target, carry, found, last)
    return tl.minimum(found, last)


@triton.jit
def _sample_kernel(x_ptr, stride_x, V, temp_ptr, stride_t, u_ptr, stride_u, table_ptr, tok_ptr, q_ptr, stride_q,
                   BLOCK: tl.constexpr, HAS_TABLE: tl.constexpr, WRITE_Q: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    t = tl.load(temp_ptr + row * stride_t)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    m, s, at = row_stats(x_row, V, t, BLOCK)
    if greedy:
        tok = at.to(tl.int64)
        if WRITE_Q:
            cols = tl.arange(0, BLOCK)
            for start in range(0, V, BLOCK):
                c = start + cols
                tl.store(q_row + c, tl.where(c == at, 1.0, 0.0), mask=c < V)
    else:
        u = tl.load(u_ptr + row * stride_u).to(tl.float32)
        tok = draw_scaled(x_row, V, t, m, u * s, q_row, s, WRITE_Q, BLOCK).to(tl.int64)
    if HAS_TABLE:
        tok = tl.load(table_ptr + tok)
    tl.store(tok_ptr + row, tok)


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                  table: torch.Tensor | None = None, with_probs: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sampler.sample_at_temperature`` in one launch. logits: [n, vocab] (any float dtype, unit stride along
    the vocabulary); temperatures: [n] float32 (<= 0: the argmax); uniforms: [n] (both any stride: a column of
    a chain's numbers is one); table: [vocab] int64 or None
    -> (tokens [n] int64 (through the table), each row's distribution [n, vocab] float32 or None)"""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if table is not None:
        table = table.contiguous()
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    q = torch.empty((n, vocab), dtype=torch.float32, device=logits.device) if with_probs else None
    if n:
        _sample_kernel[(n,)](logits, logits.stride(0), vocab, temperatures, temperatures.stride(0), uniforms,
                             uniforms.stride(0),
                             table if table is not None else tokens, tokens, q if q is not None else tokens,
                             vocab, BLOCK=BLOCK, HAS_TABLE=table is not None, WRITE_Q=with_probs, num_warps=8,
                             **pdl_launch())
    return tokens, q
