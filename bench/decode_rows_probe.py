"""Where a many-row 8B decode step loses to its roofline: the decode GEMM's cuts and decode attention over
cold caches, at 16 and 64 rows (issue #14's batch-64 goal).

    . bench/device_env.sh && python -P bench/decode_rows_probe.py --out $OUT/decode-rows-probe.json

GEMMs: each Llama-3-8B matmul (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) over 32
layers' distinct weights (13.9 GB: nothing stays in L2), captured back to back in one CUDA graph, launched
as the engine launches them (PDL where on): cuBLAS, the engine's cut (``decode_gemm_tile`` /
``decode_gemm_splits``) and each ``GEMM_CUTS`` cut (block_n, block_k, stages, warps, K splits; ``SMALL_CUTS``
for other ``--shapes``), in µs per matmul and TB/s of weights, with each cut's relative error against fp32.
SmolLM2's verify shapes: ``--no-attention --rows 8 --shapes qkv:960:576,o:576:576,gate_up:3072:576,down:576:1536``
(the 8B names' cuts then apply: name them otherwise, e.g. ``s_qkv``, for ``SMALL_CUTS``, which holds the one tile
as slices in batched dots too: ``linear_triton.ONE_TILE_SLICES``); at one row also the
GEMV at each ``GEMV_CUTS`` tile (``gemv_cuts``, ``gemv_best``); ``--rows-gemv``: a few rows through the GEMV widened
to rows at each ``ROWS_GEMV_CUTS`` cut (``rows_gemv_cuts``: ``--rows 1,8 --no-attention --rows-gemv --shapes
s_qkv:960:576,s_o:576:576,s_gate_up:3072:576,s_down:576:1536,s_fc:576:1728``).

Attention: the engine's decode kernel (``decode_attention_launch``) at batch 16 / 64, context ``--ctx``,
32 calls per graph each on its own layer's cache (what a step reads: 42 MB a layer at batch 64 fits the
H200's 50 MB L2, so the earlier one-layer sweep, 2026-12-02-decode-launch-sweep-h200.json, read it warm), at the engine's cut and
each ``ATTENTION_CUTS`` cut (keys per tile, warps, stages, splits, loads read ahead in registers), with each
compiled variant's shared memory, registers and whether Triton pipelined its loads; and the engine's cut on
one layer's cache (warm) for comparison. ``--verify-new 8 --rows 1,4,8 --ctx 512,2048,8192``: a chain
verify's attention (8 new tokens a sequence) as decode rows against the prefill kernel (``verify_attention``;
2026-12-06-verify-attention-grouped-rows-8b-smollm2-h100.json). ``--shapes``: other GEMM shapes (e.g. output counts that fill the
multiprocessors in whole waves). Runs: 2026-12-04-decode-rows-probe-gemm-h200.json (GEMMs),
2026-12-04-decode-attention-cold-sweep-h200.json (attention, 3 contexts), 2026-12-04-decode-gemm-waves-h200.json
(``--shapes``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers.pdl import pdl_launch, pdl_release, pdl_wait

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, apply_settings, copy_bandwidth, graph_ms, record_header, write_record

progress = Progress("decode_rows_probe")
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
GEMM_CUTS: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "qkv": ((64, 128, 6, 4, 1), (64, 128, 3, 4, 2), (128, 128, 4, 4, 2), (128, 128, 4, 8, 2), (128, 64, 6, 4, 2),
            (256, 64, 4, 8, 4), (256, 64, 3, 8, 4), (128, 64, 6, 4, 4)),
    "o": ((64, 128, 6, 4, 1), (64, 128, 6, 4, 2), (64, 128, 3, 4, 4), (128, 128, 4, 4, 4), (128, 128, 4, 8, 4),
          (128, 64, 6, 4, 4), (256, 64, 4, 8, 8), (128, 64, 6, 4, 2)),
    "gate_up": ((128, 128, 4, 4, 1), (64, 128, 6, 4, 1), (256, 64, 4, 8, 1), (128, 64, 6, 4, 1), (128, 128, 4, 8, 1),
                (64, 128, 3, 4, 1)),
    "down": ((64, 128, 6, 4, 2), (64, 128, 6, 4, 1), (64, 128, 3, 4, 4), (128, 128, 4, 4, 4), (128, 128, 4, 8, 4),
             (128, 64, 6, 4, 4), (256, 64, 4, 8, 8), (128, 64, 6, 4, 2)),
}
# 32-wide tiles (qkv 192 programs, o / down 128 on 132 multiprocessors, no K split) were timed and lost: at 64 rows on
# an H100 the qkv took 34.0 / 40.1 us with (32, 128, 4 / 3 stages, 4) against 21.3 with (64, 128, 6, 4), and the 8B
# step 9.68 against 6.51 ms (2026-12-07-decode-narrow-tile-heads-first-ab-8b-h100.json); not among the cuts.
# other shapes (--shapes, e.g. SmolLM2's 576-wide ones): the K loop at 64-wide steps (the engine's cut there), one
# tile of all of K (block_k >= k: the kernel's ONE_TILE, its weights read before the PDL wait), and fewer, wider K
# steps whose last one is masked where block_k does not divide K (576 = 4.5 x 128). Narrow blocks with K splits took
# 1.5-2x as long (2026-12-05-decode-gemm-narrow-tiles-ab-smollm2-h100.json) and are no longer swept.
# A sixth element: the one tile as slices of that many columns in batched dots (``linear_triton.ONE_TILE_SLICES``,
# set while the cut is captured; its warps are the cut's).
SMALL_CUTS: tuple[tuple[int, ...], ...] = (
    tuple((bn, 64, 6, 4, 1) for bn in (16, 32, 64))
    + ((16, 1024, 1, 4, 1), (32, 1024, 1, 8, 1), (16, 2048, 1, 4, 1))
    + tuple((bn, bk, st, 4, 1) for bn in (16, 32, 64) for bk, st in ((128, 4), (256, 3), (512, 2)))
    + ((64, 256, 3, 8, 1), (64, 512, 2, 8, 1))
    + tuple((bn, bk, 1, w, 1, sk) for bk in (1024, 2048) for bn, w, sk in ((16, 8, 64), (16, 4, 64), (32, 8, 64),
                                                                         (16, 8, 32), (16, 8, 128))))
# the one-row GEMV (no tensor cores: the row against each [block_n, block_k] weight tile in registers), as (block_n,
# block_k, warps); at 2-8 rows a row at a time it was 3.4-4.2x slower than the decode GEMM on SmolLM2's shapes
# (2026-12-06-verify-kernel-marginals-smollm2-h100.json) and was taken out of linear_triton
GEMV_CUTS = ((4, 64, 4), (4, 128, 4), (4, 256, 4), (8, 64, 4), (8, 128, 4), (2, 128, 2), (2, 256, 4), (16, 64, 4))
# --rows-gemv: a candidate for a few rows at a small model's widths, the GEMV's shape widened to rows
# (``_rows_gemv_kernel``, here only), as (block_n, warps, pieces): pieces 1 = all of K in one masked power-of-two tile,
# 2 = the largest power of two within K plus the rest's next power of two. At 8 rows it beat the decode GEMM alone on
# SmolLM2's down_proj (3.30 against 3.90 us) and lost in the verify graph (734-741 against 695-697 us:
# 2026-12-06-rows-gemv-probe-smollm2-h100.json, 2026-12-06-gemv-wide-tile-smollm2-h100.json); its one-row figures gave
# the GEMV its one wide tile (``linear_triton.GEMV_WIDE_TILE``).
ROWS_GEMV_CUTS = tuple((bn, w, p) for bn in (2, 4, 8) for w in (4, 8) for p in (1, 2))
# (keys per tile, warps, stages, splits, read ahead in registers)
ATTENTION_CUTS = tuple((bn, w, st, sp, ahead) for bn, w in ((32, 4), (64, 8), (16, 2)) for sp in (1, 2, 4, 8, 16, 32)
                       for ahead, st in ((True, 2), (False, 3)))
LAYERS = 32
BLOCK = 16
WIDTH = 8192 // BLOCK  # pages per block table in the 8B engine's captured batches


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                      M_PAD: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PDL: tl.constexpr):
    """The GEMV's shape for a few rows (no tensor cores): a program per BLOCK_N outputs loads its [BLOCK_N, K]
    weights before the PDL wait — in one masked power-of-two piece of K1, or two (K1 the largest power of two
    within K, K2 the rest's next one) — then the M <= M_PAD rows of x in one load, and sums the [M, BLOCK_N, K]
    products over K in fp32. Every load is in flight at once, where the decode GEMM walks K in serial steps and
    has few programs at a small model's widths. (A multi-row GEMV that loaded x a row at a time between its
    cross-thread sums, c357932, serialised those loads and was 3.4-4.2x slower than the GEMM.)"""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    k1 = tl.arange(0, K1)
    w1 = tl.load(w_ptr + rn[None, :, None] * stride_wn + k1[None, None, :], mask=k1[None, None, :] < K, other=0.0)
    if K2 > 0:
        k2 = K1 + tl.arange(0, K2)
        w2 = tl.load(w_ptr + rn[None, :, None] * stride_wn + k2[None, None, :], mask=k2[None, None, :] < K,
                     other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    live = rm[:, None, None] < M
    x1 = tl.load(x_ptr + rm[:, None, None] * stride_xm + k1[None, None, :], mask=live & (k1[None, None, :] < K),
                 other=0.0)
    acc = tl.sum(x1.to(tl.float32) * w1.to(tl.float32), axis=2)
    if K2 > 0:
        x2 = tl.load(x_ptr + rm[:, None, None] * stride_xm + k2[None, None, :], mask=live & (k2[None, None, :] < K),
                     other=0.0)
        acc += tl.sum(x2.to(tl.float32) * w2.to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def rows_gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 2,
                     warps: int = 4, pieces: int = 1) -> torch.Tensor:
    """x: [m, K] (m <= 16); weight: [N, K] (N a multiple of block_n) -> [m, N] with ``_rows_gemv_kernel``, K in
    ``pieces`` (1 or 2) power-of-two loads."""
    m, k = x.shape
    if pieces == 1:
        k1, k2 = triton.next_power_of_2(k), 0
    else:
        k1 = 1 << (k.bit_length() - 1)
        k2 = triton.next_power_of_2(k - k1) if k > k1 else 0
    y = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    _rows_gemv_kernel[(weight.shape[0] // block_n,)](
        x, weight, bias if bias is not None else weight, y, m, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_N=block_n, M_PAD=max(2, triton.next_power_of_2(m)), K1=k1, K2=k2, HAS_BIAS=bias is not None,
        num_warps=warps, **pdl_launch())
    return y


def gemms(rows: int, reps: int, bw: float, shapes: tuple[tuple[str, int, int], ...] = SHAPES,
          rows_gemv: bool = False) -> dict[str, Any]:
    from fusedserve.models.layers import linear_triton as lt
    from fusedserve.models.layers.linear_triton import (
        decode_gemm_splits,
        decode_gemm_tile,
        decode_linear,
        gemm_triton,
        gemv_tile,
        gemv_triton,
    )

    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    for name, n, k in shapes:
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        mb = n * k * 2 / 1e6
        row: dict[str, Any] = {"MB": mb}

        def time_it(fn: Any, ws: list[torch.Tensor] = ws) -> dict[str, Any]:
            def calls() -> None:
                for w in ws:
                    fn(w)

            r = graph_ms(calls, reps)
            us = r["ms"] * 1000 / LAYERS
            return {"us": round(us, 2), "spread": r["spread"], "TBps": round(mb / us, 3),
                    "of_copy_bw": round(mb / us / (bw / 1e12), 3)}

        row["cublas"] = time_it(lambda w: F.linear(x, w))
        tile = decode_gemm_tile(rows, n, k)
        row["engine_cut"] = [*tile, decode_gemm_splits(n, k, tile, dev)] if tile else None
        row["engine"] = time_it(lambda w: gemm_triton(x, w))
        cuts = []
        for cut in GEMM_CUTS.get(name, SMALL_CUTS):
            bn, bk, stages, warps, splits = cut[:5]
            slice_k = cut[5] if len(cut) > 5 else 0
            if n % bn or (k % (bk * splits) if bk < k and splits > 1 else splits > 1 or bk >= 2 * k):
                continue  # split K needs whole steps; one tile (bk >= k: ONE_TILE) the next power of two
            if slice_k and (bk < k or k % slice_k):
                continue  # slices: of one tile, whole ones
            before = lt.ONE_TILE_SLICES
            lt.ONE_TILE_SLICES = (slice_k, warps) if slice_k else None
            try:
                err = ((gemm_triton(x, ws[0], None, (bn, bk, stages, warps), splits).float() - ref).norm()
                       / ref.norm()).item()
                cuts.append({"cut": list(cut), **time_it(lambda w, c=cut: gemm_triton(x, w, None, c[:4], c[4])),
                             "rel_err": err})
            except Exception as e:  # a cut that does not compile or fit: said in the record
                cuts.append({"cut": list(cut), "error": f"{type(e).__name__}: {e}"[:200]})
            finally:
                lt.ONE_TILE_SLICES = before
        row["cuts"] = cuts
        timed = [c for c in cuts if "us" in c]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        if rows == 1:  # the engine's GEMV (decode_linear at one row, the tile gemv_tile picks) and other tiles
            row["gemv_engine"] = {"tile": list(gemv_tile(k)), **time_it(lambda w: decode_linear(x, w))}
            gemv_cuts = []
            for bn, bk, warps in GEMV_CUTS:
                if n % bn:
                    continue
                err = ((gemv_triton(x, ws[0], None, bn, bk, warps).float() - ref).norm() / ref.norm()).item()
                gemv_cuts.append({"cut": [bn, bk, warps], "rel_err": err,
                                  **time_it(lambda w, c=(bn, bk, warps): gemv_triton(x, w, None, *c))})
            row["gemv_cuts"] = gemv_cuts
            row["gemv_best"] = min(gemv_cuts, key=lambda c: c["us"]) if gemv_cuts else None
        if rows_gemv:
            row["rows_gemv_cuts"] = []
            for bn, warps, pieces in ROWS_GEMV_CUTS:
                if n % bn:
                    continue
                err = ((rows_gemv_triton(x, ws[0], None, bn, warps, pieces).float() - ref).norm() / ref.norm()).item()
                row["rows_gemv_cuts"].append({"cut": [bn, warps, pieces], "rel_err": err, **time_it(
                    lambda w, c=(bn, warps, pieces): rows_gemv_triton(x, w, None, *c))})
            row["rows_gemv_best"] = min(row["rows_gemv_cuts"], key=lambda c: c["us"], default=None)
        out[name] = row
        progress(f"gemm rows {rows} {name}: cublas {row['cublas']['us']} engine {row['engine']['us']} "
                 f"best {row['best']}" + (f" gemv best {row['gemv_best']}" if row.get("gemv_best") else "")
                 + (f" rows gemv best {row['rows_gemv_best']}" if row.get("rows_gemv_best") else ""))
        ws.clear()
        torch.cuda.empty_cache()
    return out


def attention(batch: int, ctx: int, reps: int) -> dict[str, Any]:
    from bench.attention_kernels import decode_case
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata
    from fusedserve.models.layers import decode_attention_triton as dat
    from fusedserve.models.layers.decode_attention_triton import (
        DecodeLaunch,
        decode_attention_launch,
        decode_launch,
    )

    dev = torch.device("cuda")
    c = decode_case(batch, ctx, LAYERS)
    q, k, v = c.q, c.k, c.v
    wide = torch.zeros(batch, WIDTH, dtype=torch.int32, device=dev)
    wide[:, :c.pages.shape[1]] = c.pages
    meta = PagedAttentionMetadata.decode(wide, torch.full((batch,), ctx, dtype=torch.int32, device=dev))
    fb = ForwardBatch(torch.zeros(batch, dtype=torch.long, device=dev), torch.zeros(batch, device=dev), [1] * batch,
                      [ctx] * batch, c.slots, [list(t) for t in c.tables], c.kv, paged=meta)
    kv_bytes = batch * ctx * 8 * 128 * 2 * 2
    scale = 128 ** -0.5

    def time_it(launch: Any, cold: bool) -> dict[str, Any]:
        def calls() -> None:
            for i in range(LAYERS):
                decode_attention_launch(q, k, v, i if cold else 0, fb, scale, launch)

        r = graph_ms(calls, reps)
        us = r["ms"] * 1000 / LAYERS
        return {"us": round(us, 2), "spread": r["spread"], "TBps": round(kv_bytes / us / 1e6, 3)}

    chosen = decode_launch(batch * 8, WIDTH * BLOCK)
    row: dict[str, Any] = {"batch": batch, "context": ctx, "kv_bytes_per_layer": kv_bytes,
                           "engine_cut": list(chosen.__dict__.values()), "engine_cold": time_it(chosen, True),
                           "engine_warm_one_layer": time_it(chosen, False)}
    ref = decode_attention_launch(q, k, v, 0, fb, scale, chosen).float()
    cuts = []
    for block_n, warps, stages, splits, prefetch in ATTENTION_CUTS:
        if splits > 1 and -(-ctx // block_n) < splits:
            continue
        launch = DecodeLaunch(block_n, warps, stages, splits, prefetch)
        cut = [block_n, warps, stages, splits, prefetch]
        try:
            diff = (decode_attention_launch(q, k, v, 0, fb, scale, launch).float() - ref).abs().max().item()
            cuts.append({"cut": cut, **time_it(launch, True), "max_abs_diff": diff})
        except Exception as e:  # a cut that does not compile or fit: said in the record
            cuts.append({"cut": cut, "error": f"{type(e).__name__}: {e}"[:200]})
    row["compiled"] = compiled_kernels(dat._decode_kernel)
    row["cuts_cold"] = cuts
    timed = [c for c in cuts if "us" in c]
    row["best_cold"] = min(timed, key=lambda c: c["us"]) if timed else None
    progress(f"attention batch {batch} context {ctx}: engine cold {row['engine_cold']} warm {row['engine_warm_one_layer']} "
             f"best {row['best_cold']}")
    return row


def verify_attention(batch: int, ctx: int, new: int, reps: int) -> dict[str, Any]:
    """A chain verify's attention on the 8B shape: ``new`` tokens per sequence (the last of each context of
    ``ctx``), 32 calls per graph each on its own layer's cache, through the engine's entry point
    (``paged_decode_attention_triton``) with the new tokens as decode rows (``ROWS_AS_DECODE``, the default: a
    program per sequence takes its rows, each key read once for all of them) and through the prefill kernel
    (``ROWS_AS_DECODE = 0``), alternated twice, ``reps`` replays each; the two outputs' largest difference."""
    from bench.attention_kernels import decode_case
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata
    from fusedserve.models.layers import decode_attention_triton as dat

    dev = torch.device("cuda")
    c = decode_case(batch, ctx, LAYERS)
    g = torch.Generator(device=dev).manual_seed(ctx + new)
    rows = batch * new
    q = torch.randn(rows, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(rows, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(rows, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    tables = [list(t) for t in c.tables]
    meta = PagedAttentionMetadata.from_lists([new] * batch, [ctx] * batch, tables, dev, max_blocks=WIDTH)
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in range(ctx - new, ctx)], device=dev)
    fb = ForwardBatch(torch.zeros(rows, dtype=torch.long, device=dev), torch.zeros(rows, device=dev), [new] * batch,
                      [ctx] * batch, slots, tables, c.kv, paged=meta)
    kv_bytes = batch * ctx * 8 * 128 * 2 * 2
    scale = 128 ** -0.5
    saved = dat.ROWS_AS_DECODE
    row: dict[str, Any] = {"batch": batch, "context": ctx, "new_tokens": new, "kv_bytes_per_layer": kv_bytes}
    outs = {}
    try:
        for _ in range(2):
            for name, rows_as_decode in (("decode_rows", saved), ("prefill_kernel", 0)):
                dat.ROWS_AS_DECODE = rows_as_decode

                def calls() -> None:
                    for i in range(LAYERS):
                        dat.paged_decode_attention_triton(q, k, v, i, fb, scale)

                r = graph_ms(calls, reps)
                us = r["ms"] * 1000 / LAYERS
                row.setdefault(name, []).append({"us": round(us, 2), "spread": r["spread"],
                                                 "TBps": round(kv_bytes / us / 1e6, 3)})
                outs[name] = dat.paged_decode_attention_triton(q, k, v, 0, fb, scale).float()
    finally:
        dat.ROWS_AS_DECODE = saved
    row["max_abs_diff"] = (outs["decode_rows"] - outs["prefill_kernel"]).abs().max().item()
    progress(f"verify attention batch {batch} context {ctx} new {new}: rows {row['decode_rows']} "
             f"prefill kernel {row['prefill_kernel']} diff {row['max_abs_diff']:.3g}")
    return row


def compiled_kernels(kernel: Any) -> list[dict[str, Any]]:
    """Each compiled variant of a Triton kernel: its constants, shared memory, and whether Triton pipelined its
    loads (asynchronous copies in its TTGIR)."""
    out: list[dict[str, Any]] = []
    try:
        for cache in kernel.device_caches.values():
            for key, ck in cache[0].items():
                ttgir = ck.asm.get("ttgir", "")
                out.append({"key": str(key)[-300:], "shared": ck.metadata.shared,
                            "num_stages": ck.metadata.num_stages, "num_warps": ck.metadata.num_warps,
                            "async_copies": ttgir.count("async_copy_global_to_local"),
                            "registers": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None)})
    except Exception as e:  # Triton's cache layout differs between versions: said in the record
        out.append({"error": f"{type(e).__name__}: {e}"[:200]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="decode-rows-probe.json")
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--ctx", default="163", help="contexts of the attention cases (163: the decode bench's midpoint)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--verify-new", type=int, default=0,
                    help="attention only: a chain verify of this many new tokens per sequence at each --rows batch "
                         "and --ctx, as decode rows against the prefill kernel (verify_attention)")
    ap.add_argument("--shapes", default="",
                    help="name:n:k,... GEMM shapes instead of the 8B ones (cuts only for the 8B names), e.g. the same K "
                         "at output counts that fill the GPU's multiprocessors in whole waves: does a matmul's time "
                         "follow its bytes or its waves")
    ap.add_argument("--rows-gemv", action="store_true",
                    help="also the GEMV widened to rows (ROWS_GEMV_CUTS), for a small model's --shapes")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant under fusedserve. first (an A/B), e.g. "
                         "models.layers.linear_triton.SPLIT_K_MAX=1")
    args = ap.parse_args()
    settings = apply_settings(args.set)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    record: dict[str, Any] = record_header()
    record["settings"] = settings
    bw = copy_bandwidth(dev, 1 << 30)
    record["copy_bandwidth_TBps"] = bw / 1e12
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.verify_new:
        record["verify_attention"] = []
        for ctx in [int(c) for c in args.ctx.split(",")]:
            for b in rows:
                record["verify_attention"].append(verify_attention(b, ctx, args.verify_new, args.reps))
                torch.cuda.empty_cache()
                write_record(record, args.out)
        return
    if not args.no_attention:
        record["attention"] = []
        for ctx in [int(c) for c in args.ctx.split(",")]:
            for b in rows:
                record["attention"].append(attention(b, ctx, args.reps))
                torch.cuda.empty_cache()  # this case's caches (34 GB at batch 64, 4096 tokens) back to the GPU
                write_record(record, args.out)
    if not args.no_gemm:
        record["gemm"] = {}
        for m in rows:
            shapes = tuple((a, int(b), int(c)) for a, b, c in (x.split(":") for x in args.shapes.split(",") if x))
            record["gemm"][str(m)] = gemms(m, args.reps, bw, shapes or SHAPES, args.rows_gemv)
            write_record(record, args.out)


if __name__ == "__main__":
    main()
