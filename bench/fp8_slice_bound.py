"""Issue #19: how low the FP8 / bf16 decode ratio of a ``bench/fp8_slice.py`` record could go, from its own numbers.

    python bench/fp8_slice_bound.py bench/results/<slice record>.json [--out bound.json]

No GPU: it reads a record that holds a kernel profile (``--profile-batches``; the profile's ``sequence``, the
middle step's kernels in launch order with their critical-path time). For each profiled batch the FP8 step's
kernels fall in three groups by name:

- weight streams: the GEMMs, GEMVs, fused-MoE experts and the LM head (``STREAM``). Their bytes are the
  record's roofline (the weights the step must read at the copy bandwidth measured in the same run);
- FP8 extras: the activation quantizations and cuBLAS's split-K reduce (``EXTRA``), work a better FP8
  path could drop;
- the rest: norms, embedding, MLA attention and its glue, the router's choice, the MoE's align and sum,
  torch's copies — the same launches in both builds, independent of the weights' format.

``bound_ms`` = the FP8 roofline + the critical-path time of the third group: the step if every weight
stream ran at the copy bandwidth, no FP8 extra were left and the format-independent kernels stayed as they
are (in-step idle gaps left out, so it is a lower bound). ``ratio_bound`` = that over the measured bf16
step. ``shared_cut_for_goal_us``: how much the format-independent kernels would have to lose in BOTH builds
(they run in the bf16 step too) for the bound to reach the goal: (bound - goal x bf16) / (1 - goal).
A read-only stream may beat the copy bandwidth a little (the slice's bf16 LM head ran at 100.5 % of it on an
H100): ``ratio_bound_fast_streams`` is the same bound with the streams ``FAST_STREAMS`` (1.08) times as fast.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

GOAL = 0.6
FAST_STREAMS = 1.08
STREAM = ("nvjet", "gemv", "_gemm_kernel", "_gate_up_kernel", "_down_kernel", "cutlass", "sgemm", "_w8a16_kernel",
          "gemm")
EXTRA = ("_group_quant_kernel", "splitKreduce")


def group(name: str) -> str:
    """'extra', 'stream' or 'shared' for a kernel's name."""
    if any(k in name for k in EXTRA):
        return "extra"
    if any(k in name for k in STREAM):
        return "stream"
    return "shared"


def charged_by_group(sequence: list[list[Any]]) -> dict[str, float]:
    """Critical-path microseconds per group of one step's [name, duration, charged] kernels."""
    out = {"stream": 0.0, "extra": 0.0, "shared": 0.0}
    for name, _, charged in sequence:
        out[group(name)] += charged
    return out


def bound(record: dict[str, Any], goal: float = GOAL) -> dict[str, Any]:
    """Per profiled batch: the measured steps, the FP8 roofline, each build's time by group, the bound."""
    fp8 = {r["batch"]: r for r in record["fp8"]["decode"]}
    bf16 = {r["batch"]: r for r in record["bf16"]["decode"]}
    out: dict[str, Any] = {}
    for batch, prof in record["fp8"].get("profile", {}).items():
        seq = prof.get("sequence")
        if not seq or int(batch) not in fp8 or int(batch) not in bf16:
            continue
        f, b = fp8[int(batch)], bf16[int(batch)]
        groups = charged_by_group(seq)
        bf16_seq = record["bf16"].get("profile", {}).get(batch, {}).get("sequence")
        lo = f["roofline_ms"] + groups["shared"] / 1000
        lo_fast = f["roofline_ms"] / FAST_STREAMS + groups["shared"] / 1000
        out[batch] = {
            "fp8_ms": round(f["ms_per_step"], 4), "bf16_ms": round(b["ms_per_step"], 4),
            "ratio": round(f["ms_per_step"] / b["ms_per_step"], 4),
            "fp8_roofline_ms": round(f["roofline_ms"], 4),
            "fp8_charged_us": {k: round(v, 1) for k, v in groups.items()},
            "bf16_charged_us": ({k: round(v, 1) for k, v in charged_by_group(bf16_seq).items()} if bf16_seq else None),
            "fp8_kernels": len(seq),
            "bound_ms": round(lo, 4), "ratio_bound": round(lo / b["ms_per_step"], 4),
            "ratio_bound_fast_streams": round(lo_fast / b["ms_per_step"], 4),
            "shared_cut_for_goal_us": round(max(0.0, (lo - goal * b["ms_per_step"]) / (1 - goal)) * 1000, 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {}
    for path in args.records:
        with open(path) as f:
            rec = json.load(f)
        result[path] = {"machine": rec.get("machine"), "layers": rec.get("model_shape", {}).get("num_hidden_layers"),
                        "settings": rec.get("settings"), "batches": bound(rec)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
