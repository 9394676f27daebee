"""An EAGLE3 draft's LM head at one row, bf16 against block FP8 (issue #15: the draft's chain step), ONE GPU.

    python -P bench/draft_head_probe.py --out $OUT/draft-head-probe.json   (a GPU with FP8: compute capability 8.9+)

A chain step ends with the draft's LM head over its vocabulary and the greedy choice through the draft-to-target
table (``argmax_to``). Per shape (SmolLM2's draft [16 384, 576]; a Llama-3-8B draft's [32 000, 4 096]), ``COPIES``
copies of the head's weights (more bytes than L2 holds, as a step reads its head cold after the layer's weights),
captured back to back in one CUDA graph and launched as the engine launches them (PDL where on):

- ``bf16``: the fast set's matmul at one row (``linear_triton.decode_linear``: the GEMV) then ``argmax_to_triton``;
- ``fp8``: the head quantized to ``--block`` (default 8 x 64; ``eagle3.Eagle3Draft.quantize_head``) through the fast
  set's ``block_fp8_matmul`` (one row: ``fp8_block_gemv_triton``), then the same choice.

Each in µs per head (alone, and with the choice after it), its bytes over the copy bandwidth measured in the same
run, the logits' relative error against the fp32 product with the checkpoint's weights, and how often the choice
agrees with that product's. The graph probe (``bench/graph_launch_probe.py``) and the engine A/B
(``--set models.layers.fp8_block_gemv_triton.DRAFT_HEAD_BLOCK="(8, 64)"``) decide whether the round gains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.common import Progress, apply_settings, copy_bandwidth, graph_ms, record_header, write_record  # noqa: E402

SHAPES = (("smollm2_draft", 16384, 576), ("llama3_8b_draft", 32000, 4096))
COPIES = 16
# --sweep: the FP8 GEMV's launch at each (block rows of the format, rows a program, K columns a step, warps); the
# format's block columns stay --block's.
CUTS = tuple((f, bn, bk, w) for f, bn in ((8, 8), (16, 16), (32, 32), (16, 8), (32, 8)) for bk in (1024, 256, 128)
             for w in (1, 2, 4, 8) if bn * bk // 1024 <= w * 2 and bn * bk // 128 >= w)
progress = Progress("draft_head_probe")


def probe(name: str, n: int, k: int, block: tuple[int, int], reps: int, bw: float, sweep: bool = False
          ) -> dict[str, Any]:
    from fusedserve.models.layers.argmax_triton import argmax_to_triton
    from fusedserve.models.layers.fp8_block import BlockFP8, quantize_weight
    from fusedserve.models.layers.fp8_block_gemm import block_fp8_linear_fast
    from fusedserve.models.layers.fp8_block_gemv_triton import block_fp8_gemv_triton
    from fusedserve.models.layers.linear_triton import decode_linear

    dev = torch.device("cuda")
    fmt = BlockFP8(*block)
    gen = torch.Generator(device=dev).manual_seed(n + k)
    ws = [(torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).bfloat16() for _ in range(COPIES)]
    qs = [quantize_weight(w, fmt) for w in ws]
    table = torch.randperm(n, device=dev, generator=gen) + 7
    x = torch.randn(8, k, device=dev, generator=gen).bfloat16()
    heads = {"bf16": lambda i, row: decode_linear(row, ws[i]),
             "fp8": lambda i, row: block_fp8_linear_fast(row, qs[i][0], qs[i][1], None, fmt)}
    nbytes = {"bf16": n * k * 2, "fp8": n * k + qs[0][1].numel() * 4}
    out: dict[str, Any] = {"shape": [n, k], "block": list(block)}
    for kind, head in heads.items():
        errs, agree = [], 0
        for r in range(x.shape[0]):  # 8 rows, one at a time, against the checkpoint's weights in fp32
            want = F.linear(x[r:r + 1].float(), ws[0].float())
            got = head(0, x[r:r + 1]).float()
            errs.append(float((got - want).norm() / want.norm()))
            agree += int(got.argmax(-1) == want.argmax(-1))
        row = x[:1]

        def alone(head: Any = head) -> None:
            for i in range(COPIES):
                head(i, row)

        def chosen(head: Any = head) -> None:
            for i in range(COPIES):
                argmax_to_triton(head(i, row), table)

        a, c = graph_ms(alone, reps), graph_ms(chosen, reps)
        us = a["ms"] * 1000 / COPIES
        out[kind] = {"us": round(us, 2), "spread": a["spread"], "with_choice_us": round(c["ms"] * 1000 / COPIES, 2),
                     "with_choice_spread": c["spread"], "MB": round(nbytes[kind] / 1e6, 2),
                     "of_copy_bw": round(nbytes[kind] / (us * 1e-6) / bw, 3),
                     "rel_err_max": round(max(errs), 5), "argmax_agrees": f"{agree}/{x.shape[0]}"}
    out["fp8_saves_us"] = round(out["bf16"]["with_choice_us"] - out["fp8"]["with_choice_us"], 2)
    cuts = []
    for bn_fmt, block_n, block_k, warps in CUTS if sweep else ():
        cut_fmt = BlockFP8(bn_fmt, block[1])
        cq = [quantize_weight(w, cut_fmt) for w in ws]

        def one(i: int, row: torch.Tensor, c: Any = (cut_fmt, block_n, block_k, warps), cq: Any = cq) -> Any:
            return block_fp8_gemv_triton(row, cq[i][0], cq[i][1], None, c[0], c[1], c[2], c[3])

        def calls(one: Any = one) -> None:
            for i in range(COPIES):
                one(i, x[:1])

        try:
            r = graph_ms(calls, reps)
            cuts.append({"cut": [bn_fmt, block[1], block_n, block_k, warps], "us": round(r["ms"] * 1000 / COPIES, 2),
                         "spread": r["spread"]})
        except Exception as e:  # a cut that does not compile: said in the record
            cuts.append({"cut": [bn_fmt, block[1], block_n, block_k, warps], "error": f"{type(e).__name__}: {e}"[:160]})
    if cuts:
        out["fp8_cuts"] = cuts
        out["fp8_best_cut"] = min((c for c in cuts if "us" in c), key=lambda c: c["us"], default=None)
        progress(f"{name}: best fp8 cut {out['fp8_best_cut']}")
    progress(f"{name}: bf16 {out['bf16']['us']} us ({out['bf16']['with_choice_us']} with the choice), fp8 "
             f"{out['fp8']['us']} ({out['fp8']['with_choice_us']}); errors {out['bf16']['rel_err_max']} / "
             f"{out['fp8']['rel_err_max']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--block", type=int, nargs=2, default=[8, 64], metavar=("ROWS", "COLS"))
    ap.add_argument("--sweep", action="store_true", help="also the FP8 GEMV at each of CUTS")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    args = ap.parse_args()
    settings = apply_settings(args.set)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("draft_head_probe: needs a CUDA GPU with FP8 (compute capability >= 8.9)")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev, 1 << 30)
    record = {**record_header(), "what": __doc__.splitlines()[0], "settings": settings, "copies": COPIES,
              "copy_bandwidth_TBps": round(bw / 1e12, 3),
              "shapes": {name: probe(name, n, k, tuple(args.block), args.reps, bw, args.sweep and name == SHAPES[0][0])
                         for name, n, k in SHAPES}}
    if args.out:
        write_record(record, args.out)
    progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
