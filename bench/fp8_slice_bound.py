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
H100; a plain Triton streaming sum at up to 1.076x on an H100, 2026-12-07-read-bandwidth-h100.json):
``ratio_bound_fast_streams`` is the same bound with the streams ``FAST_STREAMS`` (1.08) times as fast, or as fast
as the best read-only stream of a ``bench/read_bandwidth_probe.py`` record (``--read-bandwidth``).

``depth``: the same profiles cut by position instead of by name. The head is what does not grow with the
model's depth and is bf16 in both builds, as the release ships it: the kernels up to the embedding's, and
from the last RMSNorm (the final norm) on, i.e. the LM head and whatever follows it. The rest is the slice's
layers. ``layers_ratio`` is the FP8 / bf16 ratio of the layers alone; ``model_ratio`` the ratio of a model of
``MODEL_LAYERS`` (61, DeepSeek-V3's depth) such layers under the same head, critical-path times, idle gaps
left out. A slice that fits one GPU holds few layers, so its head weighs far more in it than in the model.

Records from before the profile kept its ``sequence`` hold only its ``top`` kernels (summed durations, the
first ``--profile-top`` names). ``--from-top`` reads those instead: each kernel's summed duration stands for its
critical-path time (an overestimate where launches overlap under PDL, and the kernels past the top list are
missing) and the head is the kernels launched once a step (the LM head, the embedding, the input copy; the
final norm falls among the layers' norms). Its figures are approximate and say so (``"from": "top"``); each
batch's ``summed_over_step`` (FP8 kernels' summed time over the measured step) above 1 means the launches
overlapped and the bound does not hold.
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


def bound(record: dict[str, Any], goal: float = GOAL, fast: float = FAST_STREAMS) -> dict[str, Any]:
    """Per profiled batch: the measured steps, the FP8 roofline, each build's time by group, the bound (and the
    bound with the streams ``fast`` times the copy bandwidth)."""
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
        lo_fast = f["roofline_ms"] / fast + groups["shared"] / 1000
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


MODEL_LAYERS = 61
HEAD_START = "_embedding_kernel"
HEAD_END = "_rms_norm_kernel"


def head_and_layers(sequence: list[list[Any]]) -> tuple[float, float] | None:
    """(head, layers) critical-path microseconds of one step's [name, duration, charged] kernels: the head is
    the kernels through the first ``HEAD_START`` and from the last ``HEAD_END`` on. None where either kernel is
    missing (renamed): no split, rather than a benchmark's summary lost to it."""
    names = [k[0] for k in sequence]
    starts = [i for i, n in enumerate(names) if HEAD_START in n]
    ends = [i for i, n in enumerate(names) if HEAD_END in n]
    if not starts or not ends or starts[0] >= ends[-1]:
        return None
    first, last = starts[0], ends[-1]
    head = sum(k[2] for k in sequence[:first + 1]) + sum(k[2] for k in sequence[last:])
    return head, sum(k[2] for k in sequence[first + 1:last])


def sequence_from_top(top: list[dict[str, Any]]) -> list[list[Any]]:
    """An approximate step of a profile's ``top`` list, in the shape ``head_and_layers`` reads: the kernels
    launched once a step first (the embedding among them) and last, the rest between, durations as charged."""
    once = [[k["name"], k["us_per_step"], k["us_per_step"]] for k in top if k["calls_per_step"] == 1]
    many = [[k["name"], k["us_per_step"], k["us_per_step"]] for k in top if k["calls_per_step"] != 1]
    return [[HEAD_START, 0.0, 0.0]] + many + [[HEAD_END, 0.0, 0.0]] + once


TOP_MARKERS = 2  # the two zero-time kernels ``sequence_from_top`` adds to mark the head


def with_sequences_from_top(record: dict[str, Any]) -> dict[str, Any]:
    """The record with each build's profiles given an approximate ``sequence`` from their ``top``."""
    out = dict(record)
    for build in ("fp8", "bf16"):
        profiles = record[build].get("profile", {})
        out[build] = {**record[build], "profile": {b: {**p, "sequence": sequence_from_top(p["top"])}
                                                   for b, p in profiles.items() if p.get("top")}}
    return out


def depth(record: dict[str, Any], layers: int, model_layers: int = MODEL_LAYERS) -> dict[str, Any]:
    """Per batch profiled in both builds: head and layers (us, critical path), the layers' ratio and that of a
    ``model_layers``-deep model with the same layers and head."""
    out: dict[str, Any] = {}
    for batch, prof in record["fp8"].get("profile", {}).items():
        f_seq = prof.get("sequence")
        b_seq = record["bf16"].get("profile", {}).get(batch, {}).get("sequence")
        f_split = head_and_layers(f_seq) if f_seq else None
        b_split = head_and_layers(b_seq) if b_seq else None
        if f_split is None or b_split is None:
            continue
        (fh, fl), (bh, bl) = f_split, b_split
        scale = model_layers / layers
        out[batch] = {
            "fp8_head_us": round(fh, 1), "fp8_layers_us": round(fl, 1),
            "bf16_head_us": round(bh, 1), "bf16_layers_us": round(bl, 1),
            "slice_ratio_charged": round((fh + fl) / (bh + bl), 4),
            "layers_ratio": round(fl / bl, 4),
            "model_layers": model_layers,
            "model_ratio": round((fh + scale * fl) / (bh + scale * bl), 4),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=None, help="the slice's layers where its record does not say")
    ap.add_argument("--from-top", action="store_true", help="records without a profile sequence: approximate, "
                    "from the profiles' top kernels")
    ap.add_argument("--runs", default=None, help="records holding several slice records under 'runs': this one")
    ap.add_argument("--read-bandwidth", default=None, help="a bench/read_bandwidth_probe.py record: its best "
                    f"read-only stream over the copy bandwidth replaces FAST_STREAMS ({FAST_STREAMS})")
    args = ap.parse_args()
    fast = FAST_STREAMS
    if args.read_bandwidth:
        with open(args.read_bandwidth) as f:
            fast = float(json.load(f)["best_read_over_copy"])
    result = {}
    for path in args.records:
        with open(path) as f:
            rec = json.load(f)
        if args.runs:
            rec = rec["runs"][args.runs]
        if args.from_top:
            rec = with_sequences_from_top(rec)
        layers = rec.get("model_shape", {}).get("num_hidden_layers") or args.layers
        batches = bound(rec, fast=fast)
        if args.from_top:
            for b in batches.values():
                b["fp8_kernels"] -= TOP_MARKERS
                b["summed_over_step"] = round(sum(b["fp8_charged_us"].values()) / 1000 / b["fp8_ms"], 3)
        result[path] = {"machine": rec.get("machine"), "layers": layers, "settings": rec.get("settings"),
                        "batches": batches, "depth": depth(rec, layers) if layers else None,
                        "from": "top" if args.from_top else "sequence", "fast_streams": fast}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
