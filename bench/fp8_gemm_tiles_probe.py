"""Which launch shape should the block-FP8 Triton GEMM take at decode rows? A sweep on DeepSeek-V3's dense shapes.

    python -P bench/fp8_gemm_tiles_probe.py --out $OUT/fp8-gemm-tiles.json   # the package laid out as bench/device_env.sh does
    python -P bench/fp8_gemm_tiles_probe.py --per-sm 1 2 4 --engine-only --out $OUT/fp8-gemm-per-sm.json
    python -P bench/fp8_gemm_tiles_probe.py --engine-only --w8a16 --out $OUT/fp8-gemm-w8a16.json
    python -P bench/fp8_gemm_tiles_probe.py --engine-only --gemv --rows 1 --out $OUT/fp8-gemv.json

``block_fp8_linear_triton`` (activation quantization + the GEMM, with its in-kernel split-K combine) as the
engine calls it, on DeepSeek-V3's attention and shared-expert projections (and q_a_proj with
kv_a_proj_with_mqa as one matrix, 2112 rows) at 1 .. 16 rows, each shape at the engine's launch shape
(``fp8_block_triton._tiles``) and at others: columns per tile, at most how many K splits,
pipeline stages, warps; ``--per-sm``: each also at K splits aiming at that many programs a multiprocessor
(``fp8_block_triton.SPLITS_PER_SM``). Each call reads another copy of the weight (copies enough for 256 MB), so the
timings are not L2's. Per shape and launch: us per call (median of graph replays), the weight's bytes
over it against the copy bandwidth of the same run, and whether the result equals the engine's launch's
(a split changes the fp32 sum's order: small differences are expected there). cuBLASLt's ``scaled_mm``
is timed beside where it takes the shape. ``--w8a16``: the weight-only decode kernel too
(``fp8_block_w8a16_triton``: bf16 activations, no quantization launch) at each of ``W8A16_LAUNCHES`` (columns a
program, programs a multiprocessor its K splits aim at, stages), keys ``w8a16/<block_n>/<per_sm>/<stages>``, its
``rel_diff`` against the dequantized reference (fp32), where the w8a8 launches' is against the engine's result.
``--gemv``: at one row the GEMV too (``fp8_block_gemv_triton``: no tensor cores, no quantization launch) at
each of ``GEMV_LAUNCHES`` (outputs a program, K columns a step, warps), keys ``gemv/<block_n>/<block_k>/<warps>``,
``rel_diff`` against the dequantized reference. The engine's own launch is ``engine`` still: the w8a8 GEMM (what
``block_fp8_linear_triton`` runs), whatever the fast set routes one row to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers import fp8_block_cublas
from fusedserve.models.layers import fp8_block_gemv_triton as gemv
from fusedserve.models.layers import fp8_block_triton as fp8
from fusedserve.models.layers import fp8_block_w8a16_triton as w8a16
from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_reference, quantize_weight

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import copy_bandwidth, graph_ms, record_header, write_record  # noqa: E402

SHAPES = {"q_a_proj": (1536, 7168), "q_a+kv_a": (2112, 7168), "kv_a_proj_with_mqa": (576, 7168),
          "q_b_proj": (24576, 1536), "o_proj": (7168, 16384), "shared.gate_up": (4096, 7168),
          "shared.down": (7168, 2048)}
# (BLOCK_N, at most splits, stages, warps); None = the engine's
LAUNCHES: list[tuple[int, int, int, int] | None] = [
    None, (64, 16, 4, 4), (64, 32, 4, 4), (64, 16, 6, 4), (32, 16, 4, 4), (32, 32, 6, 4), (128, 16, 4, 4),
    (128, 16, 4, 8), (64, 8, 6, 4)]
# the weight-only kernel's (BLOCK_N, PER_SM, STAGES)
W8A16_LAUNCHES = [(64, 2, 4), (64, 1, 4), (64, 4, 4), (32, 2, 4), (128, 2, 4), (64, 2, 6)]
# the GEMV's (BLOCK_N, BLOCK_K or None for the kernel's own, warps or None for the kernel's rule)
GEMV_LAUNCHES: list[tuple[int, int | None, int | None]] = [
    (8, None, None), (4, None, None), (16, None, None), (8, 512, None), (8, 2048, None), (8, None, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1], metavar="N",
                    help="K splits aiming at N programs a multiprocessor (fp8_block_triton.SPLITS_PER_SM), each launch "
                         "at each N (keys get @N<n>sm above 1)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--engine-only", action="store_true", help="only the engine's launch shape (and scaled_mm)")
    ap.add_argument("--w8a16", action="store_true", help="the weight-only decode kernel too, at W8A16_LAUNCHES")
    ap.add_argument("--gemv", action="store_true", help="at one row the GEMV too, at GEMV_LAUNCHES")
    args = ap.parse_args()
    args.per_sm = [1] + [n for n in args.per_sm if n != 1]  # the engine's own first: the others' rel_diff is against it
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    launches = [None] if args.engine_only else LAUNCHES
    dev = torch.device("cuda")
    fmt = BlockFP8(128, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth(dev, 4 << 30)
    record: dict[str, Any] = {**record_header(), "copy_bandwidth_TBps": bw / 1e12, "what": __doc__.split("\n\n")[0],
                              "launches": [list(x) if x else "engine" for x in launches], "per_sm": args.per_sm,
                              "shapes": {}}
    out = args.out or f"bench/results/{record['date']}-fp8-gemm-tiles-h200.json"
    engine_tiles, engine_per_sm = fp8._tiles, fp8.SPLITS_PER_SM
    for name, (n, k) in shapes.items():
        copies = max(2, -(-(256 << 20) // (n * k)))
        ws = [quantize_weight(torch.randn(n, k, device=dev, generator=g) * 0.02, fmt) for _ in range(copies)]
        ideal_us = 1e6 * (n * k + 4 * ws[0][1].numel()) / bw
        rows_out = {}
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            res = {}
            ref = None
            for per_sm in args.per_sm:
                fp8.SPLITS_PER_SM = per_sm
                for launch in launches:
                    if launch is None:
                        fp8._tiles = engine_tiles
                    else:
                        bn, cap, stages, warps = launch
                        fp8._tiles = lambda rows, n, k, bn=bn, st=stages, w=warps, c=cap: (16 if rows <= 16 else 64, bn,
                                                                                             w, st, c)
                    y = fp8.block_fp8_linear_triton(x, ws[0][0], ws[0][1], None, fmt)
                    ref = y if ref is None else ref
                    t = graph_ms(lambda: [fp8.block_fp8_linear_triton(x, w, s, None, fmt) for w, s in ws], 10)
                    us = 1000 * t["ms"] / copies
                    key = "engine" if launch is None else "/".join(map(str, launch))
                    res[key if per_sm == 1 else f"{key}@{per_sm}sm"] = {
                        "us": round(us, 2), "pct_of_ideal": round(100 * ideal_us / us, 1),
                        "rel_diff": float((y.float() - ref.float()).norm() / ref.float().norm())}
            fp8._tiles, fp8.SPLITS_PER_SM = engine_tiles, engine_per_sm
            if args.w8a16 and m <= 16:
                exact = block_fp8_linear_reference(x.float(), ws[0][0], ws[0][1], None, fmt)
                kept = w8a16.BLOCK_N, w8a16.PER_SM, w8a16.STAGES
                for bn, per_sm, stages in W8A16_LAUNCHES:
                    w8a16.BLOCK_N, w8a16.PER_SM, w8a16.STAGES = bn, per_sm, stages
                    y = w8a16.block_fp8_linear_w8a16_triton(x, ws[0][0], ws[0][1], None, fmt)
                    t = graph_ms(lambda: [w8a16.block_fp8_linear_w8a16_triton(x, w, s, None, fmt) for w, s in ws], 10)
                    us = 1000 * t["ms"] / copies
                    res[f"w8a16/{bn}/{per_sm}/{stages}"] = {
                        "us": round(us, 2), "pct_of_ideal": round(100 * ideal_us / us, 1),
                        "rel_diff": float((y.float() - exact).norm() / exact.norm())}
                w8a16.BLOCK_N, w8a16.PER_SM, w8a16.STAGES = kept
            if args.gemv and m == 1:
                exact = block_fp8_linear_reference(x.float(), ws[0][0], ws[0][1], None, fmt)
                for bn, bk, warps in GEMV_LAUNCHES:
                    if not gemv.supported(x, ws[0][0], ws[0][1], None, fmt, bn):
                        continue
                    y = gemv.block_fp8_gemv_triton(x, ws[0][0], ws[0][1], None, fmt, bn, bk, warps)
                    t = graph_ms(lambda bn=bn, bk=bk, warps=warps: [
                        gemv.block_fp8_gemv_triton(x, w, s, None, fmt, bn, bk, warps) for w, s in ws], 10)
                    us = 1000 * t["ms"] / copies
                    bk_ = bk or gemv.block_k(k)
                    res[f"gemv/{bn}/{bk_}/{warps or gemv.warps(bn, bk_)}"] = {
                        "us": round(us, 2), "pct_of_ideal": round(100 * ideal_us / us, 1),
                        "rel_diff": float((y.float() - exact).norm() / exact.norm())}
            if fp8_block_cublas.supported(fmt, n, k):
                t = graph_ms(lambda: [fp8_block_cublas.block_fp8_linear_cublas(x, w, s, None, fmt) for w, s in ws], 10)
                us = 1000 * t["ms"] / copies
                res["scaled_mm"] = {"us": round(us, 2), "pct_of_ideal": round(100 * ideal_us / us, 1)}
            best = min(res, key=lambda key: res[key]["us"])
            print(f"{name:>18} m={m:>2}: engine {res['engine']['us']:6.2f} us, best {best} {res[best]['us']:6.2f} us "
                  f"({res[best]['pct_of_ideal']} % of ideal {ideal_us:.2f})", flush=True)
            rows_out[str(m)] = {"ideal_us": round(ideal_us, 2), "best": best, "launches": res}
        record["shapes"][name] = {"n": n, "k": k, "rows": rows_out}
        write_record(record, out)
        ws.clear()
    print(json.dumps({s: {m: (r["best"], r["launches"][r["best"]]["us"], r["launches"]["engine"]["us"])
                          for m, r in v["rows"].items()} for s, v in record["shapes"].items()}))


if __name__ == "__main__":
    main()
