"""Does programmatic dependent launch (PDL) take the fixed cost out of a decode step's GEMVs?

    python -P bench/pdl_gemv_probe.py --out $OUT/pdl-gemv-probe.json   # the package laid out as bench/device_env.sh does

A Llama-3-8B-shaped batch-1 step without the model: 32 layers of GEMVs (qkv 6144x4096, o 4096x4096,
gate_up 28672x4096, down 4096x14336; distinct weights per layer, 13.9 GB, so nothing stays in L2) and,
between them, the engine's small kernels stood in by Triton copies of the activations (add-RMSNorm before
qkv and gate_up, RoPE / KV write / attention / combine before o, SiLU-and-mul before down), every kernel
reading the one before's output, captured as one CUDA graph. Variants: cuBLAS GEMVs (the engine today);
a Triton GEMV (each shape's best tile of a small sweep); the same Triton kernels launched with PDL — each
kernel lets its dependents launch as soon as all its programs have started, and a GEMV loads its first
weight tile before waiting on the kernel before it, so its ramp overlaps the predecessor's tail. Per
variant: ms per step (median of replays, spread), the weights' bytes over it against the copy bandwidth
measured in the same run, and the result's distance from the non-PDL run of the same kernels (PDL must not
change a bit). The GEMV is the engine's (``linear_triton._gemv_kernel``, with ``pdl.py``); the first run
(bench/results/2026-12-03-pdl-gemv-probe-h200.json, the probe before the kernel moved into the package)
had the same kernel written here: cuBLAS 4.09 ms, Triton GEMV 3.76, with PDL 3.50 (97 % of the weights'
roofline), bit-equal.

(The GEMV at 2-4 rows was 1.5-3x slower than cuBLAS at every tile on an H200, 2026-12-03-pdl-gemv-probe-rows-h200.json,
and 3.4-4.2x slower than the decode GEMM at 8 rows on SmolLM2's shapes: it takes one row, and that sweep was removed.)
``--dot-rows`` (default 16, 64): the engine's decode GEMM for 2..64 rows (``linear_triton._decode_gemm_kernel``,
operands swapped so the weight's rows fill the MMA) against cuBLAS per shape at each DOT_CFGS tile, the best
again with PDL (and whether one GEMM with PDL is bit-equal to without), and the tile the engine picks
(``decode_gemm_tile``); then the emulated step at that many rows (``chain_rows``): cuBLAS against the GEMM
at each shape's best tile without / with PDL, at the engine's tiles with PDL, and with PDL again.
``--no-batch1`` skips the batch-1 part. Runs: 2026-12-03-pdl-gemv-probe-rerun-h200.json (the kernel still
in the probe: 3 % under cuBLAS at 16 rows, equal at 64), -pre- (with PDL -8 % / -5 % at 16 / 64 rows in the
step; its first weight tile read into registers before the PDL wait: 2-3x slower), -pf- (its first 2-8
weight tiles prefetched into L2 before the wait: no gain). In those two the chain overwrote its own input,
so its results depended on how often each variant had run (the 0.05 / 0.006 "differences" there); it now
restarts from the same input, and one GEMM with and without PDL was bit-equal. -peeled- (605e518): the
engine's GEMM with its first K step's weight tile loaded before the PDL wait, Triton's pipelined loop after:
3.89 ms against the engine kernel's 3.85 at 16 rows, out of shared memory at 64 rows (gate_up's 128x128 tile,
one stage more); the candidate is gone from here since.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fusedserve.models.layers.linear_triton import (
    _decode_gemm_kernel,
    _gemv_kernel,
    decode_gemm_tile,
)
from fusedserve.models.layers.pdl import HAVE_GDC, pdl_open

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, copy_bandwidth, graph_ms, record_header, write_record

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
# small kernels before each GEMV: (how many, elements each reads/writes)
SMALL = {"qkv": ((1, 4096),), "o": ((4, 4096),), "gate_up": ((1, 4096),), "down": ((1, 14336),)}
TILES = ((2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (4, 2048, 8), (8, 1024, 8), (16, 512, 8),
         (2, 2048, 4))
progress = Progress("pdl_gemv_probe")

@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The stand-in for a small kernel: y = 1.0001 x over n elements."""
    pdl_open(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, (x.to(tl.float32) * 1.0001).to(y_ptr.dtype.element_ty), mask=i < n)


DOT_CFGS = ((64, 128, 4, 4), (64, 256, 3, 4), (64, 128, 6, 4), (32, 256, 4, 4), (128, 128, 4, 4), (128, 64, 6, 4),
            (32, 128, 6, 4), (16, 256, 4, 4), (64, 128, 3, 4), (64, 128, 2, 4), (64, 64, 4, 4), (64, 64, 8, 4),
            (64, 128, 4, 8), (128, 128, 3, 8), (64, 256, 2, 4))


def dot(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: tuple[int, int, int, int], pdl: bool) -> None:
    """The engine's decode GEMM (``linear_triton._decode_gemm_kernel``) at the tile ``cfg`` (block_n,
    block_k, stages, warps), with or without PDL."""
    bn, bk, stages, warps = cfg
    m = x.shape[0]
    _decode_gemm_kernel[(w.shape[0] // bn, 1)](x, w, w, y, w, w, w, w, m, w.shape[0], w.shape[1], 0, 0, x.stride(0),
                                                w.stride(0), y.stride(0), BLOCK_N=bn,
                                                BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_K=bk, SPLIT_K=1,
                                                HAS_BIAS=False, DOT_FP32=False, EPILOGUE=0, HEAD_DIM=2,
                                                ONE_TILE=bk >= w.shape[1], PREFETCH_LINES=0, LINE=64, PDL=pdl,
                                                num_stages=stages, num_warps=warps, **_pdl(pdl))


def dot_sweep(weights: list[dict[str, torch.Tensor]], m: int, dev: torch.device) -> dict[str, Any]:
    """us per GEMM at ``m`` rows: cuBLAS and each DOT_CFGS tile (32 layers' weights back to back), the best
    tile again with PDL."""
    out: dict[str, Any] = {}
    for name, n, k in SHAPES:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ws = [w[name] for w in weights]
        per = 1000 / len(ws)
        cub = graph_ms(lambda: [torch.matmul(x, w.t(), out=y) for w in ws], 10)["ms"] * per
        rows: dict[str, Any] = {}
        for cfg in DOT_CFGS:
            if n % cfg[0] or k % cfg[1]:
                continue
            try:
                rows[str(cfg)] = round(graph_ms(lambda c=cfg: [dot(x, w, y, c, False) for w in ws], 10)["ms"] * per, 2)
            except Exception as e:  # a tile that does not compile or fit here is said in the record
                rows[str(cfg)] = f"{type(e).__name__}: {e}"[:200]
        timed = {c: v for c, v in rows.items() if isinstance(v, float)}
        best = min(timed, key=timed.__getitem__)
        ref = F.linear(x.float(), ws[0].float())
        dot(x, ws[0], y, ast.literal_eval(best), False)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        cfg = ast.literal_eval(best)
        variants: dict[str, Any] = {}
        if HAVE_GDC:
            plain = y.clone()
            dot(x, ws[0], y, cfg, True)
            variants["pdl_bit_equal_one_gemm"] = torch.equal(plain, y)
            variants["pdl"] = round(graph_ms(lambda: [dot(x, w, y, cfg, True) for w in ws], 10)["ms"] * per, 2)
        engine = decode_gemm_tile(m, n, k)
        variants["engine_tile"] = str(engine)
        out[name] = {"cublas_us": round(cub, 2), "best": best, "best_us": timed[best], "best_variants_us": variants,
                     "rel_err_vs_fp32": err, "tiles_us": rows}
        progress(f"rows {m} {name}: {out[name]}")
    return out


def _pdl(on: bool) -> dict[str, bool]:
    return {"launch_pdl": True} if on else {}


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tile: tuple[int, int, int], pdl: bool) -> None:
    bn, bk, warps = tile
    _gemv_kernel[(w.shape[0] // bn,)](x, w, w, y, w, w, w.shape[1], 0, 0, w.stride(0), 0, BLOCK_N=bn, BLOCK_K=bk,
                                      EVEN_K=True, HAS_BIAS=False, EPILOGUE=0, HEAD_DIM=2, PDL=pdl, num_warps=warps,
                                      **_pdl(pdl))


def copy(x: torch.Tensor, y: torch.Tensor, n: int, pdl: bool) -> None:
    _copy_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024, PDL=pdl, num_warps=4, **_pdl(pdl))


def step_fn(weights: list[dict[str, torch.Tensor]], bufs: dict[str, torch.Tensor], kind: str,
            tiles: dict[str, tuple[int, int, int]], small: bool) -> Callable[[], None]:
    """kind: cublas | triton | pdl. The chain x -> [small] -> GEMV -> ... through ``bufs``."""
    pdl = kind == "pdl"

    def run() -> None:
        x = bufs["x"]
        for layer in weights:
            for name, n, k in SHAPES:
                if small:
                    for count, elems in SMALL[name]:
                        for _ in range(count):
                            s, t = bufs[f"s{elems}"], bufs[f"t{elems}"]
                            out = t if x.data_ptr() == s.data_ptr() else s
                            copy(x, out, elems, pdl)
                            x = out
                y = bufs[f"y_{name}"]
                if kind == "cublas":
                    torch.matmul(x[:k].view(1, k), layer[name].t(), out=y.view(1, n))
                else:
                    gemv(x, layer[name], y, tiles[name], pdl)
                x = y
        bufs["out"].copy_(x[:4096])
    return run


def chain_rows(weights: list[dict[str, torch.Tensor]], m: int, cfgs: dict[str, tuple[int, int, int, int]],
               reps: int, dev: torch.device) -> list[dict[str, Any]]:
    """The emulated step (small kernels included) at ``m`` rows: cuBLAS, the decode GEMM at ``cfgs`` without
    and with PDL, at the engine's tiles (``decode_gemm_tile``) with PDL, and at ``cfgs`` with PDL again; ms
    per step, each GEMM variant's result against the one without PDL (same tiles: PDL must not change a bit)."""
    size = m * max(n for _, n, _ in SHAPES)
    a, b = (torch.randn(size, device=dev, dtype=torch.bfloat16) for _ in range(2))
    a0 = a.clone()  # the chain overwrites a: every run starts again from a0 (else results follow the run count)
    ys = {name: torch.empty(m * n, device=dev, dtype=torch.bfloat16) for name, n, _ in SHAPES}
    out = torch.empty(m * 4096, device=dev, dtype=torch.bfloat16)

    def fn(kind: str) -> Callable[[], None]:
        pdl = kind.startswith("dot_")
        engine = {name: decode_gemm_tile(m, n, k) for name, n, k in SHAPES}
        tiles = engine if kind == "dot_engine_tiles" else cfgs

        def run() -> None:
            a.copy_(a0)
            x = a
            for layer in weights:
                for name, n, k in SHAPES:
                    for count, elems in SMALL[name]:
                        for _ in range(count):
                            dst = b if x.data_ptr() == a.data_ptr() else a
                            copy(x, dst, m * elems, pdl)
                            x = dst
                    xv, yv = x[: m * k].view(m, k), ys[name].view(m, n)
                    if kind == "cublas":
                        torch.matmul(xv, layer[name].t(), out=yv)
                    else:
                        dot(xv, layer[name], yv, tiles[name], pdl)
                    x = ys[name]
            out.copy_(x[: m * 4096])
        return run

    rows: list[dict[str, Any]] = []
    finals: dict[str, torch.Tensor] = {}
    for kind in ("cublas", "dot", "dot_pdl", "dot_engine_tiles", "dot_pdl_again"):
        if kind != "cublas" and kind != "dot" and not HAVE_GDC:
            continue
        try:
            r: dict[str, Any] = graph_ms(fn(kind), reps)
            fn(kind)()
            torch.cuda.synchronize()
            finals[kind] = out.clone()
        except Exception as e:  # a variant that cannot run here is said, the rest still run
            r = {"error": f"{type(e).__name__}: {e}"[:400]}
        row = {"rows": m, "variant": kind, **r}
        if kind in finals and "dot" in finals and kind not in ("cublas", "dot"):
            row["max_abs_diff_vs_dot"] = (finals[kind].float() - finals["dot"].float()).abs().max().item()
            if "dot_pdl" in finals and kind != "dot_pdl":
                row["max_abs_diff_vs_dot_pdl"] = (finals[kind].float() - finals["dot_pdl"].float()).abs().max().item()
        rows.append(row)
        progress(str(row))
    return rows


def best_tiles(weights: list[dict[str, torch.Tensor]], dev: torch.device) -> dict[str, Any]:
    """Each shape's fastest tile (32 layers' weights back to back, no PDL) and cuBLAS's time, in us."""
    out: dict[str, Any] = {}
    for name, n, k in SHAPES:
        x = torch.randn(k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(n, device=dev, dtype=torch.bfloat16)
        ws = [w[name] for w in weights]
        cub = graph_ms(lambda: [torch.matmul(x.view(1, k), w.t(), out=y.view(1, n)) for w in ws], 10)["ms"]
        rows = {}
        for tile in TILES:
            if n % tile[0] or k % tile[1]:
                continue
            try:
                rows[str(tile)] = graph_ms(lambda t=tile: [gemv(x, w, y, t, False) for w in ws], 10)["ms"]
            except Exception as e:  # a tile that does not compile here is skipped, said in the record
                rows[str(tile)] = f"{type(e).__name__}: {e}"[:200]
        timed = {t: v for t, v in rows.items() if isinstance(v, float)}
        best = min(timed, key=timed.__getitem__)
        ref = F.linear(x.view(1, k).float(), ws[0].float()).view(-1)
        gemv(x, ws[0], y, ast.literal_eval(best), False)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        out[name] = {"cublas_us": round(cub * 1000 / len(ws), 2), "best_tile": best,
                     "best_us": round(timed[best] * 1000 / len(ws), 2), "rel_err_vs_fp32": err,
                     "tiles_us": {t: (round(v * 1000 / len(ws), 2) if isinstance(v, float) else v)
                                  for t, v in rows.items()},
                     "MB": n * k * 2 / 1e6}
        progress(f"{name}: {out[name]}")
    return out


def batch1(weights: list[dict[str, torch.Tensor]], dev: torch.device, record: dict[str, Any],
           args: argparse.Namespace) -> None:
    """The batch-1 step: each shape's best GEMV tile, then the chain with cuBLAS / the GEMV / with PDL,
    with and without the small kernels between (into ``record``)."""
    record["per_shape"] = per = best_tiles(weights, dev)
    tiles = {name: ast.literal_eval(per[name]["best_tile"]) for name in per}
    bufs = {f"y_{name}": torch.empty(n, device=dev, dtype=torch.bfloat16) for name, n, _ in SHAPES}
    for elems in (4096, 14336):
        bufs[f"s{elems}"] = torch.empty(elems, device=dev, dtype=torch.bfloat16)
        bufs[f"t{elems}"] = torch.empty(elems, device=dev, dtype=torch.bfloat16)
    bufs["x"] = torch.randn(28672, device=dev, dtype=torch.bfloat16)
    bufs["out"] = torch.empty(4096, device=dev, dtype=torch.bfloat16)
    results: list[dict[str, Any]] = []
    finals: dict[tuple[str, bool], torch.Tensor] = {}
    for small in (True, False):
        for kind in ("cublas", "triton", "pdl"):
            if kind == "pdl" and not HAVE_GDC:
                continue
            try:
                fn = step_fn(weights, bufs, kind, tiles, small)
                r: dict[str, Any] = graph_ms(fn, args.reps)
                fn()
                torch.cuda.synchronize()
                finals[(kind, small)] = bufs["out"].clone()
            except Exception as e:  # a variant that cannot run here is said, the rest still run
                r = {"error": f"{type(e).__name__}: {e}"[:400]}
            row: dict[str, Any] = {"small_kernels": small, "variant": kind, **r}
            if "ms" in r:
                row["pct_of_weight_roofline"] = round(100 * record["roofline_ms"] / r["ms"], 1)
            if kind == "pdl" and ("triton", small) in finals and (kind, small) in finals:
                row["max_abs_diff_vs_triton"] = (finals[(kind, small)].float()
                                                 - finals[("triton", small)].float()).abs().max().item()
            results.append(row)
            progress(str(row))
            record["results"] = results
            write_record(record, args.out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pdl-gemv-probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dot-rows", default="16,64", help="row counts for the tensor-core candidate's sweep")
    ap.add_argument("--no-batch1", action="store_true", help="skip the batch-1 GEMV step (tiles, chains)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    record: dict[str, Any] = record_header()
    record["triton"] = triton.__version__
    record["have_gdc"] = HAVE_GDC
    bw = copy_bandwidth(dev, 1 << 30)
    record["copy_bandwidth_TBps"] = bw / 1e12
    weights = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for name, n, k in SHAPES}
               for _ in range(args.layers)]
    step_bytes = sum(n * k * 2 for _, n, k in SHAPES) * args.layers
    record["weight_bytes_per_step"] = step_bytes
    record["roofline_ms"] = step_bytes / bw * 1e3
    if not args.no_batch1:
        batch1(weights, dev, record, args)
    record["dot_sweep"] = {}
    record["chain_rows"] = []
    for m in [int(r) for r in args.dot_rows.split(",") if r]:
        record["dot_sweep"][str(m)] = sweep = dot_sweep(weights, m, dev)
        write_record(record, args.out)
        cfgs = {name: ast.literal_eval(sweep[name]["best"]) for name in sweep}
        record["chain_rows"] += chain_rows(weights, m, cfgs, args.reps, dev)
        write_record(record, args.out)


if __name__ == "__main__":
    main()
