"""What every benchmark shares: progress lines, device timing, the copy-bandwidth ceiling, a kernel
profile by kind, the JSON record, and how a script finds ``bench.*`` without hiding the package.

A benchmark script starts with::

    import fusedserve.worker  # noqa: F401  (the installed package, imported before the checkout joins sys.path)
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from bench.common import Progress, record_header, write_record

(the checkout's root holds a folder ``fusedserve/`` with only the CLI: put first on ``sys.path`` it
would hide the laid-out package, so it is only ever appended, after the package is imported).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


class Progress:
    """Timestamped progress lines on stderr (the JSON record goes to a file)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Seconds for ``reps`` calls of fn back to back (device time on CUDA, host time otherwise)."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def wall(fn: Callable[[], Any], device: torch.device) -> float:
    """Host seconds of one call, the device drained before and after (what a user waits)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write (median of ``reps``)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timed(lambda: dst.copy_(src), 1, device) for _ in range(reps)]
    return 2 * nbytes / statistics.median(times)


def matmul_peak(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16, reps: int = 10) -> float:
    """FLOP/s of a large square matmul through torch (cuBLAS), on random data (median of ``reps``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = [timed(lambda: a @ b, 1, device) for _ in range(reps)]
    return 2 * n ** 3 / statistics.median(times)


def cuda_graph(fn: Callable[[], Any], calls: int = 1, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """fn called ``calls`` times, captured as one CUDA graph (after ``warmup`` calls on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` replays of ``graph`` (CUDA events around each)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def spread(samples: list[float]) -> dict[str, float]:
    """Median, min, max and relative spread ((max - min) / median) of repeated measurements."""
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0, "n": len(samples)}


def graph_ms(fn: Callable[[], None], reps: int) -> dict[str, float]:
    """Median ms of one replay of ``fn`` captured as a CUDA graph (``reps`` replays), and their spread."""
    g = cuda_graph(fn, warmup=1)
    g.replay()
    torch.cuda.synchronize()
    s = spread(replay_ms(g, reps))
    del g
    return {"ms": round(s["median"], 4), "spread": round(s["spread"], 4)}


Kinds = tuple[tuple[str, tuple[str, ...]], ...]  # (kind, marks): a kernel whose name holds a mark is of that kind


def profile(fn: Callable[[], Any], device: torch.device, reps: int = 3, top: int = 20,
            kinds: Kinds | None = None) -> dict[str, Any]:
    """Kernels of ``reps`` calls of fn (per call): the top kernels and the device time per kind
    (``kinds``, first match wins; default ``KINDS``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    rows = []
    for evt in prof.key_averages():
        us = float(getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0))
        if us > 0 and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
            rows.append({"name": evt.key[:120], "calls_per_step": evt.count / reps, "us_per_step": us / reps})
    rows.sort(key=lambda r: -r["us_per_step"])
    by_kind: dict[str, float] = {}
    for r in rows:
        kind = kernel_kind(r["name"], kinds or KINDS)
        by_kind[kind] = by_kind.get(kind, 0.0) + r["us_per_step"]
    total = sum(r["us_per_step"] for r in rows)
    marginal = marginal_times(prof.events(), reps)
    by_kind_marginal: dict[str, float] = {}
    for name, us in marginal.items():
        kind = kernel_kind(name, kinds or KINDS)
        by_kind_marginal[kind] = by_kind_marginal.get(kind, 0.0) + us
    return {"kernel_us_per_step": total, "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "top": rows[:top],
            "marginal_us_per_step": sum(marginal.values()),
            "marginal_by_kind_us": dict(sorted(by_kind_marginal.items(), key=lambda kv: -kv[1])),
            "top_marginal": sorted(([us, name[:120]] for name, us in marginal.items()), reverse=True)[:top],
            "sequence": kernel_sequence(prof.events(), reps)}


def _charged(events: Any) -> list[tuple[float, float, str, float, float]]:
    """The device's kernels as (start, end, name, critical-path time, idle gap before it), in the order they
    end: a kernel is charged from the end of the kernel that ended before it (its own duration where the GPU
    was idle in between, that gap apart). Under PDL a kernel starts before the one ahead of it ends and waits,
    so its duration counts that wait too; the ends do not overlap."""
    spans = sorted((e.time_range.end, e.time_range.start, e.name) for e in events
                   if "CUDA" in str(getattr(e, "device_type", "")))
    out = []
    last_end = None
    for end, start, name in spans:
        idle = start - last_end if last_end is not None and last_end < start else 0.0
        begin = start if last_end is None or last_end < start else last_end
        out.append((start, end, name, end - begin, idle))
        last_end = end
    return out


def marginal_times(events: Any, reps: int = 1) -> dict[str, float]:
    """Each kernel name's time on the critical path per call (``_charged``), the idle gaps as "(idle)"."""
    out: dict[str, float] = {}
    for _, _, name, charged, idle in _charged(events):
        if idle:
            out["(idle)"] = out.get("(idle)", 0.0) + idle / reps
        out[name] = out.get(name, 0.0) + charged / reps
    return out


def kernel_sequence(events: Any, reps: int) -> list[list[Any]]:
    """The middle call's kernels in launch order, [name, duration us, critical-path us] each (the latter
    ``_charged``'s): which launch of a kernel that runs several times a call (a matmul per shape, a layer's
    norms) costs what, by its position."""
    spans = sorted(_charged(events))
    per = len(spans) // max(reps, 1)
    lo = per * (reps // 2)
    return [[name[:48], round(end - start, 2), round(charged, 2)] for start, end, name, charged, _ in spans[lo:lo + per]]


KINDS: Kinds = (
    ("comm", ("allreduce", "all_reduce", "nccl", "fusion", "lamport", "oneshot", "twoshot")),
    ("matmul", ("_decode_gemm",)),  # the fast set's decode GEMM, before "decode" marks it attention
    ("attention", ("_decode_kernel", "_combine_kernel", "batchdecode", "batchprefill", "prefill", "decode",
                   "mla", "attention", "flashinfer")),
    ("rms_norm", ("rms_norm", "rmsnorm")), ("rope", ("rope",)), ("silu_mul", ("silu_mul", "act_and_mul")),
    ("matmul", ("gemv", "gemm", "cutlass", "xmma", "nvjet", "sm90", "splitk", "cublas")),
    ("embedding", ("embedding", "index")), ("sampling", ("argmax", "reduce", "softmax", "topk")),
)


def kernel_kind(name: str, kinds: Kinds = KINDS) -> str:
    n = name.lower()
    for kind, marks in kinds:
        if any(m in n for m in marks):
            return kind
    return "other"


def commit() -> str | None:
    """The checkout's commit: $FUSEDSERVE_COMMIT (the GPU machine gets a copy of the tree without .git),
    else git's, else None."""
    if os.environ.get("FUSEDSERVE_COMMIT"):
        return os.environ["FUSEDSERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def host() -> dict[str, Any]:
    """The host a run got: CPU model, CPUs it may use, 1-minute load average, and the time of a fixed
    pure-Python loop (median of 5, measured once per process). Host-bound figures follow the last: the
    same speculative code read 0.8x to 1.43x over plain decoding on H200 leases whose hosts differed
    (2026-12-04), so every record says which host it had."""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
    except OSError:
        cpu = None

    def loop() -> float:
        start, acc = time.perf_counter(), 0
        for i in range(200_000):
            acc += i & 7
        return time.perf_counter() - start

    return {"cpu": cpu or platform.processor() or None, "cpus": len(os.sched_getaffinity(0)),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "python_loop_ms": round(1e3 * statistics.median(loop() for _ in range(5)), 2)}


def record_header(command: list[str] | None = None) -> dict[str, Any]:
    """date, machine, host, commit, command and versions: what every recorded run starts with."""
    cuda = torch.cuda.is_available()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "flashinfer"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    return {"date": str(datetime.date.today()),
            "machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if cuda
            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)", "host": host(), "commit": commit(),
            "command": " ".join(command if command is not None else ["python", *sys.argv]), "versions": versions}


def write_record(record: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def apply_settings(items: list[str]) -> dict[str, Any]:
    """A/B runs of module constants: each ``module.NAME=value`` (module under ``fusedserve.``, e.g.
    ``models.layers.linear_triton.SPLIT_K_MAX=2``; value a Python literal) set before any engine is built.
    -> what was set, for the record. ValueError for a name the module does not have."""
    import ast
    import importlib

    done: dict[str, Any] = {}
    for item in items:
        target, _, text = item.partition("=")
        module_name, _, attr = target.rpartition(".")
        module = importlib.import_module(f"fusedserve.{module_name}")
        if not hasattr(module, attr):
            raise ValueError(f"fusedserve.{module_name} has no {attr}")
        value = ast.literal_eval(text)
        setattr(module, attr, value)
        done[target] = value
    return done


DROPPABLE = ("rope", "silu", "norm", "attention", "multi_token_attention", "combine")


def drop_kernels(kinds: str) -> list[str]:
    """Leave the fast set's kernels of ``kinds`` (comma list of DROPPABLE) out, before any engine is built
    (``Kernels.triton()`` imports them then): RoPE returns q and k as they are, SiLU-and-mul the gate half,
    the norms their input (and it as the residual), attention q (and stores no K/V);
    ``multi_token_attention`` only the attention of steps of several new tokens a sequence (a verify, a
    prefill: one-row decode keeps its kernel), ``combine`` only the combine after a split attention. The steps'
    tokens are garbage; their time is what is left (bench/decode_engine.py, bench/graph_launch_probe.py --drop)."""
    chosen = [k for k in kinds.split(",") if k]
    unknown = set(chosen) - set(DROPPABLE)
    if unknown:
        raise SystemExit(f"--drop takes {', '.join(DROPPABLE)}; not {', '.join(sorted(unknown))}")
    if "rope" in chosen:
        import fusedserve.models.layers.rope_triton as rope_module
        rope_module.rope_triton = lambda positions, q, k, inv_freq: (q, k)  # type: ignore[assignment]
    if "silu" in chosen:
        import fusedserve.models.layers.silu_mul_triton as silu_module
        silu_module.silu_and_mul_triton = lambda x: x[:, : x.shape[1] // 2]  # type: ignore[assignment]
    if "norm" in chosen:
        import fusedserve.models.layers.rms_norm_triton as norm_module
        norm_module.rms_norm_triton = lambda x, weight, eps: x  # type: ignore[assignment]
        norm_module.add_rms_norm_triton = lambda x, residual, weight, eps: (x, x)  # type: ignore[assignment]
    if "multi_token_attention" in chosen:
        import fusedserve.models.layers.decode_attention_triton as attention_module
        attention_module.paged_prefill_attention_triton = (  # type: ignore[assignment]
            lambda q, k, v, layer_id, batch, scale: q)
    if "combine" in chosen:
        import fusedserve.models.layers.prefill_attention_triton as prefill_module
        prefill_module.combine_splits = lambda part_acc, part_m, part_l, out: None  # type: ignore[assignment]
    if "attention" in chosen:
        import fusedserve.models.layers.attention_flashinfer as flashinfer_module
        import fusedserve.models.layers.decode_attention_triton as attention_module
        attention_module.paged_decode_attention_triton = (  # type: ignore[assignment]
            lambda q, k, v, layer_id, batch, scale: q)
        flashinfer_module.paged_decode_attention_triton = attention_module.paged_decode_attention_triton  # type: ignore[attr-defined]
    return chosen
