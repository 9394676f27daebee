"""Benchmark (a): one communicator boundary at decode sizes on 2 GPUs, under CUDA graphs.

    python bench/comm_fusion.py [--hidden 7168 4096] [--out bench/results/<date>-comm-fusion-h200x2.json]

Per token count, median µs per call of:
  raw_flashinfer   FlashInfer allreduce_fusion(kARResidualRMSNorm) with preallocated outputs
  fused            our Collectives.fused_allreduce_add_rmsnorm (FlashInfer path, what a fused boundary runs)
  unfused          our unfused boundary: NCCL all-reduce, then add + RMSNorm (torch ops)
  nccl_allreduce   NCCL all-reduce alone
Each is captured 16 times in one CUDA graph and replayed; bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import cuda_graph, replay_ms  # noqa: E402

TOKENS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048]
CALLS_PER_GRAPH = 16


def _time_graph(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    g = cuda_graph(fn, CALLS_PER_GRAPH, warmup=3)
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(replay_ms(g, reps)) * 1000 / CALLS_PER_GRAPH


def _rank(rank: int, world: int, backend: str, hiddens: list[int]) -> dict:  # type: ignore[type-arg]
    import torch.distributed as dist
    from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.flashinfer import FlashInferFusedAllReduceNorm
    from fusedserve.models.parallel.fusion.reference import add_rms_norm
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups

    groups = build_groups(ParallelConfig(world), rank, backend)
    out: dict = {}  # type: ignore[type-arg]
    for hidden in hiddens:
        fused = FlashInferFusedAllReduceNorm.create(groups, hidden, torch.bfloat16, max_tokens=max(TOKENS))
        assert isinstance(fused, FlashInferFusedAllReduceNorm), "FlashInfer path unavailable"
        coll = Collectives("nccl", fused=fused)
        ws = fused._workspaces["tp"]
        rows = []
        for n in TOKENS:
            g = torch.Generator(device="cuda").manual_seed(rank)
            x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
            res = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
            no, ro = torch.empty_like(x), torch.empty_like(res)
            ar_buf = x.clone()

            def raw() -> None:
                allreduce_fusion(input=x, workspace=ws, pattern=AllReduceFusionPattern.kARResidualRMSNorm,
                                 launch_with_pdl=True, residual_out=ro, norm_out=no, residual_in=res,
                                 rms_gamma=w, rms_eps=1e-6)

            def ours_fused() -> None:
                coll.fused_allreduce_add_rmsnorm(x, res, w, 1e-6, groups.tp, "bench")

            def ours_unfused() -> None:
                h = coll.all_reduce(ar_buf, groups.tp, "bench")
                add_rms_norm(h, res, w, 1e-6)

            def nccl() -> None:
                dist.all_reduce(ar_buf, group=groups.tp.device_group)

            row = {"tokens": n}
            for name, fn in (("raw_flashinfer", raw), ("fused", ours_fused), ("unfused", ours_unfused),
                             ("nccl_allreduce", nccl)):
                dist.barrier(group=groups.tp.cpu_group)
                row[name + "_us"] = round(_time_graph(fn), 2)
            # correctness of the fused path against the reference at this size
            ref_in = x.clone()
            dist.all_reduce(ref_in, group=groups.tp.device_group)
            ref_norm, ref_res = add_rms_norm(ref_in.float(), res.float(), w.float(), 1e-6)
            got_norm, got_res = fused(x, res, w, 1e-6, groups.tp)
            row["max_abs_err_norm"] = float((got_norm.float() - ref_norm).abs().max())
            rows.append(row)
            if rank == 0:
                print(f"hidden {hidden} tokens {n}: {row}", file=sys.stderr, flush=True)
        out[str(hidden)] = rows
    return out


def main() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-comm-fusion-h200x2.json")
    args = ap.parse_args()
    res = run_on_ranks(_rank, 2, args.hidden, backend="nccl", timeout_s=600)
    summary = {}
    for hidden, rows in res[0].items():
        summary[hidden] = [{"tokens": r["tokens"], "fused_vs_raw": round(r["fused_us"] / r["raw_flashinfer_us"], 3),
                            "unfused_vs_fused": round(r["unfused_us"] / r["fused_us"], 2)} for r in rows]
    record = {"date": str(datetime.date.today()), "machine": torch.cuda.get_device_name() + " x2",
              "command": " ".join(["python", *sys.argv]), "dtype": "bfloat16", "calls_per_graph": CALLS_PER_GRAPH,
              "numbers": res[0], "ratios": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
