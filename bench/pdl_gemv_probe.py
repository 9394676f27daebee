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

from fusedserve.models.layers.linear_triton import _gemv_kernel
from fusedserve.models.layers.pdl import HAVE_GDC, pdl_open

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, copy_bandwidth, cuda_graph, record_header, replay_ms, spread, write_record

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


def _pdl(on: bool) -> dict[str, bool]:
    return {"launch_pdl": True} if on else {}


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tile: tuple[int, int, int], pdl: bool) -> None:
    bn, bk, warps = tile
    _gemv_kernel[(w.shape[0] // bn,)](x, w, w, y, 1, w.shape[1], 0, w.stride(0), 0, M_PAD=1, BLOCK_N=bn,
                                      BLOCK_K=bk, HAS_BIAS=False, PDL=pdl, num_warps=warps, **_pdl(pdl))


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


def graph_ms(fn: Callable[[], None], reps: int) -> dict[str, float]:
    g = cuda_graph(fn, warmup=1)
    g.replay()
    torch.cuda.synchronize()
    s = spread(replay_ms(g, reps))
    del g
    return {"ms": round(s["median"], 4), "spread": round(s["spread"], 4)}


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pdl-gemv-probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
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
    # PDL equality under replay too: many replays of the PDL graph against the plain one
    write_record(record, args.out)


if __name__ == "__main__":
    main()
