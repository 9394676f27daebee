"""A token drawn from each logits row at the row's temperature, in two Triton launches (GPU): the fast path of
``sampler.sample_at_temperature`` for requests that set nothing but a temperature.

Plain reference: ``sampler.sample_at_temperature`` — ``softmax(logits.float() / T)`` (one-hot on the argmax
where T = 0), then ``sample_from_probs``: the first index whose float64 cumulative probability passes u times
the total, never past the last token of non-zero probability. torch runs that as ~12 kernels a row set (the
float32 copy, the division, the softmax, the float64 scan, the search, the clamp's flip and argmax, ...); in a
SmolLM2 chain-7 round at temperature 1 they were ~100 of the round's ~690 kernels, eight sets a round
(bench/results/2026-12-05-sampling-profile-smollm2-h100.json).

A row is cut into ``CHUNK``-token chunks, a program each, in both launches. The first writes each chunk's max
of z = x / T, its first argmax and its sum of exp(z - max). The second reads every chunk's three numbers of its
row (a few dozen): the row's max M, each chunk's weight at M and their total S; it writes its chunk's
probabilities exp(z - M) / S (``with_probs``: a draft's q), and the one program of the chunk where u * S falls
(the first whose running weight passes it; none, u within rounding of 1: the last chunk with weight) scans its
chunk with the chunks before as its carry. Greedy rows take the first chunk holding M and its first argmax.
``table`` maps the drawn index (a draft's vocabulary to the target's ids). On an H100, graph-captured, with
probabilities: 3.4 / 4.4 us a row at 16 384 / 49 152 tokens, where one program a row, reading it twice in
4096-wide steps, took 12.8 / 37.0 (bench/results/2026-12-06-sampler-chunks-h100.json).

The scan is float32 where the reference's is float64, and the carry is the chunks' sums where the reference
sums token by token, so the two may pick neighbouring tokens when u falls within float32 rounding (~1e-6
relative) of a boundary between them; nothing else differs (the same division, the same exponentials up to the
sums' order). ``row_stats``, ``scan_chunk`` and ``draw_scaled`` are the one-program-a-row steps that
``chain_accept_triton``'s first launch runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.layers.pdl import pdl_launch, pdl_open

BLOCK = 4096  # the one-program-a-row helpers' chunk (chain_accept_triton's first launch)
CHUNK = 1024  # sample_triton's tokens a program


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
def _chunk_stats_kernel(x_ptr, stride_x, V, temp_ptr, stride_t, stats_ptr, C, CHUNK: tl.constexpr,
                        PDL: tl.constexpr):
    """Launch 1, a program per (row, chunk of CHUNK tokens): the chunk's max of z = x / T, its first argmax and
    the sum of exp(z - max), at stats[row, 0 / 1 / 2, chunk]."""
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row * stride_t)
    t = tl.where(t <= 0.0, 1.0, t)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    z = _scaled(x_ptr + row * stride_x, cols, V, t)
    m, i = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = stats_ptr + row * 3 * C + c
    tl.store(out, m)
    tl.store(out + C, tl.sum(_exp_shifted(z, m), axis=0))
    tl.store(out + 2 * C, (c * CHUNK + i).to(tl.float32))  # < 2**24: exact


@triton.jit
def _chunk_draw_kernel(x_ptr, stride_x, V, temp_ptr, stride_t, u_ptr, stride_u, stats_ptr, C, table_ptr, tok_ptr,
                       q_ptr, stride_q, CHUNK: tl.constexpr, C_PAD: tl.constexpr, HAS_TABLE: tl.constexpr,
                       WRITE_Q: tl.constexpr, PDL: tl.constexpr):
    """Launch 2, a program per (row, chunk): the row's max M and total S from every chunk's stats, the chunk's
    distribution written (``WRITE_Q``), and the program of the chunk where u * S falls scans it for the token
    (greedy rows: the first argmax, one-hot distributions)."""
    pdl_open(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row * stride_t)
    greedy = t <= 0.0
    t = tl.where(greedy, 1.0, t)
    cs = tl.arange(0, C_PAD)
    ok = cs < C
    st = stats_ptr + row * 3 * C + cs
    mc = tl.load(st, mask=ok, other=float("-inf"))
    big_m = tl.max(mc, axis=0)
    w = tl.where(ok, tl.load(st + C, mask=ok, other=0.0), 0.0) * _exp_shifted(mc, big_m)  # chunk weights at M
    total = tl.sum(w, axis=0)
    first = tl.min(tl.where(mc == big_m, cs, C_PAD), axis=0)  # the first chunk holding the max
    at = tl.sum(tl.where(cs == first, tl.load(st + 2 * C, mask=ok, other=0.0), 0.0), axis=0).to(tl.int64)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    q_row = q_ptr + row * stride_q
    if greedy:
        if WRITE_Q:
            tl.store(q_row + cols, tl.where(cols == at, 1.0, 0.0), mask=cols < V)
        tok = at
        mine = c == 0
    else:
        e = _exp_shifted(_scaled(x_ptr + row * stride_x, cols, V, t), big_m)
        if WRITE_Q:
            tl.store(q_row + cols, e / total, mask=cols < V)
        target = tl.load(u_ptr + row * stride_u).to(tl.float32) * total
        run = tl.cumsum(w, axis=0)
        # the chunk where the running sum passes the target; none (u within rounding of 1): the last with weight
        hit = tl.min(tl.where((run > target) & ok, cs, C_PAD), axis=0)
        hit = tl.where(hit == C_PAD, tl.max(tl.where(w > 0.0, cs, 0), axis=0), hit)
        mine = c == hit
        tok = at
        if mine:
            carry = tl.sum(tl.where(cs < c, w, 0.0), axis=0)
            _, found, last = scan_chunk(e, cols, V, target, carry, V, 0)
            tok = tl.minimum(found, last).to(tl.int64)
    if mine:
        if HAS_TABLE:
            tok = tl.load(table_ptr + tok)
        tl.store(tok_ptr + row, tok)


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                  table: torch.Tensor | None = None, with_probs: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sampler.sample_at_temperature`` in two launches of a program per (row, ``CHUNK`` tokens). logits:
    [n, vocab] (any float dtype, unit stride along the vocabulary); temperatures: [n] float32 (<= 0: the
    argmax); uniforms: [n] (both any stride: a column of a chain's numbers is one); table: [vocab] int64 or None
    -> (tokens [n] int64 (through the table), each row's distribution [n, vocab] float32 or None)"""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if table is not None:
        table = table.contiguous()
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    q = torch.empty((n, vocab), dtype=torch.float32, device=logits.device) if with_probs else None
    if n:
        chunks = triton.cdiv(vocab, CHUNK)
        stats = torch.empty((n, 3, chunks), dtype=torch.float32, device=logits.device)
        pdl = pdl_launch()
        _chunk_stats_kernel[(n, chunks)](logits, logits.stride(0), vocab, temperatures, temperatures.stride(0), stats,
                                         chunks, CHUNK=CHUNK, num_warps=4, **pdl)
        _chunk_draw_kernel[(n, chunks)](logits, logits.stride(0), vocab, temperatures, temperatures.stride(0),
                                        uniforms, uniforms.stride(0), stats, chunks,
                                        table if table is not None else tokens, tokens,
                                        q if q is not None else tokens, vocab, CHUNK=CHUNK,
                                        C_PAD=max(16, triton.next_power_of_2(chunks)), HAS_TABLE=table is not None,
                                        WRITE_Q=with_probs, num_warps=4, **pdl)
    return tokens, q
