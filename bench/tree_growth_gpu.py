"""GPU time of one draft tree's growth (``device_tree.TreeGrowth``): the torch ops against the fused start and
steps (``tree_expand_triton``: each step's expand writes the next feed), with them the one-kernel top-k
(``topk_logprobs_triton``, target ids in its launch) and then the one-launch build (``tree_build_triton``), each
captured as one CUDA graph the way the drafter's tree chain runs it (the draft forwards left out: a fixed [rows, vocab] logits tensor stands in, so the figure is the growth's own cost).

    bash bench/gpu_real.sh growth [--steps 7 --topk 8 --nodes 64 --profile]   (the GPU machine: -> $OUT/tree-growth.json)
    python bench/tree_growth_gpu.py --out bench/results/tree-growth.json          (where fusedserve is installed)

Per configuration and batch: microseconds per round (feed, top-k, expand for steps 1 .. S - 1, then build),
the median of ``--reps`` timed replays of 20 rounds each, with their spread; ``--profile``: also each
round's kernels by GPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import cuda_graph, record_header, spread, timed, write_record  # noqa: E402


def main() -> None:
    from fusedserve.worker.spec_decode.device_tree import TreeGrowth
    from fusedserve.worker.spec_decode.drafter import top_k_kernel, top_k_torch, tree_kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)  # the SmolLM2 draft's vocabulary
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="also list each round's kernels (torch profiler)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    kernels = tree_kernels(dev)
    assert kernels is not None and kernels.build is not None, "needs Triton on CUDA"
    steps_only = kernels._replace(build=None)
    fast_top_k = top_k_kernel(dev, args.vocab)
    k, steps = args.topk, args.steps
    results: dict[str, Any] = {}
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b * k, args.vocab, device=dev)
        d2t = torch.arange(args.vocab, device=dev)
        hidden = torch.randn(b * k, args.hidden, device=dev, dtype=torch.bfloat16)
        first = torch.randn(b, args.vocab, device=dev).log_softmax(-1).topk(k, dim=-1)
        roots = torch.zeros(b, dtype=torch.long, device=dev)
        root_hidden = torch.randn(b, args.hidden, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {}
        variants = (("torch", None, top_k_torch), ("fused start + steps", steps_only, top_k_torch),
                    ("fused start + steps + top-k", steps_only, fast_top_k),
                    ("fused start + steps + top-k + build", kernels, fast_top_k))
        for name, fused, top_k in variants:
            def round_() -> torch.Tensor:
                growth = TreeGrowth(roots, d2t[first.indices], first.values, root_hidden, steps, fused)
                for _ in range(1, steps):
                    growth.feed()
                    top_lp, targets = top_k(logits, k, d2t)  # the indices through d2t (in the launch, fused)
                    growth.expand(targets, top_lp, hidden)
                return growth.build(args.nodes).mask

            graph = cuda_graph(round_)
            times = [1e6 * timed(graph.replay, 20, dev) / 20 for _ in range(args.reps)]
            row[name] = {"us_per_round": round(spread(times)["median"], 1),
                         "min_max_us": [round(min(times), 1), round(max(times), 1)]}
            if args.profile:  # the round's kernels by GPU time (5 replays)
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        graph.replay()
                    torch.cuda.synchronize()
                kernels = sorted(((e.self_device_time_total / 5, e.count / 5, e.key[:80]) for e in prof.key_averages()
                                  if e.self_device_time_total > 0), reverse=True)
                row[name]["kernels_per_round"] = round(sum(c for _, c, _ in kernels), 1)
                row[name]["top_kernels_us_count"] = [[round(t, 1), c, n] for t, c, n in kernels[:14]]
        for name, *_ in variants[1:]:
            row[f"{name} vs torch"] = round(row[name]["us_per_round"] / row["torch"]["us_per_round"], 3)
        results[f"batch{b}"] = row
        print(b, json.dumps(row), flush=True)
    record = {**record_header(),
              "what": f"one tree round's growth ({steps} steps, topK {k}, {args.nodes} nodes) as one CUDA graph: "
                      "torch ops vs the fused step (and the one-kernel top-k), each step's top-k over a stand-in "
                      f"[{k} x batch, {args.vocab}] logits tensor", "numbers": results}
    write_record(record, args.out)


if __name__ == "__main__":
    main()
