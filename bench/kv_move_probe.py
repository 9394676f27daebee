"""What a tree round's K/V move costs on the GPU (issue #15), ONE GPU, no model.

    python -P bench/kv_move_probe.py --out $OUT/kv-move.json [--slots 65536 1048576] [--reps 200]

A greedy tree round in flight (``SpecDecoder._follow_tree``) runs, between the verify's graph and the draft's,
``tree_verify_program.apply_moves`` (``KVCache.move``: one ``index_select`` and one ``index_copy_`` over every
layer's K and V) and queues the verdict's copy to the host (``host_copy.read_later``). On an H100 the GPU sat
~100 us idle between those two graphs in every tree round, against ~7 us in a chain round, which has no move
(bench/results/2026-12-07-tree-in-flight-smollm2-h100.json, the probes' timelines). This times each piece alone
on a cache of SmolLM2-135M's shape (30 layers, 3 KV heads of 64, bf16) at several sizes (``--slots``):

- ``torch`` (``KVCache.move``) and ``triton`` (``kv_move_triton.move_kv_triton``, the executor's ``move_kv`` on a
  GPU): a move of ``--depth`` slots eager (GPU time between events, and the host's time a call), captured alone in
  a CUDA graph, and the kernels it launches (``bench.common.profile``);
- ``read_later``: the verdict's copy to pinned memory and its event (host time a call).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.common import graph_ms, profile, record_header, write_record  # noqa: E402
from fusedserve.models.forward_batch import KVCache  # noqa: E402
from fusedserve.worker.executor.host_copy import read_later  # noqa: E402
from fusedserve.worker.executor.kv_move_triton import move_kv_triton  # noqa: E402
from fusedserve.worker.spec_decode.tree_verify_program import apply_moves  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def eager_us(fn: Any, reps: int) -> dict[str, float]:
    """Median GPU µs of one call between events, and the host's µs a call, over ``reps`` calls."""
    gpu: list[float] = []
    host: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1000)
    return {"gpu_us": round(statistics.median(gpu), 2), "host_us": round(statistics.median(host), 2)}


def measure(slots: int, depth: int, reps: int, dev: torch.device) -> dict[str, Any]:
    """One cache of ``slots`` slots: its move of ``depth`` slots and a verdict's read-back, timed."""
    cache = KVCache.allocate({i: (KV_HEADS, HEAD_DIM) for i in range(LAYERS)}, slots // BLOCK, BLOCK,
                             torch.bfloat16, dev)
    moves = torch.tensor([[40, 43, 45, 50, 55, 33, 34, 35, 36, 37]], device=dev)[:, :2 * depth]
    verdict = torch.zeros(49, dtype=torch.long, device=dev)
    row: dict[str, Any] = {"cache_gib": round(sum(g.numel() * g.element_size() for g in cache.grouped()) / 2**30, 2),
                           "group_elements": [g.numel() for g in cache.grouped()]}
    for name, move in (("torch", KVCache.move), ("triton", move_kv_triton)):
        call = functools.partial(apply_moves, cache, moves, move)
        row[name] = {"eager": eager_us(call, reps), "graph_us": round(graph_ms(call, reps)["ms"] * 1000, 2),
                     "kernels": profile(call, dev, reps=5, top=8)}
    row["read_later_eager"] = eager_us(lambda: read_later(verdict), reps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[65536, 1 << 20])
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    record: dict[str, Any] = {**record_header(), "what": __doc__.splitlines()[0], "sizes": {}}
    for slots in args.slots:
        row = measure(slots, args.depth, args.reps, dev)
        record["sizes"][str(slots)] = row
        print(slots, row["cache_gib"], {n: (row[n]["eager"], row[n]["graph_us"]) for n in ("torch", "triton")},
              row["read_later_eager"], flush=True)
        torch.cuda.empty_cache()
    if args.out:
        write_record(record, args.out)


if __name__ == "__main__":
    main()
