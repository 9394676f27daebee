"""Which part of the block-FP8 slice's decode differs between a CUDA-graph replay and the same kernels run
eagerly? (bench/results/2026-12-03-fp8-slice-diagnostics-h200.json: 0.28-0.91 relative L2 per token in FP8,
~0.015 in bf16.) Builds the slice (2 MoE layers) once and recaptures the batch-4 decode with each variant;
compares the replay with the eager forward as the engine runs it and with one whose block tables are padded
to the graph's width (so the decode attention is cut into the same splits: only capture itself differs).

    python -P bench/fp8_graph_bisect.py --out $OUT/fp8-graph-bisect.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers.fp8_block_triton import block_fp8_linear_triton
from fusedserve.worker.executor.step_shape import StepShape

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, record_header, write_record
from bench.deepseek_slice import DEEPSEEK_V3, decode_step, model_dir, tokens_of
from bench.fp8_slice import (
    CONTEXT,
    MAX_BLOCKS,
    RELEASE_QUANT,
    SEQ_BLOCKS,
    build,
    eager_forward,
    fp8_matmul,
    rel,
)

progress = Progress("fp8_graph_bisect")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8-graph-bisect.json")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kernels", default="triton", help="the kernel set of both builds (torch: the graph-safe references)")
    ap.add_argument("--quant", default="fp8,none")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = {**DEEPSEEK_V3, "num_hidden_layers": args.layers}
    record: dict[str, Any] = {**record_header(), "layers": args.layers, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(shape, Path(tmp))
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **RELEASE_QUANT, "weight_block_size": [128, 128]}}))
        for quant in args.quant.split(","):
            built = build(str(path), quant, dev, args.kernels, graphs=True, prefill=(512,))
            model, ex = built.model, built.executor
            check = decode_step(tokens_of(4, shape["vocab_size"], 99), CONTEXT + 1, SEQ_BLOCKS)
            variants = ["default"] + (["triton_gemms"] if quant == "fp8" and args.kernels == "triton" else [])
            # eagerly with the graph's block-table width: the decode attention then cuts the same splits
            padded = dataclasses.replace(check, seqs=tuple(dataclasses.replace(
                r, block_table=r.block_table + (r.block_table[-1],) * (MAX_BLOCKS - len(r.block_table)))
                for r in check.seqs))
            for v in variants:
                with fp8_matmul(model, block_fp8_linear_triton if v == "triton_gemms" else model.kernels.block_fp8_matmul):
                    ex.capture([StepShape(4, 1)], MAX_BLOCKS)
                    g = ex.run(check).logits.float()
                    g2 = ex.run(check).logits.float()
                    e = eager_forward(built, check).logits.float()
                    e2 = eager_forward(built, check).logits.float()
                    ep = eager_forward(built, padded).logits.float()
                row = {"graph_vs_eager": [round(rel(g[i], e[i]), 5) for i in range(4)],
                       "graph_vs_eager_at_graph_width": [round(rel(g[i], ep[i]), 5) for i in range(4)],
                       "graph_vs_graph": rel(g2, g), "eager_vs_eager": rel(e2, e),
                       "argmax_equal": float((g.argmax(-1) == e.argmax(-1)).float().mean())}
                record["variants"][f"{args.kernels}:{quant}:{v}"] = row
                progress(f"{quant}:{v}: {row}")
                write_record(record, args.out)
            del built, model, ex
            torch.cuda.empty_cache()
    write_record(record, args.out)


if __name__ == "__main__":
    main()
