"""How fast a kernel that only reads can stream memory, against the copy bandwidth (issue #19's bound), ONE GPU.

    python -P bench/read_bandwidth_probe.py --out $OUT/read-bandwidth.json

``bench/fp8_slice_bound.py`` puts the FP8 step's floor at every weight stream running at the copy bandwidth
measured in the same run (a device-to-device copy, read + write bytes), and a second floor with the streams
``FAST_STREAMS`` times as fast, because a kernel that only reads may beat a copy (no write turnaround). This
measures that factor instead of assuming it: over one buffer far larger than L2 (``--gib``),

- ``copy``: ``bench.common.copy_bandwidth`` (read + write bytes over the time);
- ``torch_sum`` / ``torch_amax``: torch's own reductions of the buffer as bf16;
- ``triton/<block>/<steps>/<warps>``: a plain streaming sum, each program reading ``block`` x ``steps``
  contiguous bf16 values in ``steps`` loads of ``block`` and writing one partial (the best cut is what a
  read-only stream reaches here);
- ``lm_head``: DeepSeek-V3's bf16 LM head at one row through ``torch.nn.functional.linear`` (cuBLAS), the
  slice's largest stream.

Each as bytes read over the median time of ``--reps`` CUDA-graph replays, and as a multiple of the copy
bandwidth. The record's ``best_read_over_copy`` is the bound's measured ``FAST_STREAMS``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.common import Progress, copy_bandwidth, graph_ms, record_header, write_record  # noqa: E402

CUTS = tuple((block, steps, warps) for block in (2048, 4096, 8192) for steps in (1, 4, 16) for warps in (4, 8, 16)
             if block // (32 * warps) >= 8)
HEAD = (129280, 7168)  # DeepSeek-V3's vocabulary x hidden
progress = Progress("read_bandwidth_probe")


def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def stream_sum(x_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        base = pid * BLOCK * STEPS
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(STEPS):
            acc += tl.load(x_ptr + base + s * BLOCK + offs).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return stream_sum


def timed_us(fn: Any, reps: int) -> float:
    """Median µs of one call of fn, captured alone in a CUDA graph (``bench.common.graph_ms``)."""
    return graph_ms(fn, reps)["ms"] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    n = int(args.gib * (1 << 30)) // 2
    n -= n % (8192 * 16)
    nbytes = n * 2
    copy = copy_bandwidth(dev, nbytes)
    progress(f"copy {copy / 1e12:.3f} TB/s over {nbytes / 2**30:.2f} GiB")
    rows: dict[str, dict[str, float]] = {}

    def note(name: str, us: float, read: int) -> None:
        bw = read / (us * 1e-6)
        rows[name] = {"us": round(us, 2), "TBps": round(bw / 1e12, 4), "over_copy": round(bw / copy, 4)}
        progress(f"{name}: {us:.1f} µs, {bw / 1e12:.3f} TB/s, {bw / copy:.3f} x copy")

    def buffer_reads(x: torch.Tensor) -> None:
        note("torch_sum", timed_us(lambda: x.sum(dtype=torch.float32), args.reps), nbytes)
        note("torch_amax", timed_us(lambda: x.amax(), args.reps), nbytes)
        kernel = _kernel()
        for block, steps, warps in CUTS:
            programs = n // (block * steps)
            out = torch.empty(programs, device=dev, dtype=torch.float32)
            fn = (lambda o=out, b=block, s=steps, w=warps, g=programs:  # noqa: E731
                  kernel[(g,)](x, o, BLOCK=b, STEPS=s, num_warps=w))
            note(f"triton/{block}/{steps}/{warps}", timed_us(fn, args.reps), nbytes)

    buffer_reads(torch.randn(n, device=dev, dtype=torch.bfloat16))
    torch.cuda.empty_cache()
    w = torch.randn(*HEAD, device=dev, dtype=torch.bfloat16)
    row = torch.randn(1, HEAD[1], device=dev, dtype=torch.bfloat16)
    note("lm_head", timed_us(lambda: torch.nn.functional.linear(row, w), args.reps), w.numel() * 2)
    best = max(rows.items(), key=lambda kv: kv[1]["over_copy"])
    record = {**record_header(sys.argv), "buffer_bytes": nbytes,
              "copy_bandwidth_TBps": round(copy / 1e12, 4), "reads": rows,
              "best_read": best[0], "best_read_over_copy": best[1]["over_copy"]}
    progress(f"best read-only: {best[0]} at {best[1]['over_copy']:.3f} x copy")
    if args.out:
        write_record(record, args.out)


if __name__ == "__main__":
    main()
