"""Paged causal flash attention in Triton for steps with several new tokens per sequence (GPU).

Prefill, chunked prefill (a cached prefix before the new tokens), chain verify of speculative
decoding and mixed batches (decode rows beside prefill rows). Plain reference:
``paged_attention_torch.paged_attention_torch`` (same signature and result; it gathers the whole
padded context for every token, this kernel reads only what each token may see).

The new K/V are stored first (``kv_write_triton``), then one program per (query tile, KV head)
attends: its rows are ``BLOCK_Q`` consecutive new tokens of one sequence times the KV head's query
group (GQA; ``ROWS = BLOCK_Q * group`` padded to a power of two, at least 16 for ``tl.dot``),
with an online softmax in fp32 over the sequence's cache in ``BLOCK_N`` tiles read through its
block table. The grid is every sequence's tiles laid end to end, ``T // BLOCK_Q + B`` of them (a
few empty), so a long prompt beside many decode rows launches no program per (decode row,
prompt tile); a program finds its sequence by a binary search over ``query_start``. Each program
loops only up to its rows' largest causal limit (``token_index``, read on the device), so the
work follows the real context, not the table's ``max_blocks * block_size``. The layout comes from
``ForwardBatch.paged_metadata()`` device tensors only (``query_start``, ``token_index``,
``block_tables``) and the grid and tiles from static shapes (T, B, kv_heads, ``max_query_len``):
CUDA-graph capturable. Head dims need not be powers of two and K's may differ from V's (MLA's
expanded cache: K 192 = nope 128 + rope 64, V 128, one KV head per query head): they are padded
(to at least 16), masked.

Trees stay on the torch path: a metadata ``tail_mask`` (capturable there) or ``batch.attn_masks``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..forward_batch import ForwardBatch
from .kv_write_triton import write_kv_triton
from .paged_attention_torch import paged_attention_torch

LOG2E = 1.4426950408889634
# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies bf16 matrices
# wrongly; there the dots run on fp32 copies. Decided once, as Triton decides to interpret.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, qstart_ptr, index_ptr,
                    stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                    stride_ot, stride_oh, stride_bt, qk_scale, num_seqs,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                    VDIM: tl.constexpr, DIM_PAD: tl.constexpr, VDIM_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SEARCH_STEPS: tl.constexpr, DOT_FP32: tl.constexpr):
    # Sequence b owns the tiles from tile_start(b) = query_start[b] // BLOCK_Q + b on (at least
    # ceil(query_len / BLOCK_Q) of them): this tile's sequence is the last b with tile_start(b) <= pid,
    # found by a binary search over the B sequences. The last tiles (longest contexts) start first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq_lo = 0
    seq_hi = num_seqs - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (seq_lo + seq_hi + 1) // 2
        ahead = tl.load(qstart_ptr + mid) // BLOCK_Q + mid > pid
        seq_lo = tl.where(ahead, seq_lo, mid)
        seq_hi = tl.where(ahead, mid - 1, seq_hi)
    b = tl.cast(seq_lo, tl.int64)
    q_start = tl.load(qstart_ptr + b)
    q_end = tl.load(qstart_ptr + b + 1)
    first = q_start + (pid - q_start // BLOCK_Q - b) * BLOCK_Q
    r = tl.arange(0, ROWS)
    tok = first + r // GROUP  # row = (token of the tile, head of the group)
    heads = h * GROUP + r % GROUP
    rmask = (r < BLOCK_Q * GROUP) & (tok < q_end)
    tok = tok.to(tl.int64)
    # Each row sees cache indices 0..limit of its sequence; padding rows see index 0 (finite, unused).
    limit = tl.load(index_ptr + tok, mask=rmask, other=0)
    hi = tl.where(first < q_end, tl.max(limit, axis=0) + 1, 0)  # 0: a tile past the new tokens
    d = tl.arange(0, DIM_PAD)
    dv = tl.arange(0, VDIM_PAD)
    dmask = d < DIM
    dvmask = dv < VDIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, VDIM_PAD), tl.float32)
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        block = tl.load(bt_ptr + b * stride_bt + n // PAGE, mask=nmask, other=0).to(tl.int64)
        slots = block * PAGE + n % PAGE
        kt = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + d[None, :],
                     mask=nmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(kt.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(kt))
        s = tl.where(n[None, :] <= limit[:, None], s * qk_scale, float("-inf"))  # [ROWS, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt = tl.load(vc_ptr + slots[:, None] * stride_vcs + h * stride_vch + dv[None, :],
                     mask=nmask[:, None] & dvmask[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, vt.to(tl.float32))
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # l_sum = 0: a tile past the new tokens (not stored)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dvmask[None, :])


def tile_config(group: int, dim_pad: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, num_warps, num_stages). ROWS = query rows (tokens x heads of the group): the
    whole group at least, 16 for ``tl.dot``, fewer than the cap when the step has few new tokens (a
    chain verify). K dims up to 128: up to 64 rows x 64 keys. Past 128 (MLA's 192 -> 256): 128 rows x
    64 keys on 8 warps, 64 x 32 or 16..32 x 64 on 4. Picked by timing a few on an H200 (Llama-3-8B and
    MLA prompts, chunks over long prefixes, verify steps), no spills; not autotuned."""
    wide = dim_pad > 128
    cap = 128 if wide else 64
    rows = max(16, triton.next_power_of_2(group), min(cap, triton.next_power_of_2(max_query_len * group)))
    if not wide:
        return rows, 64, 4, 3
    if rows >= 128:
        return rows, 64, 8, 2
    return (rows, 32, 4, 2) if rows == 64 else (rows, 64, 4, 2)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Store the new K/V at ``batch.slot_mapping``, then each new token attends causally to cache
    indices 0..token_index of its sequence. Trees (tail_mask / attn_masks): ``paged_attention_torch``.

    q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]; v: [T, kv_heads, v_dim] -> [T, heads, v_dim]
    """
    meta = batch.paged_metadata()
    cache = batch.kv_cache
    if cache is None or meta.tail_mask is not None or (
            batch.attn_masks is not None and any(m is not None for m in batch.attn_masks)):
        return paged_attention_torch(q, k, v, layer_id, batch, scale)
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    n, heads, dim = q.shape
    kv_heads, vdim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    if q.stride(-1) != 1 or kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError("prefill attention kernel needs unit-stride head dims")
    out = torch.empty((n, heads, vdim), dtype=q.dtype, device=q.device)
    if not n:
        return out
    write_kv_triton(kc, vc, batch.slot_mapping, k, v)
    dim_pad, vdim_pad = max(16, triton.next_power_of_2(dim)), max(16, triton.next_power_of_2(vdim))
    rows, block_n, warps, stages = tile_config(group, dim_pad, meta.max_query_len)
    block_q = rows // group
    num_seqs = meta.block_tables.shape[0]
    grid = (n // block_q + num_seqs, kv_heads)  # every sequence's tiles, a few empty ones (tile_start)
    _prefill_kernel[grid](
        q, kc, vc, out, meta.block_tables, meta.query_start, meta.token_index,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0),
        out.stride(1), meta.block_tables.stride(0), scale * LOG2E, num_seqs,
        GROUP=group, BLOCK_Q=block_q, ROWS=rows, DIM=dim, VDIM=vdim, DIM_PAD=dim_pad, VDIM_PAD=vdim_pad,
        PAGE=cache.block_size, BLOCK_N=block_n, SEARCH_STEPS=max(1, (num_seqs - 1).bit_length()),
        DOT_FP32=_DOT_FP32, num_warps=warps, num_stages=stages)
    return out
