"""Paged causal flash attention in Triton for steps with several new tokens per sequence (GPU).

Prefill, chunked prefill (a cached prefix before the new tokens), mixed batches (decode rows beside
prefill rows) and trees; a chain verify of speculative decoding where the decode kernel does not take it
as rows (``decode_attention_triton.ROWS_AS_DECODE``: a few new tokens per sequence run there). Plain reference:
``paged_attention_torch.paged_attention_torch`` (same signature and result; it gathers the whole
padded context for every token, this kernel reads only what each token may see).

The new K/V are stored first (``kv_write_triton``; split launches: below), then one program per (query tile, KV head, block
of its query heads) attends: its rows are ``BLOCK_Q`` consecutive new tokens of one sequence times
``BLOCK_H`` heads of the KV head's query group (GQA: the whole group, ``ROWS = BLOCK_Q * group``
padded to a power of two, at least 16 for ``tl.dot``; a group larger than a tile's rows, e.g. MLA's
128 heads over one latent KV head, in blocks of ``ROWS`` heads, one token per tile), with an online
softmax in fp32 over the sequence's cache in ``BLOCK_N`` tiles read through its block table. The
grid is every sequence's tiles laid end to end, ``T // BLOCK_Q + B`` of them (a few empty), times
the KV heads' head blocks, so a long prompt beside many decode rows launches no program per (decode
row, prompt tile); a program finds its sequence by a binary search over ``query_start``. Each program
loops only up to its rows' largest causal limit (``token_index``, read on the device), so the work
follows the real context, not the table's ``max_blocks * block_size``. The layout comes from
``ForwardBatch.paged_metadata()`` device tensors only (``query_start``, ``token_index``,
``block_tables``) and the grid and tiles from static shapes (T, B, kv_heads, ``max_query_len``):
CUDA-graph capturable. A step with few query tiles (a speculative verify or tree draft step: a few dozen
rows) would leave most of the GPU idle while each program walks a whole context, so each tile's key range
is cut into ``splits`` programs (split-KV, ``attention_splits_triton``: as many as fill the GPU, static
for a captured batch) whose partial softmax states ``_combine_kernel`` merges in a launch after; a long
prompt has programs enough and runs unsplit. ``SPLIT_STORES_KV`` (on) has a split launch store the new K/V
itself (no ``write_kv_triton`` launch before it); ``SPLIT_COMBINES`` (off: measured slower on the H200) has
the last of a tile's split programs combine them (``arrival_counters``) instead of the launch after. A
sequence's new tokens are its last cache indices from its first row's causal limit on, its last row holding
the last one (``PagedAttentionMetadata``'s layouts: ``from_lists``, and ``StepGraphs``' padding rows before
the real ones, which share the first real row's limit).

Head dims need not be powers of two and K's may differ from V's: each is padded (to at least 16)
and masked, no lane past a dim loaded. MLA's latent cache (``KVCache.v_in_k``: K = [latent 512 |
rope 64], V = K's first 512 columns) is read as two K parts (scores = q_a k_a^T + q_b k_b^T) whose
first is the V tile too.

A tree given as the metadata's ``tail_mask`` ([T, L] on the device: a captured tree verify or tree
draft step) is read by the kernel in place of the causal rule over each sequence's last L cache
indices (every index before them visible); one given as ``batch.attn_masks`` (eager full masks) goes
to the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..forward_batch import ForwardBatch
from .arrival_counters import arrival_counters
from .attention_splits_triton import MAX_SPLITS, combine_splits, num_splits, split_partials, store_partial
from .kv_write_triton import write_kv_triton
from .paged_attention_torch import paged_attention_torch
from .pdl import pdl_launch, pdl_open

LOG2E = 1.4426950408889634
# A split launch (a verify or draft step of a few rows; splits > 1):
# SPLIT_STORES_KV: it stores the new K/V itself (one program per query tile and KV head) and reads the new
#   tokens' keys and values from k / v, so no program reads a slot written in the launch: no ``write_kv_triton``
#   launch before it. False: that launch, then this kernel reading the cache only. On the H200 SmolLM2's 8-row
#   chain verify graph took 768 us of GPU time with it against 806-809 us without (one lease:
#   bench/results/2026-12-05-spec-defaults-ab-smollm2-h200.json).
# SPLIT_COMBINES: the last of a tile's split programs combines the splits (``arrival_counters``), in a loop over
#   the splits that saw keys, one [rows, V] partial at a time; False: ``_combine_kernel``, a launch after, one
#   program per (token, head) reading all its splits at once. Off: with the former on it made that verify 817 us
#   against 768 (same record; a89add7's version, over all 32 splits, 1044-1060 us against 818-831:
#   2026-12-05-spec-staged-round-smollm2-h200.json). Combining over the active splits only, the programs past
#   them writing nothing and a context one split covers written out by it, it still made the verify 818 against
#   787-792 us on an H100; splits of at least 256 / 512 / 8192 keys (64-, 128- or 256-key tiles; one program a
#   tile at 8192: no combine at all) 789-844 us (2026-12-05-attention-splits-sweep-smollm2-h100.json). The
#   A/B: bench/graph_launch_probe.py --set
#   models.layers.prefill_attention_triton.SPLIT_STORES_KV=False (or SPLIT_COMBINES=True).
SPLIT_STORES_KV = True
SPLIT_COMBINES = False
# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests) multiplies bf16 matrices
# wrongly; there the dots run on fp32 copies. Decided once, as Triton decides to interpret.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_rows(ptr, rows, stride_row, col0, ok, WIDTH: tl.constexpr, PAD: tl.constexpr, DTYPE: tl.constexpr):
    """[len(rows), PAD] of ``ptr``'s rows (columns col0..col0+WIDTH, the rest 0; rows where not ``ok``: 0),
    as ``DTYPE``."""
    c = tl.arange(0, PAD)
    vals = tl.load(ptr + rows[:, None] * stride_row + col0 + c[None, :], mask=ok[:, None] & (c < WIDTH)[None, :],
                   other=0.0)
    return vals.to(DTYPE)


@triton.jit
def _store_rows(ptr, rows, stride_row, col0, vals, ok, WIDTH: tl.constexpr, PAD: tl.constexpr):
    c = tl.arange(0, PAD)
    tl.store(ptr + rows[:, None] * stride_row + col0 + c[None, :], vals, mask=ok[:, None] & (c < WIDTH)[None, :])


@triton.jit
def tail_seen(tail_ptr, rows, ok, n, tail0, TAIL: tl.constexpr):
    """Which keys ``n`` [BLOCK_N] a tree's query rows see (``rows`` [R], the step's rows; ``ok`` [R], the real ones):
    every index before the context's last TAIL (from ``tail0`` on) and, of those, the ones each row's line of the
    tail mask (``tail_ptr``: [T, TAIL] as int8) names; a row not ``ok`` sees the tail's first index (finite,
    unused). -> [R, BLOCK_N] (this kernel's tiles and the decode kernel's rows alike)"""
    rel = n - tail0
    in_tail = (rel >= 0) & (rel < TAIL)
    bits = tl.load(tail_ptr + rows[:, None] * TAIL + rel[None, :], mask=ok[:, None] & in_tail[None, :], other=0)
    return tl.where(in_tail[None, :], (bits != 0) | (~ok[:, None] & (rel == 0)[None, :]), (rel < 0)[None, :])


@triton.jit(do_not_specialize=["num_seqs", "search_steps", "splits"])  # counts that change call to call: one compile for all
def _prefill_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, bt_ptr,
                    qstart_ptr, index_ptr, ctx_ptr, tail_ptr, slot_ptr, cnt_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch,
                    stride_vcs, stride_vch, stride_ot, stride_oh, stride_bt, qk_scale, num_seqs, search_steps,
                    splits, TAIL: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_Q_PAD: tl.constexpr, ROWS: tl.constexpr, DA: tl.constexpr, DA_PAD: tl.constexpr,
                    DB: tl.constexpr, DB_PAD: tl.constexpr, VDIM: tl.constexpr, VDIM_PAD: tl.constexpr,
                    V_IN_K: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                    NEW_KV: tl.constexpr, COMBINE: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    HEADS: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    # K's columns are part A (0..DA) and part B (DA..DA+DB, none when DB = 0); V_IN_K: V is part A.
    # NEW_KV: this launch stores the new K/V (no write before it) and reads the new tokens' keys from k / v,
    # the cached ones from the cache: a sequence's new tokens are its last cache indices, from the first
    # row's causal limit on (padding rows before the real ones share it), the last row holding the last.
    # Sequence b owns the tiles from tile_start(b) = query_start[b] // BLOCK_Q + b on (at least
    # ceil(query_len / BLOCK_Q) of them): this tile's sequence is the last b with tile_start(b) <= pid,
    # found by a binary search over the B sequences. The last tiles (longest contexts) start first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1) // HEAD_BLOCKS  # KV head
    hb = tl.program_id(1) % HEAD_BLOCKS  # block of its query heads
    split = tl.program_id(2)
    seq_lo = num_seqs * 0
    seq_hi = num_seqs - 1
    for _ in range(search_steps):
        mid = (seq_lo + seq_hi + 1) // 2
        ahead = tl.load(qstart_ptr + mid) // BLOCK_Q + mid > pid
        seq_lo = tl.where(ahead, seq_lo, mid)
        seq_hi = tl.where(ahead, mid - 1, seq_hi)
    b = tl.cast(seq_lo, tl.int64)
    q_start = tl.load(qstart_ptr + b)
    q_end = tl.load(qstart_ptr + b + 1)
    first = q_start + (pid - q_start // BLOCK_Q - b) * BLOCK_Q
    r = tl.arange(0, ROWS)
    tok = first + r // BLOCK_H  # row = (token of the tile, head of the block)
    in_group = hb * BLOCK_H + r % BLOCK_H
    heads = h * GROUP + in_group
    rmask = (r < BLOCK_Q * BLOCK_H) & (tok < q_end) & (in_group < GROUP)
    tok = tok.to(tl.int64)
    # Causal (TAIL = 0): each row sees cache indices 0..limit of its sequence; padding rows see index 0
    # (finite, unused). A tree (TAIL > 0): every index before the context's last TAIL, and of those the ones
    # its row of the tail mask ([T, TAIL]) names; padding rows see the tail's first index.
    limit = tl.load(index_ptr + tok, mask=rmask, other=0)
    ctx_b = tl.load(ctx_ptr + b)
    if TAIL > 0:
        tail0 = ctx_b - TAIL  # the sequence's first tail index
        hi = tl.where(first < q_end, tail0 + TAIL, 0)
    else:
        tail0 = 0
        hi = tl.where(first < q_end, tl.max(limit, axis=0) + 1, 0)  # 0: a tile past the new tokens
    # Split-KV (SPLIT: splits > 1): this program takes the split-th range of whole key tiles of 0..hi; the
    # first ``active`` splits get keys, the rest none (their partials weigh nothing)
    split_tokens = tl.cdiv(tl.cdiv(hi, BLOCK_N), splits) * BLOCK_N
    active = tl.cdiv(hi, tl.maximum(split_tokens, 1))
    lo = split * split_tokens
    hi = tl.minimum(hi, lo + split_tokens)
    da = tl.arange(0, DA_PAD)
    damask = da < DA
    if NEW_KV:
        new0 = tl.load(index_ptr + q_start, mask=q_start < q_end, other=0)  # the sequence's first new index
        if (split == 0) & (hb == 0):  # one writer per (new token, KV head); no program reads its slot here
            wt = first + tl.arange(0, BLOCK_Q_PAD)
            wok = (tl.arange(0, BLOCK_Q_PAD) < BLOCK_Q) & (wt < q_end)
            wt = wt.to(tl.int64)
            wslot = tl.load(slot_ptr + wt, mask=wok, other=0).to(tl.int64)
            kcs = kc_ptr + h * stride_kch
            k_new = _load_rows(k_ptr + h * stride_kh, wt, stride_kt, 0, wok, DA, DA_PAD, kc_ptr.dtype.element_ty)
            _store_rows(kcs, wslot, stride_kcs, 0, k_new, wok, DA, DA_PAD)
            if DB > 0:
                kb_new = _load_rows(k_ptr + h * stride_kh, wt, stride_kt, DA, wok, DB, DB_PAD,
                                    kc_ptr.dtype.element_ty)
                _store_rows(kcs, wslot, stride_kcs, DA, kb_new, wok, DB, DB_PAD)
            if not V_IN_K:
                v_new = _load_rows(v_ptr + h * stride_vh, wt, stride_vt, 0, wok, VDIM, VDIM_PAD,
                                   vc_ptr.dtype.element_ty)
                _store_rows(vc_ptr + h * stride_vch, wslot, stride_vcs, 0, v_new, wok, VDIM, VDIM_PAD)
    q_a = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + da[None, :],
                  mask=rmask[:, None] & damask[None, :], other=0.0)
    if DOT_FP32:
        q_a = q_a.to(tl.float32)
    if DB > 0:
        db = DA + tl.arange(0, DB_PAD)
        dbmask = db < DA + DB
        q_b = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + db[None, :],
                      mask=rmask[:, None] & dbmask[None, :], other=0.0)
        if DOT_FP32:
            q_b = q_b.to(tl.float32)
    if not V_IN_K:
        dv = tl.arange(0, VDIM_PAD)
        dvmask = dv < VDIM
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, VDIM_PAD), tl.float32)
    # each tile's block-table lookup one tile ahead, so the pipelined K/V loads wait on no load of their own
    ar = tl.arange(0, BLOCK_N)
    slots_nxt = tl.load(bt_ptr + b * stride_bt + (lo + ar) // PAGE, mask=lo + ar < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        n = start + ar
        nmask = n < hi
        if NEW_KV:
            is_new = n >= new0
            cached = nmask & ~is_new
        else:
            cached = nmask
        slots = slots_nxt * PAGE + n % PAGE
        slots_nxt = tl.load(bt_ptr + b * stride_bt + (n + BLOCK_N) // PAGE, mask=n + BLOCK_N < hi,
                            other=0).to(tl.int64)
        kt = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + da[None, :],
                     mask=cached[:, None] & damask[None, :], other=0.0)
        if NEW_KV:
            rows_new = (q_end - ctx_b + n).to(tl.int64)  # the row of new index n: the last row holds ctx - 1
            fresh = nmask & is_new
            kt = tl.where(fresh[:, None], _load_rows(k_ptr + h * stride_kh, rows_new, stride_kt, 0, fresh, DA,
                                                     DA_PAD, kc_ptr.dtype.element_ty), kt)
        if DOT_FP32:
            s = tl.dot(q_a, tl.trans(kt.to(tl.float32)))
        else:
            s = tl.dot(q_a, tl.trans(kt))
        if DB > 0:
            kb = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + db[None, :],
                         mask=cached[:, None] & dbmask[None, :], other=0.0)
            if NEW_KV:
                kb = tl.where(fresh[:, None], _load_rows(k_ptr + h * stride_kh, rows_new, stride_kt, DA, fresh, DB,
                                                         DB_PAD, kc_ptr.dtype.element_ty), kb)
            if DOT_FP32:
                s += tl.dot(q_b, tl.trans(kb.to(tl.float32)))
            else:
                s += tl.dot(q_b, tl.trans(kb))
        if TAIL > 0:
            visible = tail_seen(tail_ptr, tok, rmask, n, tail0, TAIL)
        else:
            visible = n[None, :] <= limit[:, None]
        s = tl.where(visible, s * qk_scale, float("-inf"))  # [ROWS, BLOCK_N], log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a row that has seen no index yet (a mask over the tiles so far) keeps m = -inf: no -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if V_IN_K:
            vt = kt  # V = K's first VDIM (= DA) columns: the tile already loaded
        else:
            vt = tl.load(vc_ptr + slots[:, None] * stride_vcs + h * stride_vch + dv[None, :],
                         mask=cached[:, None] & dvmask[None, :], other=0.0)
            if NEW_KV:
                vt = tl.where(fresh[:, None], _load_rows(v_ptr + h * stride_vh, rows_new, stride_vt, 0, fresh, VDIM,
                                                         VDIM_PAD, vc_ptr.dtype.element_ty), vt)
        if DOT_FP32:
            pv = tl.dot(p, vt.to(tl.float32))
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m = m_new
    do = tl.arange(0, VDIM_PAD)
    if not SPLIT:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # l_sum = 0: a tile past the new tokens (not stored)
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (do < VDIM)[None, :])
    elif not COMBINE:  # partials [T, HEADS, SPLITS, ...], m in natural-log units; a split seeing none of a row: -inf, 0
        store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, (tok * HEADS + heads) * splits + split,
                      m * 0.6931471805599453, l_sum, acc, rmask, VDIM_PAD)
    elif active == 1:  # one split covers the context: it writes the rows out (the others took no key)
        if split == 0:
            out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (do < VDIM)[None, :])
    elif split < active:  # the last of the tile's ``active`` splits to finish combines them
        store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, (tok * HEADS + heads) * splits + split,
                      m * 0.6931471805599453, l_sum, acc, rmask, VDIM_PAD)
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == active - 1:
            first_row = (tok * HEADS + heads) * splits
            s_idx = tl.arange(0, SPLITS_PAD)
            smask = rmask[:, None] & (s_idx < active)[None, :]
            pm = tl.load(part_m_ptr + first_row[:, None] + s_idx[None, :], mask=smask, other=float("-inf"),
                         cache_modifier=".cg")
            pl = tl.load(part_l_ptr + first_row[:, None] + s_idx[None, :], mask=smask, other=0.0,
                         cache_modifier=".cg")
            top = tl.max(pm, axis=1)
            w = tl.where(pm > float("-inf"), tl.exp(pm - top[:, None]), 0.0)  # [ROWS, SPLITS_PAD]
            total = tl.zeros((ROWS, VDIM_PAD), tl.float32)
            for sp in range(0, active):
                w_sp = tl.sum(tl.where(s_idx[None, :] == sp, w, 0.0), axis=1)
                part = tl.load(part_acc_ptr + (first_row + sp)[:, None] * VDIM_PAD + do[None, :],
                               mask=rmask[:, None], other=0.0, cache_modifier=".cg")
                total += part * w_sp[:, None]
            denom = tl.sum(pl * w, axis=1)
            out = total / tl.where(denom > 0, denom, 1.0)[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + do[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (do < VDIM)[None, :])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def tile_config(group: int, dim_pad: int, max_query_len: int, vdim_pad: int = 0) -> tuple[int, int, int, int, int]:
    """(ROWS, BLOCK_H, BLOCK_N, num_warps, num_stages). ROWS = query rows (tokens x heads), BLOCK_H =
    heads of the group per tile. GQA: the whole group at least, 16 for ``tl.dot``, fewer than the cap
    when the step has few new tokens (a chain verify). K dims up to 128: up to 64 rows x 64 keys. Past
    128: 128 rows x 64 keys on 8 warps, 64 x 32 or 16..32 x 64 on 4. Picked by timing a few on an H200
    (Llama-3-8B and MLA's expanded K 192 prompts, chunks over long prefixes, verify steps), no spills;
    not autotuned. V dims of 256 and more (MLA's latent cache, V 512): 32 rows (an fp32 accumulator of
    32 x 512) x 32 keys on 8 warps, 2 stages, heads of the group first (128 heads: 32 per tile, one
    token): chosen from the register budget, not yet timed."""
    if vdim_pad >= 256:
        rows = max(16, min(32, triton.next_power_of_2(max_query_len * group)))
        return rows, min(group, rows), 32, 8, 2
    wide = dim_pad > 128
    cap = 128 if wide else 64
    rows = max(16, triton.next_power_of_2(group), min(cap, triton.next_power_of_2(max_query_len * group)))
    if not wide:
        return rows, group, 64, 4, 3
    if rows >= 128:
        return rows, group, 64, 8, 2
    return (rows, group, 32, 4, 2) if rows == 64 else (rows, group, 64, 4, 2)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Store the new K/V at ``batch.slot_mapping`` (K alone where V is in K, ``KVCache.v_in_k``), then
    each new token attends causally to cache indices 0..token_index of its sequence, or through the
    metadata's ``tail_mask`` over the context's last indices (a tree). ``batch.attn_masks`` (eager
    trees): ``paged_attention_torch``.

    q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]; v: [T, kv_heads, v_dim] -> [T, heads, v_dim]
    """
    meta = batch.paged_metadata()
    cache = batch.kv_cache
    if cache is None or (batch.attn_masks is not None and any(m is not None for m in batch.attn_masks)):
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
    v_in_k = layer_id in cache.v_in_k
    da = vdim if v_in_k else dim  # K part A (V's columns when V is in K), part B the rest
    vdim_pad = _pad(vdim)
    rows, block_h, block_n, warps, stages = tile_config(group, _pad(dim), meta.max_query_len,
                                                        vdim_pad if v_in_k else 0)
    block_q = rows // block_h
    head_blocks = -(-group // block_h)
    num_seqs = meta.block_tables.shape[0]
    tiles = n // block_q + num_seqs  # every sequence's tiles, a few empty (tile_start)
    splits = num_splits(tiles * kv_heads * head_blocks, meta.block_tables.shape[1] * cache.block_size, block_n)
    new_kv = SPLIT_STORES_KV and splits > 1
    if new_kv and (k.stride(-1) != 1 or v.stride(-1) != 1):  # rows of k / v read in place
        k, v = k.contiguous(), v.contiguous()
    counters = arrival_counters(q.device, tiles * kv_heads * head_blocks) if SPLIT_COMBINES and splits > 1 else None
    if not new_kv:
        write_kv_triton(kc, None if v_in_k else vc, batch.slot_mapping, k, v)
    if splits > 1:
        part_acc, part_m, part_l = split_partials(n, heads, splits, vdim_pad, q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    tail = meta.tail_mask
    tail_bits = meta.token_index if tail is None else tail.contiguous().view(torch.int8)  # unread when causal
    _prefill_kernel[(tiles, kv_heads * head_blocks, splits)](
        q, k, v, kc, vc, out, part_acc, part_m, part_l, meta.block_tables, meta.query_start, meta.token_index,
        meta.context_lens, tail_bits, batch.slot_mapping, counters if counters is not None else meta.context_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0), scale * LOG2E,
        num_seqs, max(1, (num_seqs - 1).bit_length()), splits, 0 if tail is None else tail.shape[1],
        GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks, BLOCK_Q=block_q,
        BLOCK_Q_PAD=triton.next_power_of_2(block_q), ROWS=rows, DA=da, DA_PAD=_pad(da),
        DB=dim - da, DB_PAD=_pad(dim - da), VDIM=vdim, VDIM_PAD=vdim_pad, V_IN_K=v_in_k, PAGE=cache.block_size,
        BLOCK_N=block_n, SPLIT=splits > 1, NEW_KV=new_kv, COMBINE=counters is not None,
        SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS), HEADS=heads, DOT_FP32=_DOT_FP32, num_warps=warps,
        num_stages=stages, **pdl_launch())
    if splits > 1 and counters is None:
        combine_splits(part_acc, part_m, part_l, out)
    return out


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))  # tl.dot takes K and N of 16 at least
