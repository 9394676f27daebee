"""Paged GQA decode attention in Triton that also stores the new token's K/V (GPU; split-KV).

Plain reference: ``paged_attention_torch.paged_attention_torch`` (itself checked against
``attention.paged_attention_reference``). Steps that are not decode-shaped (more than one new
token per sequence: prefill, chunked prefill, chain verify, mixed batches) go to the paged flash
attention of ``prefill_attention_triton.py``; trees (a metadata ``tail_mask`` or
``batch.attn_masks``) to the torch path. A program per (sequence, KV head, split) handles the head's
query group (padded to 16 rows for ``tl.dot``) with an online softmax over the sequence's
blocks; when there are few sequences, each context is split over several programs (split-KV:
``num_splits``) whose partial softmax states a second small kernel combines. The new token
(cache index context_len-1) is read from ``k``/``v`` directly and
stored at its slot by the same program, so no program reads a slot written in this launch.
Metadata is read on the device only (``ForwardBatch.paged_metadata()``): CUDA-graph safe.
Head dims need not be powers of two: they are padded (masked) to one, e.g. MLA's expanded
K of 192 (nope 128 + rope 64) next to V of 128, one KV head per query head.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..forward_batch import ForwardBatch
from .paged_attention_torch import paged_attention_torch
from .prefill_attention_triton import paged_prefill_attention_triton

BLOCK_N = 64
TARGET_PROGRAMS = 256
# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies bf16 matrices
# wrongly; there the dots run on fp32 copies. Decided once, as Triton decides to interpret.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                   bt_ptr, ctx_ptr, slot_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_kcs, stride_kch, stride_vcs, stride_vch, stride_ot, stride_oh, stride_bt,
                   scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, VDIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, VDIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    ctx = tl.load(ctx_ptr + tl.program_id(0))
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    last = ctx - 1
    first = split * SPLIT_TOKENS
    end = tl.minimum(ctx, first + SPLIT_TOKENS)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)  # head dims padded to a power of two (e.g. MLA's 192 -> 256), masked
    dv = tl.arange(0, VDIM_PAD)
    dmask = d < DIM
    dvmask = dv < VDIM
    gmask = g < GROUP
    heads = h * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    k_new = tl.load(k_ptr + b * stride_kt + h * stride_kh + d, mask=dmask, other=0.0)
    v_new = tl.load(v_ptr + b * stride_vt + h * stride_vh + dv, mask=dvmask, other=0.0)
    if split == 0:  # one writer per (sequence, head); nobody reads this slot in this launch
        slot = tl.load(slot_ptr + b).to(tl.int64)
        tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + d, k_new.to(kc_ptr.dtype.element_ty), mask=dmask)
        tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + dv, v_new.to(vc_ptr.dtype.element_ty), mask=dvmask)

    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, VDIM_PAD), tl.float32)
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < end
        cached = n < last
        is_new = n == last
        block = tl.load(bt_ptr + b * stride_bt + n // PAGE, mask=in_range, other=0).to(tl.int64)
        slots = block * PAGE + n % PAGE
        kt = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + d[None, :],
                     mask=cached[:, None] & dmask[None, :], other=0.0)
        kt = tl.where(is_new[:, None], k_new[None, :].to(kt.dtype), kt)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)))
        else:
            s = tl.dot(q.to(kt.dtype), tl.trans(kt))
        s = s * scale  # [GROUP_PAD, BLOCK_N] fp32
        s = tl.where(in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt = tl.load(vc_ptr + slots[:, None] * stride_vcs + h * stride_vch + dv[None, :],
                     mask=cached[:, None] & dvmask[None, :], other=0.0)
        vt = tl.where(is_new[:, None], v_new[None, :].to(vt.dtype), vt)
        if DOT_FP32:
            pv = tl.dot(p, vt.to(tl.float32))
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if SPLITS == 1:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dvmask[None, :])
    else:  # partial results [B, heads, SPLITS, ...]; an empty split leaves m = -inf, l = 0
        row = (b * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split
        tl.store(part_m_ptr + row, m, mask=gmask)
        tl.store(part_l_ptr + row, l_sum, mask=gmask)
        tl.store(part_acc_ptr + row[:, None] * VDIM_PAD + dv[None, :], acc, mask=gmask[:, None])


@triton.jit
def _combine_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ot, stride_oh,
                    SPLITS: tl.constexpr, VDIM: tl.constexpr, VDIM_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rows = (b * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_m_ptr + rows)
    l_sum = tl.load(part_l_ptr + rows)
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    dv = tl.arange(0, VDIM_PAD)
    acc = tl.load(part_acc_ptr + rows[:, None] * VDIM_PAD + dv[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
    tl.store(out_ptr + b * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < VDIM)


def num_splits(num_seqs: int, kv_heads: int, max_context: int) -> int:
    """Splits of each sequence's context (a power of two): enough programs to fill the GPU's ~132
    multiprocessors twice, never more than one BLOCK_N tile per split. Static for a captured batch."""
    tiles = -(-max_context // BLOCK_N)
    splits = 1
    while splits * 2 <= tiles and num_seqs * kv_heads * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits


def paged_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Decode: store each sequence's new K/V and attend over its context; steps of several new tokens
    per sequence: ``paged_prefill_attention_triton``; trees: the torch path.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, v_head_dim] (decode: T = B)
    """
    meta = batch.paged_metadata()
    cache = batch.kv_cache
    if cache is None or meta.tail_mask is not None or (
            batch.attn_masks is not None and any(m is not None for m in batch.attn_masks)):
        return paged_attention_torch(q, k, v, layer_id, batch, scale)
    if meta.max_query_len != 1:
        return paged_prefill_attention_triton(q, k, v, layer_id, batch, scale)
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    n, heads, dim = q.shape
    kv_heads, vdim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention kernel needs unit-stride head dims")
    dim_pad, vdim_pad = triton.next_power_of_2(dim), triton.next_power_of_2(vdim)
    out = torch.empty((n, heads, vdim), dtype=q.dtype, device=q.device)
    if not n:
        return out
    splits = num_splits(n, kv_heads, meta.block_tables.shape[1] * cache.block_size)
    split_tokens = -(-meta.block_tables.shape[1] * cache.block_size // (splits * BLOCK_N)) * BLOCK_N
    if splits > 1:
        part_acc = torch.empty((n, heads, splits, vdim_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(n, kv_heads, splits)](
        q, k, v, kc, vc, out, part_acc, part_m, part_l, meta.block_tables, meta.context_lens, batch.slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, VDIM=vdim, DIM_PAD=dim_pad,
        VDIM_PAD=vdim_pad, PAGE=cache.block_size, BLOCK_N=BLOCK_N, SPLITS=splits, SPLIT_TOKENS=split_tokens, DOT_FP32=_DOT_FP32,
        num_warps=8)  # 221 registers, no spills (ptxas, sm_90a)
    if splits > 1:
        _combine_kernel[(n, heads)](part_acc, part_m, part_l, out, out.stride(0), out.stride(1), SPLITS=splits,
                                    VDIM=vdim, VDIM_PAD=vdim_pad, num_warps=4)
    return out
