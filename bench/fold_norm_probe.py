"""Probe (issue #14): what folding a boundary's residual add + RMSNorm into the matmuls around it costs and
saves, kernel by kernel, on the 8B shapes (ONE GPU; no engine).

    python -P bench/fold_norm_probe.py --out $OUT/fold-norm-probe.json

A boundary pair as the decode step runs it, 32 times over distinct weights (as 32 layers), captured as one
CUDA graph, median of 20 replays, at 16 and 64 rows:
- separate: o_proj (``decode_linear``), ``add_rms_norm_triton``, gate/up + SiLU (``decode_gate_up_silu``);
- folded: ``decode_matmul_add_norm`` (o_proj adding the residual, a ``RowScaled``), gate/up + SiLU scaling by
  its row factors;
- producer only: the folded o_proj, then gate/up + SiLU on the plain ``scaled`` rows (timing only);
- consumer only: the plain o_proj, then gate/up + SiLU on a ``RowScaled`` whose sums were made before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers.linear_triton import decode_gate_up_silu, decode_linear, decode_matmul_add_norm
from fusedserve.models.layers.rms_norm_triton import add_rms_norm_triton
from fusedserve.models.layers.row_scaled import RowScaled

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import record_header  # noqa: E402

LAYERS, HIDDEN, INTER = 32, 4096, 14336


def graphed_us(fn: Any) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAYERS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w_o = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf, generator=g) * 0.02 for _ in range(LAYERS)]
    w_gu = [torch.randn(2 * INTER, HIDDEN, device=dev, dtype=bf, generator=g) * 0.02 for _ in range(LAYERS)]
    gamma = torch.rand(HIDDEN, device=dev, dtype=bf, generator=g) + 0.5
    out: dict[str, Any] = {**record_header(), "layers": LAYERS, "rows": {}}
    for m in (16, 64):
        x = torch.randn(m, HIDDEN, device=dev, dtype=bf, generator=g)
        res = torch.randn(m, HIDDEN, device=dev, dtype=bf, generator=g)
        made, _ = decode_matmul_add_norm(x, w_o[0], None, res, gamma, 1e-5)
        assert isinstance(made, RowScaled)

        def separate() -> None:
            for i in range(LAYERS):
                h, _ = add_rms_norm_triton(decode_linear(x, w_o[i]), res, gamma, 1e-5)
                decode_gate_up_silu(h, w_gu[i])

        def folded() -> None:
            for i in range(LAYERS):
                h, _ = decode_matmul_add_norm(x, w_o[i], None, res, gamma, 1e-5)
                decode_gate_up_silu(h, w_gu[i])

        def producer_only() -> None:
            for i in range(LAYERS):
                h, _ = decode_matmul_add_norm(x, w_o[i], None, res, gamma, 1e-5)
                decode_gate_up_silu(h.scaled if isinstance(h, RowScaled) else h, w_gu[i])

        def consumer_only() -> None:
            for i in range(LAYERS):
                decode_linear(x, w_o[i])
                decode_gate_up_silu(made, w_gu[i])

        def plain_pair() -> None:
            for i in range(LAYERS):
                decode_linear(x, w_o[i])
                decode_gate_up_silu(x, w_gu[i])

        row = {name: graphed_us(fn) for name, fn in (("separate", separate), ("folded", folded),
                                                     ("producer_only", producer_only),
                                                     ("consumer_only", consumer_only), ("matmuls_only", plain_pair))}
        out["rows"][str(m)] = row
        print(f"{m} rows, us per boundary pair: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
