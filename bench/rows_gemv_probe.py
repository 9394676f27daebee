"""A small model's few-row matmuls (a chain verify's 8 rows on SmolLM2) through a candidate with no tensor cores, the
GEMV's shape widened to rows (``_rows_gemv_kernel``, here only), at each cut, against the engine's ``decode_linear``
and cuBLAS; at one row the same against the engine's GEMV.

    . bench/device_env.sh && python -P bench/rows_gemv_probe.py --out $OUT/rows-gemv-probe.json

Why: at 8 rows the decode GEMM (tensor cores, a program per 64 outputs, K in 64-wide pipelined steps) takes ~3.4 us a
matmul in SmolLM2's verify graph against ~2.1 for the one-row GEMV (a program per 4 outputs, all of K in one masked
tile loaded before the PDL wait) in the plain step (2026-12-06-matmul-cuts-k576-kernels-smollm2-h100.json): the
GEMM's programs are few and walk K in serial steps, where the GEMV has every load in flight at once. The candidate
keeps the GEMV's structure for M rows: a program per BLOCK_N outputs loads its [BLOCK_N, K] weights before the PDL
wait in one or two power-of-two pieces (576 = 512 + 64: no masked half tile), then the M rows of x in one load, and
sums the [M, BLOCK_N, K] products over K in fp32. An earlier multi-row GEMV (c357932) loaded x a row at a time
between cross-thread sums, which serialised the loads, and was 3.4-4.2x slower than the GEMM.

Run (2026-12-06-rows-gemv-probe-smollm2-h100.json, H100): alone, at 8 rows the candidate took SmolLM2's down_proj
(K 1536) in 3.30 us against the GEMM's 3.90, but in the verify graph it made the chain-7 verify 734-741 us against
695-697 (2026-12-06-gemv-wide-tile-smollm2-h100.json), so the product does not use it. The same run's one-row
figures gave the GEMV its one tile with 8 warps at 1024 < K < 2048 (``linear_triton.GEMV_WIDE_TILE``).

Each shape: 32 distinct weights (cold, as a step reads them), called back to back in one CUDA graph with PDL as the
engine launches; us per matmul (median of --reps replays; spread = (max - min) / median), rel. error against fp32.
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
from bench.common import Progress, copy_bandwidth, graph_ms, record_header, write_record

progress = Progress("rows_gemv_probe")
SHAPES = "qkv:960:576,o:576:576,gate_up:3072:576,down:576:1536,fc:576:1728"
LAYERS = 32
# (block_n, warps, pieces): pieces 1 = all of K in one masked power-of-two tile, 2 = the largest power of two
# within K plus the rest's next power of two
CUTS = tuple((bn, w, p) for bn in (2, 4, 8) for w in (4, 8) for p in (1, 2))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="rows-gemv-probe.json")
    ap.add_argument("--rows", default="8")
    ap.add_argument("--shapes", default=SHAPES, help="name:n:k,...")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from fusedserve.models.layers.linear_triton import decode_gemm_tile, decode_linear

    dev = torch.device("cuda")
    torch.manual_seed(0)
    record: dict[str, Any] = record_header()
    record["copy_bandwidth_TBps"] = copy_bandwidth(dev, 1 << 30) / 1e12
    record["what"] = __doc__.split("\n\n")[2]
    record["rows"] = {}
    for m in [int(r) for r in args.rows.split(",") if r]:
        out: dict[str, Any] = {}
        for name, n, k in ((a, int(b), int(c)) for a, b, c in (s.split(":") for s in args.shapes.split(",") if s)):
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())

            def time_it(fn: Any, ws: list[torch.Tensor] = ws) -> dict[str, Any]:
                def calls() -> None:
                    for w in ws:
                        fn(w)

                r = graph_ms(calls, args.reps)
                return {"us": round(r["ms"] * 1000 / LAYERS, 2), "spread": r["spread"]}

            row: dict[str, Any] = {"MB": n * k * 2 / 1e6, "engine_tile": decode_gemm_tile(m, n, k),
                                   "engine": time_it(lambda w: decode_linear(x, w)),
                                   "cublas": time_it(lambda w: F.linear(x, w))}
            cuts = []
            for bn, warps, pieces in CUTS:
                if n % bn:
                    continue
                try:
                    err = ((rows_gemv_triton(x, ws[0], None, bn, warps, pieces).float() - ref).norm() / ref.norm()).item()
                    cuts.append({"cut": [bn, warps, pieces], "rel_err": err,
                                 **time_it(lambda w, c=(bn, warps, pieces): rows_gemv_triton(x, w, None, *c))})
                except Exception as e:  # a cut that does not compile: said in the record
                    cuts.append({"cut": [bn, warps, pieces], "error": f"{type(e).__name__}: {e}"[:200]})
            row["cuts"] = cuts
            timed = [c for c in cuts if "us" in c]
            row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
            out[name] = row
            progress(f"rows {m} {name}: engine {row['engine']['us']} cublas {row['cublas']['us']} best {row['best']}")
            ws.clear()
            torch.cuda.empty_cache()
        record["rows"][str(m)] = out
        write_record(record, args.out)


if __name__ == "__main__":
    main()
