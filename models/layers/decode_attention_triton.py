"""Paged GQA decode attention in Triton that also stores the new token's K/V (GPU; split-KV).

Plain reference: ``paged_attention_torch.paged_attention_torch`` (itself checked against
``attention.paged_attention_reference``). A step of a few new tokens per sequence (a chain verify, a
draft's first pass: ``ROWS_AS_DECODE``) runs here too: a program takes all of its sequence's new tokens (rows)
times its query heads, each row masked at its causal limit, the sequence's new keys read from ``k`` / ``v``; so
does a tree's step of a few new nodes (its verify, a draft step over several leaves: ``TREE_ROWS``), each row
masked by its line of the metadata's ``tail_mask`` over the context's last indices instead. Other steps of several
new tokens per sequence (prefill, chunked prefill, mixed batches) go to the paged flash attention of
``prefill_attention_triton.py``, and so does a tree's step of one new node per sequence; trees given as
``batch.attn_masks`` (eager) to the torch path. A program per (sequence, KV head, block of its query
heads, split) handles up to ``heads_per_program`` heads of the KV head's query group (padded to 16
rows for ``tl.dot``; a large group, e.g. MLA's 128 heads over one latent KV head, is cut into
blocks of 16 whose programs read the same K/V tiles) with an online softmax over the sequence's
blocks; when there are few sequences, each context is split over several programs (split-KV:
``num_splits``) whose partial softmax states the last of them to finish combines. Each tile's block-table
lookup runs a tile ahead of its K/V loads (which Triton pipelines); launches of few programs also load each
tile's K/V into registers a tile before its math (``DecodeLaunch.prefetch``, ``decode_launch``). The new token
(cache index context_len-1) is read from ``k``/``v`` directly and stored at its slot by one
program (head block 0, split 0), so no program reads a slot written in this launch.
Metadata is read on the device only (``ForwardBatch.paged_metadata()``): CUDA-graph safe.

Head dims need not be powers of two: each is padded (masked: no lane past a dim is loaded) to one.
MLA's latent cache (``KVCache.v_in_k``: K = [latent 512 | rope 64], V = K's first 512 columns) is
read as two K parts, [BLOCK_N, 512] and [BLOCK_N, 64] (scores = q_a k_a^T + q_b k_b^T, no padding of
576 to 1024), and the first part is the V tile too: each cached token's 1152 bytes are read once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..forward_batch import ForwardBatch, PagedAttentionMetadata
from .arrival_counters import arrival_counters
from .attention_splits_triton import combine_splits, num_splits, split_partials, store_partial
from .paged_attention_torch import paged_attention_torch
from .pdl import pdl_launch, pdl_open
from .prefill_attention_triton import _load_rows, _store_rows, paged_prefill_attention_triton, tail_seen

# A split batch's last split program combines the splits itself (``arrival_counters``) instead of
# ``_combine_kernel`` after the launch: 8B shape on an H200, batch 16 4.44 vs 4.61 ms a step, batch 2 4.26 vs
# 4.33, batch 64 within noise, batch 1 4.07 vs 4.00 (2026-12-03-decode-rows-fused-combine-ab-h200.json).
# False: the separate combine (bench/decode_engine.py --separate-combine, the A/B).
FUSED_COMBINE = True
# A step of a few new tokens per sequence (a chain verify, a draft's first pass: at most ROWS_AS_DECODE per
# sequence and ROWS_AS_DECODE_TOTAL in all, causal, K/V not in K, rows x query group within ACC_ELEMENTS) runs
# here (``ROWS``): a program per (sequence, KV head, split) takes the sequence's rows x its query heads, each key
# read once for all rows, and the splits combine in-kernel, instead of the prefill kernel's query tiles with a
# combine launch after. On the Llama-3-8B shape (8 new tokens a sequence, H100) it took 19.2 / 26.8 / 46.5 us a
# layer at batch 1 and 512 / 2 048 / 8 192 tokens against the prefill kernel's 19.5 / 27.6 / 49.4, at batch 8
# 21.6 / 53.6 / 157.0 against 39.6 / 77.8 / 213.9 (bench/decode_rows_probe.py --verify-new 8,
# 2026-12-06-verify-attention-grouped-rows-8b-smollm2-h100.json). The first version here, a program per row
# (cf4d3fd), read a context once per row: faster on SmolLM2's short verifies (its chain-7 verify graph 671 us
# against 737-740 through the prefill kernel and 780 this way, before the rows' K/V were stored in one
# load/store), but 2.5-4.3x the prefill kernel's time at 8 192 tokens on the 8B shape. 0: off (the prefill
# kernel; the A/B through --set).
ROWS_AS_DECODE = 16
ROWS_AS_DECODE_TOTAL = 64
# A tree's step of a few new nodes per sequence (its verify; a draft step over several leaves) as decode rows too,
# the tail mask read in place of the causal limit, the same kernel as a chain verify's instead of the prefill
# kernel's query tiles (which a chain verify left for 671 against 737-740 us of SmolLM2's verify graph, above).
# Checked against the torch path in Triton's interpreter (tests/test_triton_interpret.py), compiled for sm_90 with
# no spills (251 registers at SmolLM2's 16-row tree verify: 2026-12-07-hopper-ptx-tree-rows-cpu.json); untimed. False:
# the prefill kernel (the A/B: --set models.layers.decode_attention_triton.TREE_ROWS=False).
TREE_ROWS = True
# Accumulator elements of one program ([heads, V dim] fp32): bounds the heads a program takes.
ACC_ELEMENTS = 8192
# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies bf16 matrices
# wrongly; there the dots run on fp32 copies. Decided once, as Triton decides to interpret.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_slots(bt_row_ptr, n, end, PAGE: tl.constexpr):
    """Cache slots of a tile's context indices ``n`` (their block-table lookup; indices from ``end`` on: slot
    0..PAGE-1, never read)."""
    return tl.load(bt_row_ptr + n // PAGE, mask=n < end, other=0).to(tl.int64) * PAGE + n % PAGE


@triton.jit
def _tile_kv(kc_ptr, vc_ptr, slots, ok, h, stride_kcs, stride_kch, stride_vcs, stride_vch, DA: tl.constexpr,
             DA_PAD: tl.constexpr, DB: tl.constexpr, DB_PAD: tl.constexpr, VDIM: tl.constexpr,
             VDIM_PAD: tl.constexpr, V_IN_K: tl.constexpr):
    """A tile's cached K (parts A and B) and V at ``slots``, rows where ``ok`` (else 0); part B is part A
    without one (DB = 0), V is part A where V is in K."""
    da = tl.arange(0, DA_PAD)
    kt = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + da[None, :],
                 mask=ok[:, None] & (da < DA)[None, :], other=0.0)
    if DB > 0:
        db = DA + tl.arange(0, DB_PAD)
        kb = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + db[None, :],
                     mask=ok[:, None] & (db < DA + DB)[None, :], other=0.0)
    else:
        kb = kt
    if V_IN_K:
        vt = kt  # V = K's first VDIM (= DA) columns: the tile already loaded
    else:
        dv = tl.arange(0, VDIM_PAD)
        vt = tl.load(vc_ptr + slots[:, None] * stride_vcs + h * stride_vch + dv[None, :],
                     mask=ok[:, None] & (dv < VDIM)[None, :], other=0.0)
    return kt, kb, vt


@triton.jit
def _attend_tile(q_a, q_b, kt, kb, vt, is_new, visible, k_a_new, k_b_new, v_new, m, l_sum, acc, scale,
                 DB: tl.constexpr, V_IN_K: tl.constexpr, DOT_FP32: tl.constexpr, ROWS: tl.constexpr):
    """One key tile into the online softmax: the new token's row (``is_new``) from k / v, keys not ``visible``
    ([1, BLOCK_N]: outside the split; ROWS, [H_PAD, BLOCK_N]: also past each query row's causal limit, so a
    row may see none of a tile while its running max is still -inf) masked. -> (m, l_sum, acc)"""
    kt = tl.where(is_new[:, None], k_a_new[None, :].to(kt.dtype), kt)
    if DOT_FP32:
        s = tl.dot(q_a.to(tl.float32), tl.trans(kt.to(tl.float32)))
    else:
        s = tl.dot(q_a.to(kt.dtype), tl.trans(kt))
    if DB > 0:
        kb = tl.where(is_new[:, None], k_b_new[None, :].to(kb.dtype), kb)
        if DOT_FP32:
            s += tl.dot(q_b.to(tl.float32), tl.trans(kb.to(tl.float32)))
        else:
            s += tl.dot(q_b.to(kb.dtype), tl.trans(kb))
    s = s * scale  # [H_PAD, BLOCK_N] fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if ROWS:  # a row that has seen no key yet keeps m = -inf and sums of 0 (exp(-inf - -inf) would be NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    if V_IN_K:
        vt = kt
    else:
        vt = tl.where(is_new[:, None], v_new[None, :].to(vt.dtype), vt)
    if DOT_FP32:
        pv = tl.dot(p, vt.to(tl.float32))
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return m_new, l_sum, acc * alpha[:, None] + pv


@triton.jit
def _fresh_rows(kt, kb, vt, k_ptr, v_ptr, rows_new, fresh, h, stride_kt, stride_kh, stride_vt, stride_vh,
                DA: tl.constexpr, DA_PAD: tl.constexpr, DB: tl.constexpr, DB_PAD: tl.constexpr,
                VDIM: tl.constexpr, VDIM_PAD: tl.constexpr, V_IN_K: tl.constexpr):
    """A tile's keys and values at the step's new indices (``fresh``) from k / v rows ``rows_new`` in place of
    the cache's (written in this launch by other programs)."""
    kt = tl.where(fresh[:, None], _load_rows(k_ptr + h * stride_kh, rows_new, stride_kt, 0, fresh, DA, DA_PAD,
                                             kt.dtype), kt)
    if DB > 0:
        kb = tl.where(fresh[:, None], _load_rows(k_ptr + h * stride_kh, rows_new, stride_kt, DA, fresh, DB, DB_PAD,
                                                 kb.dtype), kb)
    if V_IN_K:
        vt = kt
    else:
        vt = tl.where(fresh[:, None], _load_rows(v_ptr + h * stride_vh, rows_new, stride_vt, 0, fresh, VDIM,
                                                 VDIM_PAD, vt.dtype), vt)
    return kt, kb, vt


@triton.jit
def _visible(n, end, limit, orow, gmask, tail_ptr, tail0, ROWS: tl.constexpr, TAIL: tl.constexpr):
    """Keys ``n`` [BLOCK_N] a tile's query rows see: those before the split's ``end``; ROWS, also at most each
    row's causal ``limit`` [H_PAD] -> [H_PAD, BLOCK_N] (else [1, BLOCK_N]). ROWS with a tree (TAIL > 0): instead
    of the causal rule, every index before the context's last TAIL (from ``tail0`` on) and of those the ones the
    row's line of the tail mask (``tail_ptr`` [T, TAIL], the step's row ``orow``) names (``tail_seen``, the prefill
    kernel's rule); a lane past the rows (``gmask`` false, never stored) sees the tail's first index."""
    if ROWS:
        if TAIL > 0:
            visible = (n[None, :] < end) & tail_seen(tail_ptr, orow, gmask, n, tail0, TAIL)
        else:
            visible = (n[None, :] < end) & (n[None, :] <= limit[:, None])
    else:
        visible = (n < end)[None, :]
    return visible


@triton.jit
def _store_new_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, q_start, q_end, h, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch, R_PAD: tl.constexpr, DA: tl.constexpr,
                    DA_PAD: tl.constexpr, DB: tl.constexpr, DB_PAD: tl.constexpr, VDIM: tl.constexpr,
                    VDIM_PAD: tl.constexpr, V_IN_K: tl.constexpr):
    """KV head h of new tokens q_start..q_end-1: their K (parts A and B) and V from k / v into the cache at their
    slots, all rows in one load and one store (a loop of a row at a time waited on each row's loads in turn)."""
    t = q_start + tl.arange(0, R_PAD)
    ok = t < q_end
    slot = tl.load(slot_ptr + t, mask=ok, other=0).to(tl.int64)
    kcs = kc_ptr + h * stride_kch
    ka = _load_rows(k_ptr + h * stride_kh, t, stride_kt, 0, ok, DA, DA_PAD, kc_ptr.dtype.element_ty)
    _store_rows(kcs, slot, stride_kcs, 0, ka, ok, DA, DA_PAD)
    if DB > 0:
        kb = _load_rows(k_ptr + h * stride_kh, t, stride_kt, DA, ok, DB, DB_PAD, kc_ptr.dtype.element_ty)
        _store_rows(kcs, slot, stride_kcs, DA, kb, ok, DB, DB_PAD)
    if not V_IN_K:
        vn = _load_rows(v_ptr + h * stride_vh, t, stride_vt, 0, ok, VDIM, VDIM_PAD, vc_ptr.dtype.element_ty)
        _store_rows(vc_ptr + h * stride_vch, slot, stride_vcs, 0, vn, ok, VDIM, VDIM_PAD)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                   bt_ptr, ctx_ptr, slot_ptr, cnt_ptr, index_ptr, qstart_ptr, tail_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_kcs, stride_kch, stride_vcs, stride_vch, stride_ot, stride_oh, stride_bt,
                   scale, HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   HEAD_BLOCKS: tl.constexpr, H_PAD: tl.constexpr, DA: tl.constexpr, DA_PAD: tl.constexpr,
                   DB: tl.constexpr, DB_PAD: tl.constexpr, VDIM: tl.constexpr, VDIM_PAD: tl.constexpr,
                   V_IN_K: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   COMBINE: tl.constexpr, DOT_FP32: tl.constexpr, PREFETCH: tl.constexpr, ROWS: tl.constexpr,
                   SPLIT_TILES: tl.constexpr, R_PAD: tl.constexpr, COMBINE_LOADS: tl.constexpr,
                   PDL: tl.constexpr, TAIL: tl.constexpr = 0):
    pdl_open(PDL)
    # K's columns are part A (0..DA) and part B (DA..DA+DB, none when DB = 0); V_IN_K: V is part A.
    # b: the sequence. ROWS: a program takes all of its sequence's new tokens (rows, a chain verify's few) times
    # its query heads as the query block, each row seeing its context up to its causal limit (its token index);
    # the sequence's new indices (from its first row's limit on) are read from k / v (rows_new: the last row
    # holds ctx - 1), the older ones from the cache, each read once for all the rows. Else its one new token.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) // HEAD_BLOCKS  # KV head
    hb = tl.program_id(1) % HEAD_BLOCKS  # block of its query heads
    split = tl.program_id(2)
    g = tl.arange(0, H_PAD)
    if ROWS:
        q_start = tl.load(qstart_ptr + b)
        q_end = tl.load(qstart_ptr + b + 1)
        ctx = tl.maximum(tl.load(ctx_ptr + b), 1)
        new0 = tl.load(index_ptr + q_start, mask=q_end > q_start, other=0)
        row_shift = q_end - ctx  # the row of new index n: row_shift + n
        last = ctx - 1
        r = g // BLOCK_H  # query row g: the sequence's r-th new token, head in_group of the block
        in_group = hb * BLOCK_H + g % BLOCK_H
        gmask = (r < q_end - q_start) & (in_group < GROUP)
        orow = (q_start + r).to(tl.int64)
        limit = tl.load(index_ptr + orow, mask=gmask, other=-1)  # the row's causal limit (its own index)
        tail0 = ctx - TAIL  # a tree's first tail index (TAIL > 0: the tail mask replaces the causal limit there)
        # splits of at least SPLIT_TILES tiles: a short context in few of them (the last combines fewer)
        split_tokens = tl.maximum(tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS), SPLIT_TILES) * BLOCK_N
    else:
        ctx = tl.load(ctx_ptr + b)
        last = ctx - 1
        new0 = last
        in_group = hb * BLOCK_H + g
        gmask = (g < BLOCK_H) & (in_group < GROUP)
        orow = b + g * 0
        limit = g  # (ROWS only)
        tail0 = ctx  # (ROWS only)
        # The splits share this sequence's real context (whole tiles each): a captured batch's SPLITS follow its
        # longest possible context, the work the context it has.
        split_tokens = tl.cdiv(tl.cdiv(ctx, BLOCK_N), SPLITS) * BLOCK_N
    active = tl.cdiv(ctx, split_tokens)  # the splits that take keys (split 0 always: ctx >= 1)
    first = split * split_tokens
    end = tl.minimum(ctx, first + split_tokens)
    heads = h * GROUP + in_group
    da = tl.arange(0, DA_PAD)
    damask = da < DA
    q_a = tl.load(q_ptr + orow[:, None] * stride_qt + heads[:, None] * stride_qh + da[None, :],
                  mask=gmask[:, None] & damask[None, :], other=0.0)
    # the one new token's K/V (ROWS: stand-ins never attended, own = -1; _fresh_rows reads the rows' own)
    k_a_new = tl.load(k_ptr + b * stride_kt + h * stride_kh + da, mask=damask, other=0.0)
    if DB > 0:
        db = DA + tl.arange(0, DB_PAD)
        dbmask = db < DA + DB
        q_b = tl.load(q_ptr + orow[:, None] * stride_qt + heads[:, None] * stride_qh + db[None, :],
                      mask=gmask[:, None] & dbmask[None, :], other=0.0)
        k_b_new = tl.load(k_ptr + b * stride_kt + h * stride_kh + db, mask=dbmask, other=0.0)
    else:  # no part B: stand-ins the tile helpers take and never read
        q_b = q_a
        k_b_new = k_a_new
    if not V_IN_K:
        dv = tl.arange(0, VDIM_PAD)
        dvmask = dv < VDIM
        v_new = tl.load(v_ptr + b * stride_vt + h * stride_vh + dv, mask=dvmask, other=0.0)
    else:
        v_new = k_a_new
    if ROWS:
        if (split == 0) & (hb == 0):  # one writer per (sequence, KV head) of its rows' K/V; no program reads them
            _store_new_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, q_start, q_end, h, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch, R_PAD, DA, DA_PAD,
                            DB, DB_PAD, VDIM, VDIM_PAD, V_IN_K)
    elif (split == 0) & (hb == 0):  # one writer per (sequence, KV head); nobody reads this slot in this launch
        slot = tl.load(slot_ptr + b).to(tl.int64)
        tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + da, k_a_new.to(kc_ptr.dtype.element_ty), mask=damask)
        if DB > 0:
            tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + db, k_b_new.to(kc_ptr.dtype.element_ty),
                     mask=dbmask)
        if not V_IN_K:
            tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + dv, v_new.to(vc_ptr.dtype.element_ty),
                     mask=dvmask)

    m = tl.full((H_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((H_PAD,), tl.float32)
    acc = tl.zeros((H_PAD, VDIM_PAD), tl.float32)
    ar = tl.arange(0, BLOCK_N)
    stop = tl.minimum(end, new0)  # cached keys of this split end here; the new tokens come from k / v
    if ROWS:
        own = -1  # no key is taken from this row's k / v alone: _fresh_rows reads every new one
    else:
        own = last
    bt_row_ptr = bt_ptr + b * stride_bt
    slots_nxt = _tile_slots(bt_row_ptr, first + ar, end, PAGE)
    if PREFETCH:
        # The loads run ahead of the math by hand, in registers: a tile's K/V are loaded one tile before they
        # are used and its cache slots (the block-table lookup) two tiles before, so no load waits on a load.
        kt_cur, kb_cur, vt_cur = _tile_kv(kc_ptr, vc_ptr, slots_nxt, first + ar < stop, h, stride_kcs, stride_kch,
                                          stride_vcs, stride_vch, DA, DA_PAD, DB, DB_PAD, VDIM, VDIM_PAD, V_IN_K)
        slots_nxt = _tile_slots(bt_row_ptr, first + BLOCK_N + ar, end, PAGE)
        for start in range(first, end, BLOCK_N):
            n = start + ar
            kt_nxt, kb_nxt, vt_nxt = _tile_kv(kc_ptr, vc_ptr, slots_nxt, n + BLOCK_N < stop, h, stride_kcs,
                                              stride_kch, stride_vcs, stride_vch, DA, DA_PAD, DB, DB_PAD, VDIM,
                                              VDIM_PAD, V_IN_K)
            slots_nxt = _tile_slots(bt_row_ptr, n + 2 * BLOCK_N, end, PAGE)
            if ROWS:
                kt_cur, kb_cur, vt_cur = _fresh_rows(kt_cur, kb_cur, vt_cur, k_ptr, v_ptr, row_shift + n,
                                                     (n >= new0) & (n < end), h, stride_kt, stride_kh, stride_vt,
                                                     stride_vh, DA, DA_PAD, DB, DB_PAD, VDIM, VDIM_PAD, V_IN_K)
            m, l_sum, acc = _attend_tile(q_a, q_b, kt_cur, kb_cur, vt_cur, n == own,
                                         _visible(n, end, limit, orow, gmask, tail_ptr, tail0, ROWS, TAIL), k_a_new,
                                         k_b_new, v_new, m, l_sum, acc, scale, DB, V_IN_K, DOT_FP32, ROWS)
            kt_cur, kb_cur, vt_cur = kt_nxt, kb_nxt, vt_nxt
    else:  # the block-table lookup one tile ahead, so Triton's pipelined K/V copies wait on no load
        for start in range(first, end, BLOCK_N):
            n = start + ar
            slots = slots_nxt
            slots_nxt = _tile_slots(bt_row_ptr, n + BLOCK_N, end, PAGE)
            kt, kb, vt = _tile_kv(kc_ptr, vc_ptr, slots, n < stop, h, stride_kcs, stride_kch, stride_vcs,
                                  stride_vch, DA, DA_PAD, DB, DB_PAD, VDIM, VDIM_PAD, V_IN_K)
            if ROWS:
                kt, kb, vt = _fresh_rows(kt, kb, vt, k_ptr, v_ptr, row_shift + n, (n >= new0) & (n < end), h,
                                         stride_kt, stride_kh, stride_vt, stride_vh, DA, DA_PAD, DB, DB_PAD, VDIM,
                                         VDIM_PAD, V_IN_K)
            m, l_sum, acc = _attend_tile(q_a, q_b, kt, kb, vt, n == own,
                                         _visible(n, end, limit, orow, gmask, tail_ptr, tail0, ROWS, TAIL),
                                         k_a_new, k_b_new, v_new, m, l_sum, acc, scale, DB, V_IN_K, DOT_FP32, ROWS)
    do = tl.arange(0, VDIM_PAD)
    if SPLITS == 1:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + orow[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (do < VDIM)[None, :])
    elif not COMBINE:  # partial results [B, HEADS, SPLITS, ...]; an empty split leaves m = -inf, l = 0
        store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, (orow * HEADS + heads) * SPLITS + split, m, l_sum, acc,
                      gmask, VDIM_PAD)
    elif active == 1:  # one split covers the context: it writes the rows out (the others took no key)
        if split == 0:
            out = acc / l_sum[:, None]
            tl.store(out_ptr + orow[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (do < VDIM)[None, :])
    elif split < active:  # the last of this (sequence, KV head, head block)'s active splits combines them
        store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, (orow * HEADS + heads) * SPLITS + split, m, l_sum, acc,
                      gmask, VDIM_PAD)
        tl.debug_barrier()
        tile = b * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == active - 1:
            first_row = (orow * HEADS + heads) * SPLITS
            s_idx = tl.arange(0, SPLITS)
            rows2 = first_row[:, None] + s_idx[None, :]
            live = gmask[:, None] & (s_idx < active)[None, :]
            pm = tl.load(part_m_ptr + rows2, mask=live, other=float("-inf"), cache_modifier=".cg")
            pl = tl.load(part_l_ptr + rows2, mask=live, other=0.0, cache_modifier=".cg")
            top = tl.max(pm, axis=1)
            w = tl.where(pm > float("-inf"), tl.exp(pm - top[:, None]), 0.0)  # [H_PAD, SPLITS]
            total = tl.zeros((H_PAD, VDIM_PAD), tl.float32)
            if ROWS:  # the active splits alone (a rows launch has many; a short context uses few), COMBINE_LOADS
                # partials at a time so their loads are in flight together
                for sp0 in range(0, active, COMBINE_LOADS):
                    for i in tl.static_range(COMBINE_LOADS):
                        live_sp = gmask & (g * 0 + sp0 + i < active)
                        pm_sp = tl.load(part_m_ptr + first_row + sp0 + i, mask=live_sp, other=float("-inf"),
                                        cache_modifier=".cg")
                        w_sp = tl.where(pm_sp > float("-inf"), tl.exp(pm_sp - top), 0.0)
                        part = tl.load(part_acc_ptr + (first_row + sp0 + i)[:, None] * VDIM_PAD + do[None, :],
                                       mask=live_sp[:, None], other=0.0, cache_modifier=".cg")
                        total += part * w_sp[:, None]
            else:
                for sp in tl.static_range(SPLITS):
                    w_sp = tl.sum(tl.where(s_idx[None, :] == sp, w, 0.0), axis=1)
                    part = tl.load(part_acc_ptr + (first_row + sp)[:, None] * VDIM_PAD + do[None, :],
                                   mask=gmask[:, None] & (do[None, :] * 0 + sp < active), other=0.0,
                                   cache_modifier=".cg")
                    total += part * w_sp[:, None]
            out = total / tl.sum(pl * w, axis=1)[:, None]
            tl.store(out_ptr + orow[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (do < VDIM)[None, :])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class DecodeLaunch:
    """How one decode launch is cut: keys per tile, warps and pipeline stages of a program, the splits of
    each sequence's context (static for a captured batch; the tiles of the real context are shared out among
    them at run time), and how its loop reads ahead: ``prefetch`` — each tile's K/V loaded into registers
    one tile before its math (as many registers again: for launches of few programs) — or Triton's
    pipelined shared-memory copies, with each tile's block-table lookup one tile ahead either way.
    ``combine_in_kernel``: split partials combined by each tile's last split program (``FUSED_COMBINE``), else
    by ``_combine_kernel`` after the launch."""

    block_n: int
    warps: int
    stages: int
    splits: int
    prefetch: bool = False
    combine_in_kernel: bool = True


# Programs (sequences x KV heads x head blocks, before splits) up to which a decode launch reads ahead in
# registers, and the programs with splits it then aims at (more programs: ``num_splits``'s default, 512).
FEW_PROGRAMS = 32
PREFETCH_PROGRAMS = 256
# The same for a launch of decode rows (``ROWS_AS_DECODE``, a program per sequence's rows): at 64 the 8B shape's
# batch-1 verify at 8 192 tokens took 74.6 us a layer against 46.5 at 256 (its 8 programs in 8 splits, then 32;
# 2026-12-06-verify-attention-grouped-rows-8b-smollm2-h100.json).
ROWS_PREFETCH_PROGRAMS = 256
# A rows launch's splits take at least this many key tiles of a sequence's real context (a captured launch's
# SPLITS follow its longest possible context); its last split combines the active splits alone. SmolLM2's chain-7
# verify graph took 780 us at 1, 796 at 2 and 869 at 4 (one generate each, same record).
ROWS_SPLIT_TILES = 1
# Partials a rows launch's combining program loads per step of its loop over the active splits (not timed alone).
COMBINE_LOADS = 4


def decode_launch(programs: int, max_context: int, wide: bool = False, rows: bool = False) -> DecodeLaunch:
    """The launch of a decode batch of ``programs`` programs without splits (sequences x KV heads x head
    blocks) whose contexts reach ``max_context`` tokens (a captured batch: its maximum): 32 keys per tile on
    4 warps; up to ``FEW_PROGRAMS`` (batch <= 4 at GQA 32/8) read ahead in registers with splits up to
    ``PREFETCH_PROGRAMS`` programs, more pipelined in 3 stages with splits up to 512 programs (at most
    ``MAX_SPLITS``). From a sweep of 54 cuts over 32 layers' caches (cold, as a step reads them) at batch 1 /
    16 / 64 and contexts 163 / 1024 / 4096 on an H200 (GQA 32/8, head dim 128; bench/decode_rows_probe.py,
    bench/results/2026-12-04-decode-attention-cold-sweep-h200.json), in us against the cut before (2 stages,
    no lookup ahead, no read-ahead): batch 1 at 1024 / 4096 tokens 7.9 / 12.2 against 9.8 / 17.1; batch 16 at
    163 / 1024 / 4096 10.8 / 26.2 / 80.6 against 10.6 / 28.1 / 91.3; batch 64 19.6 / 78.1 / 294.3 against
    20.5 / 89.3 / 340.3. 16-key tiles on 2 warps with splits up to 1024 programs read faster from 1024 tokens on
    in that sweep (batch 64: 74.3 / 275.6) but made the engine's 64-row step at 163 tokens 2-4 % slower
    (2026-12-04-decode-attention-ab-h200.json); a captured batch has one cut for every context. The grid's
    (KV head, head block) axis first, so that a sequence's heads read each cached token's rows together, changed
    nothing (H100: batch 64 at 163 tokens 22.35 against 22.21 us alone, the 64-row step 6.511 against 6.512 ms;
    2026-12-07-decode-narrow-tile-heads-first-ab-8b-h100.json).

    ``wide``: head dims above 128 (MLA's latent cache, [32 keys, 512 + 64] tiles): 2 stages, never read ahead
    (it would double registers the wide tiles already fill; not swept), and the splits combined by
    ``_combine_kernel``: a head block's last split program combining [splits, 16 heads, 512] partials alone
    was slower — the DeepSeek-V3 slice's batch-1 attention 76 against 64-67 us a step (4 layers), its decode
    1-1.5 % slower at batch 1-4 in the same lease (2026-12-04-mla-combine-ab-h200.json)."""
    if wide:
        return DecodeLaunch(32, 4, 2, num_splits(programs, max_context, 32), combine_in_kernel=False)
    if programs <= FEW_PROGRAMS:
        target = ROWS_PREFETCH_PROGRAMS if rows else PREFETCH_PROGRAMS
        return DecodeLaunch(32, 4, 2, num_splits(programs, max_context, 32, target), prefetch=True)
    return DecodeLaunch(32, 4, 3, num_splits(programs, max_context, 32))


def heads_per_program(group: int, vdim_pad: int) -> int:
    """Query heads of one KV head's group that one program takes: the whole group while its
    accumulator stays within ``ACC_ELEMENTS`` (GQA groups of Llama-style models: one program), else
    blocks of at least 16 (MLA's latent cache: 16 heads x 512)."""
    return min(group, max(16, ACC_ELEMENTS // vdim_pad))


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))  # tl.dot takes K and N of 16 at least


def paged_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Decode: store each sequence's new K/V and attend over its context; a few new tokens per sequence
    (``rows_as_decode``: a chain verify; a tree's, masked by the metadata's ``tail_mask``) as decode rows, a program
    per sequence's rows; more, and a tree's one new node per sequence: ``paged_prefill_attention_triton``; eager trees
    (``batch.attn_masks``): the torch path. A layer whose V is in K
    (``KVCache.v_in_k``) stores K alone and takes V from the K tiles (``v`` must then be K's first
    columns, as MLA passes it).

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, v_head_dim] (decode: T = B)
    """
    meta = batch.paged_metadata()
    cache = batch.kv_cache
    if cache is None or (batch.attn_masks is not None and any(m is not None for m in batch.attn_masks)):
        return paged_attention_torch(q, k, v, layer_id, batch, scale)
    n, heads, dim = q.shape
    kv_heads, vdim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    rows = meta.max_query_len != 1
    if (meta.tail_mask is not None and not rows) or (
            rows and not rows_as_decode(meta, n, layer_id in cache.v_in_k, group, vdim)):
        return paged_prefill_attention_triton(q, k, v, layer_id, batch, scale)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention kernel needs unit-stride head dims")
    block_h = heads_per_program(group, _pad(vdim))
    context = meta.block_tables.shape[1] * cache.block_size
    seqs = meta.context_lens.shape[0] if rows else n
    launch = decode_launch(seqs * kv_heads * -(-group // block_h), context, wide=max(_pad(dim), _pad(vdim)) > 128,
                           rows=rows)
    return decode_attention_launch(q, k, v, layer_id, batch, scale, launch)


def rows_as_decode(meta: PagedAttentionMetadata, rows: int, v_in_k: bool, group: int, vdim: int) -> bool:
    """Whether a step of several new tokens per sequence runs as decode rows (``ROWS_AS_DECODE``; a tree's with
    ``TREE_ROWS``): its rows times the query group fit one program's accumulator."""
    return ((meta.tail_mask is None or TREE_ROWS) and not v_in_k and 1 < meta.max_query_len <= ROWS_AS_DECODE
            and rows <= ROWS_AS_DECODE_TOTAL and _pad(meta.max_query_len * group) * _pad(vdim) <= ACC_ELEMENTS)


def decode_attention_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
                            scale: float, launch: DecodeLaunch) -> torch.Tensor:
    """One decode step's attention cut as ``launch`` says (``paged_decode_attention_triton`` chooses it;
    bench/decode_rows_probe.py tries others). Shapes as there."""
    meta = batch.paged_metadata()
    cache = batch.kv_cache
    assert cache is not None
    kc, vc = cache.k[layer_id], cache.v[layer_id]
    n, heads, dim = q.shape
    kv_heads, vdim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    v_in_k = layer_id in cache.v_in_k
    da = vdim if v_in_k else dim  # K part A (V's columns when V is in K), part B the rest
    vdim_pad = _pad(vdim)
    block_h = heads_per_program(group, vdim_pad)
    head_blocks = -(-group // block_h)
    out = torch.empty((n, heads, vdim), dtype=q.dtype, device=q.device)
    if not n:
        return out
    rows = meta.max_query_len != 1  # a program per sequence takes its rows x its query heads
    programs = meta.context_lens.shape[0] if rows else n
    tail = meta.tail_mask if rows else None  # a tree: its mask over each context's last indices (else causal)
    tail_bits = meta.token_index if tail is None else tail.contiguous().view(torch.int8)  # unread when causal
    splits = launch.splits
    counters = None
    if splits > 1:
        part_acc, part_m, part_l = split_partials(n, heads, splits, vdim_pad, q.device)
        if FUSED_COMBINE and launch.combine_in_kernel:
            counters = arrival_counters(q.device, programs * kv_heads * head_blocks)
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(programs, kv_heads * head_blocks, splits)](
        q, k, v, kc, vc, out, part_acc, part_m, part_l, meta.block_tables, meta.context_lens, batch.slot_mapping,
        counters if counters is not None else meta.context_lens, meta.token_index, meta.query_start, tail_bits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), scale,
        HEADS=heads, GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks,
        H_PAD=_pad(block_h * meta.max_query_len if rows else block_h), DA=da,
        DA_PAD=_pad(da), DB=dim - da, DB_PAD=_pad(dim - da), VDIM=vdim, VDIM_PAD=vdim_pad, V_IN_K=v_in_k,
        PAGE=cache.block_size, BLOCK_N=launch.block_n, SPLITS=splits, COMBINE=counters is not None,
        DOT_FP32=_DOT_FP32, PREFETCH=launch.prefetch, ROWS=rows, SPLIT_TILES=ROWS_SPLIT_TILES,
        R_PAD=triton.next_power_of_2(meta.max_query_len) if rows else 1, COMBINE_LOADS=COMBINE_LOADS,
        TAIL=0 if tail is None else int(tail.shape[1]), num_warps=launch.warps,
        num_stages=launch.stages, **pdl_launch())
    if splits > 1 and counters is None:
        combine_splits(part_acc, part_m, part_l, out)
    return out
