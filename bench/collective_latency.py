"""What one small collective costs CPU ranks on one host: gloo over loopback, the shared-memory all-reduce the CPU
groups now sum with (``models/parallel/host_all_reduce.py``), and a bare socket round trip.

    python bench/collective_latency.py [--worlds 2,3] [--numel 576] [--iters 300] [--repeats 3] [--out FILE]

On CPU every tensor-parallel layer all-reduces its output (a decode step of SmolLM2 at tp=3: ~62 all-reduces of
one row of 576 floats), so the collective's latency, not its bytes, sets the step time of multi-rank CPU serving
and of the multi-rank CPU tests. Ranks are started by ``run_on_ranks`` as ``fusedserve verify`` starts them; each
op runs ``--iters`` times after 20 warm-up calls, and a world's figure is the median over ``--repeats`` runs of
the slowest rank's mean (µs per call). ``shm_all_reduce``: the same sum through ``HostAllReduce`` (what
``Collectives.all_reduce`` runs on a CPU group whose ranks share a host). ``socket_round_trip_us``: one byte
there and back between two processes over a socket pair (what the transport itself costs on this host).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.common import record_header, write_record

OPS = ("all_reduce", "shm_all_reduce", "broadcast", "barrier", "send_recv")


def _rank_main(rank: int, world: int, backend: str, numel: int, iters: int) -> dict[str, float]:
    from fusedserve.models.parallel.host_all_reduce import HostAllReduce

    x = torch.ones(1, numel)
    host = HostAllReduce.connect(rank, world, dist.group.WORLD, "bench")
    if host is None:
        raise RuntimeError("no shared-memory all-reduce on this host")

    def send_recv() -> None:  # rank 0 and rank 1 ping-pong; the others wait
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    ops = {"all_reduce": lambda: dist.all_reduce(x), "shm_all_reduce": lambda: host(x),
           "broadcast": lambda: dist.broadcast(x, 0), "barrier": dist.barrier, "send_recv": send_recv}
    out = {}
    for name in OPS:
        for _ in range(20):
            ops[name]()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            ops[name]()
        out[name] = (time.perf_counter() - t) / iters * 1e6
        dist.barrier()
    return out


def socket_round_trip_us(n: int = 2000) -> float:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            b.recv(1)
            b.send(b"x")
        os._exit(0)
    t = time.perf_counter()
    for _ in range(n):
        a.send(b"x")
        a.recv(1)
    elapsed = time.perf_counter() - t
    os.waitpid(pid, 0)
    return elapsed / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--numel", type=int, default=576)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-collective-latency-cpu.json")
    args = ap.parse_args()

    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    results: dict[str, Any] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        runs = [run_on_ranks(_rank_main, world, args.numel, args.iters, backend="gloo") for _ in range(args.repeats)]
        results[str(world)] = {op: {"median_us": round(statistics.median(max(r[op] for r in run) for run in runs), 1),
                                    "runs_us": [round(max(r[op] for r in run), 1) for run in runs]} for op in OPS}
        print(f"world {world}: " + ", ".join(f"{op} {v['median_us']:.0f} µs" for op, v in results[str(world)].items()))
    trips = [socket_round_trip_us() for _ in range(args.repeats)]
    print(f"socket round trip: {statistics.median(trips):.1f} µs")
    record = {**record_header(), "what": __doc__.split("\n\n")[0], "cpus": os.cpu_count(), "numel": args.numel,
              "iters": args.iters, "repeats": args.repeats, "by_world": results,
              "socket_round_trip_us": {"median": round(statistics.median(trips), 1),
                                       "runs": [round(t, 1) for t in trips]}}
    print(f"wrote {write_record(record, args.out)}")


if __name__ == "__main__":
    main()
