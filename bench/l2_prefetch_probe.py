"""Does pulling the next weight into L2 during a decode step's idle spans make its matmuls cheaper?

    python -P bench/l2_prefetch_probe.py --out $OUT/l2-prefetch-probe.json   # the package laid out as bench/device_env.sh does

A Llama-3-8B-shaped step without the model: 32 layers of cuBLAS matmuls (qkv 6144x4096, o 4096x4096,
gate_up 28672x4096, down 4096x14336; distinct weights per layer, 13.9 GB, so nothing stays in L2
between steps) with the engine's small kernels stood in by spin kernels of the measured lengths
(before qkv: the down projection's split-K reduce + add-RMSNorm ~4 us; attention: RoPE + decode +
combine ~8 us; before gate_up ~4 us; before down: SiLU-and-mul ~1.5 us; bench/results/2026-12-02-
decode-engine-device-plans-h200.json's batch-1 profile), captured as one CUDA graph. Variants: no
prefetch; after each matmul, the next matmul's weight (its first ``cap`` bytes) prefetched into L2
from a side stream (bulk or per-line prefetch), or from the main stream. Per variant: ms per step
(median of replays) at batch 1 / 16 / 64, and the same with no spans (matmuls back to back); and each
matmul's time with its weight in L2 against from memory (``hot_vs_cold``).

Found on an H200 (bench/results/2026-12-03-l2-prefetch-probe-h200.json): 16 MB of each next weight with an
evict-last policy took the emulated step from 4.48 to 4.31 ms at batch 1 (-4 %), but the same prefetch in
the engine (b1326bd, taken out again: 2026-12-03-decode-rows-l2-prefetch-h200.json) gained nothing, and
a decode GEMV whose weight sits in L2 is barely faster than from memory (o 10.1 vs 13.4 us, the others
equal): the engine's matmuls are not bound by HBM alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fusedserve.models  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, copy_bandwidth, graph_ms, record_header, write_record

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
SPANS_US = {"qkv": 4.0, "o": 8.0, "gate_up": 4.0, "down": 1.5}  # idle before each matmul
progress = Progress("l2_prefetch_probe")

# --- the prefetch kernels (SM90+): requests only, no data returned, nothing written ---------------------

SUB = 16384  # bytes one bulk prefetch asks for
LANES = 32  # prefetches issued by one program (one warp)
LINE = 128
LINES = 1024


@triton.jit
def _bulk_prefetch_kernel(base_ptr, nbytes, dummy_ptr, SUB: tl.constexpr, LANES: tl.constexpr,
                          EVICT_LAST: tl.constexpr):
    """One bulk L2 prefetch of SUB bytes per lane; EVICT_LAST: with an evict-last cache policy."""
    lane = tl.arange(0, LANES)
    off = (tl.program_id(0).to(tl.int64) * LANES + lane) * SUB
    size = tl.minimum(nbytes - off, SUB).to(tl.int32)
    addr = base_ptr + tl.where(size > 0, off, 0)
    if EVICT_LAST:
        r = tl.inline_asm_elementwise(
            asm="{\n .reg .pred p;\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
                " setp.gt.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;\n"
                " mov.u32 $0, 0;\n}",
            constraints="=r,l,r", args=[addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            asm="{\n .reg .pred p;\n setp.gt.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
                " mov.u32 $0, 0;\n}",
            constraints="=r,l,r", args=[addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + lane, r.to(tl.uint8), mask=lane < 0)  # never stores: keeps the asm's result used


@triton.jit
def _line_prefetch_kernel(base_ptr, nbytes, dummy_ptr, LINE: tl.constexpr, LINES: tl.constexpr):
    i = tl.arange(0, LINES)
    off = (tl.program_id(0).to(tl.int64) * LINES + i) * LINE
    addr = base_ptr + tl.where(off < nbytes, off, 0)
    r = tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n mov.u32 $0, 0;", constraints="=r,l",
                                  args=[addr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + i, r.to(tl.uint8), mask=i < 0)


def _bytes_of(weight: torch.Tensor, max_bytes: int) -> tuple[torch.Tensor, int]:
    if not weight.is_contiguous():
        raise ValueError("prefetch_l2: the weight must be contiguous")
    flat = weight.view(-1).view(torch.uint8)
    return flat, min(flat.numel(), max_bytes) // 16 * 16


def prefetch_l2(weight: torch.Tensor, max_bytes: int, sub: int = SUB, evict_last: bool = False) -> None:
    """Ask for the first ``max_bytes`` of ``weight`` (contiguous, on a SM90+ GPU) in L2, ``sub`` bytes
    per request."""
    flat, n = _bytes_of(weight, max_bytes)
    if n:
        _bulk_prefetch_kernel[(triton.cdiv(n, sub * LANES),)](flat, n, flat, SUB=sub, LANES=LANES,
                                                              EVICT_LAST=evict_last, num_warps=1)


def prefetch_l2_lines(weight: torch.Tensor, max_bytes: int) -> None:
    """``prefetch_l2`` by one prefetch instruction per 128-byte line (SM80+)."""
    flat, n = _bytes_of(weight, max_bytes)
    if n:
        _line_prefetch_kernel[(triton.cdiv(n, LINE * LINES),)](flat, n, flat, LINE=LINE,
                                                                LINES=LINES, num_warps=4)


def cycles_per_us(dev: torch.device) -> float:
    torch.cuda._sleep(1000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 2_000_000
    s.record()
    torch.cuda._sleep(n)
    e.record()
    e.synchronize()
    return n / (s.elapsed_time(e) * 1000)


def step_fn(weights: list[dict[str, torch.Tensor]], xs: dict[int, torch.Tensor], spans: dict[str, int],
            prefetch: Callable[[torch.Tensor], None] | None, side: torch.cuda.Stream | None) -> Callable[[], None]:
    order = [(layer, name) for layer in range(len(weights)) for name, _, _ in SHAPES]

    def run() -> None:
        main = torch.cuda.current_stream()
        for i, (layer, name) in enumerate(order):
            if spans[name]:
                torch.cuda._sleep(spans[name])
            w = weights[layer][name]
            F.linear(xs[w.shape[1]], w)
            if prefetch is not None and i + 1 < len(order):
                nxt = weights[order[i + 1][0]][order[i + 1][1]]
                if side is None:
                    prefetch(nxt)
                else:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch(nxt)
        if side is not None:
            main.wait_stream(side)
    return run


def hot_vs_cold(weights: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """us per matmul at batch 1: the same weight 32 times (in L2 after the first) vs 32 layers' weights
    (from memory), and from memory after a whole-weight prefetch and a 20 us wait (what a prefetch can
    give at best)."""
    out: dict[str, Any] = {}
    for name, n, k in SHAPES:
        x = torch.randn(1, k, device=weights[0][name].device, dtype=torch.bfloat16)
        ws = [w[name] for w in weights]
        hot = graph_ms(lambda: [F.linear(x, ws[0]) for _ in ws], 10)["ms"] * 1000 / len(ws)
        cold = graph_ms(lambda: [F.linear(x, w) for w in ws], 10)["ms"] * 1000 / len(ws)
        spin = int(20 * cycles_per_us(x.device))

        def pre() -> None:
            for w in ws:
                prefetch_l2(w, 48 << 20)
                torch.cuda._sleep(spin)
                F.linear(x, w)

        def wait_only() -> None:
            for w in ws:
                torch.cuda._sleep(spin)
                F.linear(x, w)
        gain = (graph_ms(wait_only, 10)["ms"] - graph_ms(pre, 10)["ms"]) * 1000 / len(ws)
        out[name] = {"hot_us": round(hot, 2), "cold_us": round(cold, 2),
                     "prefetched_whole_saves_us": round(gain, 2), "MB": n * k * 2 / 2**20}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="l2-prefetch-probe.json")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    record: dict[str, Any] = record_header()
    record["copy_bandwidth_TBps"] = copy_bandwidth(dev, 1 << 30) / 1e12
    cpu = cycles_per_us(dev)
    record["sleep_cycles_per_us"] = cpu
    weights = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for name, n, k in SHAPES}
               for _ in range(args.layers)]
    step_bytes = sum(n * k * 2 for _, n, k in SHAPES) * args.layers
    record["weight_bytes_per_step"] = step_bytes
    side = torch.cuda.Stream()
    variants: dict[str, tuple[Callable[[torch.Tensor], None] | None, torch.cuda.Stream | None]] = {
        "none": (None, None)}
    for cap in (8, 16, 32):
        variants[f"bulk_side_{cap}MB"] = (lambda w, c=cap: prefetch_l2(w, c << 20), side)
        variants[f"bulk4k_side_{cap}MB"] = (lambda w, c=cap: prefetch_l2(w, c << 20, sub=4096), side)
        variants[f"bulk_last_side_{cap}MB"] = (lambda w, c=cap: prefetch_l2(w, c << 20, evict_last=True), side)
    variants["lines_side_16MB"] = (lambda w: prefetch_l2_lines(w, 16 << 20), side)
    variants["bulk_main_16MB"] = (lambda w: prefetch_l2(w, 16 << 20), None)  # an extra launch on the main stream
    record["hot_vs_cold_us"] = hot_vs_cold(weights)
    progress(str(record["hot_vs_cold_us"]))
    results: list[dict[str, Any]] = []
    for m in [int(b) for b in args.batches.split(",")]:
        xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in {k for _, _, k in SHAPES}}
        for spans_on in (True, False):
            spans = {n: int(SPANS_US[n] * cpu) if spans_on else 0 for n in SPANS_US}
            for name, (pf, stream) in variants.items():
                try:
                    r = graph_ms(step_fn(weights, xs, spans, pf, stream), args.reps)
                except Exception as e:  # a variant that cannot run here is said, the rest still run
                    r = {"error": f"{type(e).__name__}: {e}"[:400]}
                row = {"batch": m, "spans": spans_on, "variant": name, **r}
                if "ms" in r:
                    row["weights_TBps"] = round(step_bytes / (r["ms"] / 1e3) / 1e12, 3)
                results.append(row)
                progress(str(row))
        record["results"] = results
        write_record(record, args.out)
    write_record(record, args.out)


if __name__ == "__main__":
    main()
