"""The MoE router's logits at decode batches, cuBLAS against the one-launch Triton kernel (issue #19's slice), ONE GPU.

    python -P bench/router_logits_probe.py --out $OUT/router-logits.json [--sweep]

DeepSeek-V3's gate is [256, 7168] in fp32 (7.3 MB), applied to a layer's bf16 rows in fp32 as HF does. Per row
count (1 ... 16), ``COPIES`` copies of the gate (more bytes than L2 holds, as a step reads each layer's gate cold
after its attention's weights), captured back to back in one CUDA graph:

- ``reference``: ``router.router_logits`` (the rows made fp32, then cuBLAS's fp32 GEMM: two launches);
- ``triton``: ``router_triton.router_logits_triton`` at ``LOGITS_TILE`` (one launch; PDL where on), at every row
  count here whatever ``LOGITS_ROWS`` says (unless ``--set`` names it);
- ``--sweep``: the Triton kernel at each of ``CUTS`` (experts a program, K columns a step at one row, warps).

Each in µs per call, the gate's bytes over the copy bandwidth measured in the same run, and the largest
difference from the reference's logits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.common import Progress, apply_settings, copy_bandwidth, graph_ms, record_header, write_record  # noqa: E402

EXPERTS, HIDDEN = 256, 7168
ROWS = (1, 2, 4, 8, 16)
COPIES = 16
CUTS = tuple((e, k, w) for e in (1, 2, 4) for k in (1024, 2048, 4096) for w in (2, 4, 8) if e * k // (32 * w) <= 64)
progress = Progress("router_logits_probe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also the Triton kernel at each of CUTS")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    args = ap.parse_args()
    settings = apply_settings(args.set)
    if not torch.cuda.is_available():
        sys.exit("router_logits_probe: needs a CUDA GPU")
    from fusedserve.models.layers import router_triton
    from fusedserve.models.layers.router import router_logits

    if not any("LOGITS_ROWS" in item for item in args.set):  # the kernel itself, whatever the default
        router_triton.LOGITS_ROWS = max(ROWS)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev, 1 << 30)
    gen = torch.Generator(device=dev).manual_seed(0)
    gates = [torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen) * HIDDEN ** -0.5 for _ in range(COPIES)]
    nbytes = EXPERTS * HIDDEN * 4
    default_tile = router_triton.LOGITS_TILE
    rows: dict[str, Any] = {}
    for m in ROWS:
        x = torch.randn(m, HIDDEN, device=dev, generator=gen).bfloat16()
        want = router_logits(x, gates[0])

        def timed(fn: Any) -> dict[str, Any]:
            def calls() -> None:
                for i in range(COPIES):
                    fn(x, gates[i])

            r = graph_ms(calls, args.reps)
            us = r["ms"] * 1000 / COPIES
            return {"us": round(us, 2), "spread": r["spread"], "of_copy_bw": round(nbytes / (us * 1e-6) / bw, 3),
                    "max_abs_diff": float((fn(x, gates[0]) - want).abs().max())}

        row: dict[str, Any] = {"reference": timed(router_logits), "triton": timed(router_triton.router_logits_triton)}
        cuts = []
        for cut in CUTS if args.sweep else ():
            router_triton.LOGITS_TILE = cut
            try:
                cuts.append({"cut": list(cut), **timed(router_triton.router_logits_triton)})
            except Exception as e:  # a cut that does not compile: said in the record
                cuts.append({"cut": list(cut), "error": f"{type(e).__name__}: {e}"[:160]})
            finally:
                router_triton.LOGITS_TILE = default_tile
        if cuts:
            row["cuts"] = cuts
            row["best_cut"] = min((c for c in cuts if "us" in c), key=lambda c: c["us"], default=None)
        rows[str(m)] = row
        progress(f"{m} rows: reference {row['reference']['us']} us, triton {row['triton']['us']} us"
                 + (f", best cut {row['best_cut']['cut']} {row['best_cut']['us']} us" if cuts else ""))
    record = {**record_header(), "what": __doc__.splitlines()[0], "settings": settings, "copies": COPIES,
              "shape": [EXPERTS, HIDDEN], "tile": list(default_tile), "logits_rows": router_triton.LOGITS_ROWS, "copy_bandwidth_TBps": round(bw / 1e12, 3),
              "rows": rows}
    if args.out:
        write_record(record, args.out)
    progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
