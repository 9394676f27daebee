"""Which launch shape should the block-FP8 fused MoE take at decode batches? A sweep on DeepSeek-V3's experts.

    python -P bench/moe_fp8_tiles_probe.py --out $OUT/moe-fp8-tiles.json   # the package laid out as bench/device_env.sh does

256 experts of hidden 7168 / intermediate 2048 in e4m3 with 128 x 128 block scales (11.3 GB, as one
DeepSeek-V3 layer), top-8 routing at 1 .. 16 tokens, ``fused_experts_fp8_triton`` as the engine calls it
(grouping, quantizations, both kernels, the slot sum). Each call routes the tokens anew (10 routings in one
CUDA graph, replayed), so no expert stays in L2 from one call to the next. Per launch shape
(``fused_moe_fp8_triton.Tiles``): us per call (median of replays), the experts' bytes it must read over it
against the copy bandwidth of the same run; the gate/up kernel's shapes swept with the down kernel's at
the default, then the down kernel's. Results must equal the default shape's (the tiles change no sum).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers import fused_moe_fp8_triton as moe
from fusedserve.models.layers.fp8_block import FP8_DTYPE, BlockFP8

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import copy_bandwidth, graph_ms, record_header, write_record  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 256, 7168, 2048, 8
UP = [dict(up_n=n, up_warps=w, up_stages=s) for n, w, s in
      [(32, 4, 3), (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4)]]
DOWN = [dict(down_n=n, down_warps=w, down_stages=s) for n, w, s in
        [(32, 4, 3), (32, 4, 4), (64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 8, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4)]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    dev = torch.device("cuda")
    fmt = BlockFP8(128, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g, dtype=torch.bfloat16).to(FP8_DTYPE)
    down = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g, dtype=torch.bfloat16).to(FP8_DTYPE)
    gate_up_s = torch.rand(EXPERTS, 2 * INTER // 128, HIDDEN // 128, device=dev, generator=g) * 1e-3
    down_s = torch.rand(EXPERTS, HIDDEN // 128, INTER // 128, device=dev, generator=g) * 1e-3
    expert_bytes = (gate_up[0].numel() + down[0].numel()) + 4 * (gate_up_s[0].numel() + down_s[0].numel())
    bw = copy_bandwidth(dev, 4 << 30)
    record: dict[str, Any] = {**record_header(), "copy_bandwidth_TBps": bw / 1e12, "default": dataclasses.asdict(moe.Tiles()),
                              "what": __doc__.split("\n\n")[0], "tokens": {}}
    out = args.out or f"bench/results/{record['date']}-moe-fp8-tiles-h200.json"
    for n in args.tokens:
        calls = []
        for c in range(10):
            ids = torch.stack([torch.randperm(EXPERTS, device=dev, generator=g)[:TOP_K] for _ in range(n)])
            calls.append((torch.randn(n, HIDDEN, device=dev, generator=g, dtype=torch.bfloat16), ids,
                          torch.rand(n, TOP_K, device=dev, generator=g)))
        distinct = sum(int(torch.unique(ids).numel()) for _, ids, _ in calls) / len(calls)
        ideal_us = 1e6 * distinct * expert_bytes / bw

        def run(tiles: moe.Tiles) -> tuple[float, list[torch.Tensor]]:
            moe.TILES = tiles
            outs = [moe.fused_experts_fp8_triton(x, i, w, gate_up, gate_up_s, down, down_s, fmt) for x, i, w in calls]
            torch.cuda.synchronize()
            t = graph_ms(lambda: [moe.fused_experts_fp8_triton(x, i, w, gate_up, gate_up_s, down, down_s, fmt)
                                  for x, i, w in calls], 10)
            return 1000 * t["ms"] / len(calls), outs

        base_us, base = run(moe.Tiles())
        rows = []
        for change in UP + DOWN:
            tiles = dataclasses.replace(moe.Tiles(), **change)
            us, outs = run(tiles)
            same = all(torch.equal(a, b) for a, b in zip(outs, base))
            rows.append({**change, "us": round(us, 2), "pct_of_ideal": round(100 * ideal_us / us, 1), "equal": same})
            print(f"tokens {n:>2} {change}: {us:7.2f} us ({100 * ideal_us / us:5.1f} %){'' if same else ' DIFFERS'}",
                  flush=True)
        record["tokens"][str(n)] = {"distinct_experts": distinct, "ideal_us": round(ideal_us, 2),
                                    "default_us": round(base_us, 2), "rows": rows}
        write_record(record, out)
    print(json.dumps({n: {"default": r["default_us"], "best": min(r["rows"], key=lambda x: x["us"])}
                      for n, r in record["tokens"].items()}, indent=1))


if __name__ == "__main__":
    main()
