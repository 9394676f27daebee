"""How long the host spends launching each captured CUDA graph, through the engine (GPU).

    python bench/graph_launch_probe.py --target DIR [--draft DIR] [--configs none,chain-3] [--out FILE]
        [--temperature T] [--timeline] [--kernels] [--drop combine,multi_token_attention,...] [--set MODULE.NAME=VALUE]

For each configuration: one engine (``Engine`` with its defaults on CUDA, as bench/spec_decode_real.py
builds it), a warm-up generate, then

1. in a generate (256 tokens): every ``CUDAGraph.replay`` call's host time, split by whether the
   stream still had work queued when it was called (a launch behind queued work may wait for room in
   the launch queue; one on an idle stream is the launch's own cost);
2. every captured graph of the target's and the draft's executor replayed alone on an idle GPU: the
   host time of ``replay()`` and the GPU time until it finishes (median of 20).

3. in another generate, the host's time per engine step in each phase of a step (inclusive; phases
   nest): scheduling, the speculative step, the draft's first pass, the chained draft steps, every
   executor forward, acceptance, committing the tokens, and ``Tensor.tolist`` (the read-backs: a
   wait for the device shows here);
4. ``--kernels``: every captured graph of at least 200 us GPU time, its kernels by GPU time per replay
   (``bench.common.profile`` of 5 replays on an idle GPU), and the middle replay's kernels in launch order,
   each with its duration and critical-path time (``sequence``: which launch of a kernel run many times a
   step, e.g. a layer's four matmuls, costs what; with ``FUSEDSERVE_PDL=0`` each kernel's own time);
5. ``--host-profile``: cProfile of one more generate, the host functions by own time per engine step;
6. ``--timeline``: in one more generate, per engine step, when the host launched each graph replay and
   when the GPU ran it (CUDA events), the read-backs' waits and the step's end (medians over steps):
   where the GPU sits idle and which host work it waits for. Not after ``--kernels`` in one process
   (the profiler's tracing stays attached and slows every launch): run configurations one per process.

Records, per graph, the shape and both times; the point is whether a graph's launch costs the host
more than its kernels cost the GPU (then the host, not the device, bounds a step that waits on it),
and where a step's host time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.common import apply_settings, drop_kernels, profile, record_header  # noqa: E402
from bench.spec_decode_real import overlap_of, spec_config  # noqa: E402


def timed_replays(log: list[tuple[int, float, bool]]) -> Any:
    """Wraps CUDAGraph.replay: appends (graph id, host us, stream busy at the call)."""
    original = torch.cuda.CUDAGraph.replay

    def replay(self: torch.cuda.CUDAGraph) -> None:
        busy = not torch.cuda.current_stream().query()
        t = time.perf_counter()
        original(self)
        log.append((id(self), 1e6 * (time.perf_counter() - t), busy))

    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    return original


def phase_timers(phases: dict[str, list[float]]) -> list[tuple[Any, str, Any]]:
    """Wraps the step's phases (class, method) with wall-clock timers appending to ``phases[name]``;
    returns what to restore."""
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.scheduler import Scheduler
    from fusedserve.worker.executor.executor import StepExecutor
    from fusedserve.worker.spec_decode.decoder import SpecDecoder
    from fusedserve.worker.spec_decode.drafter import Drafter

    targets = [("engine.step", Engine, "step"), ("schedule", Scheduler, "schedule"),
               ("commit", Engine, "commit_step"), ("spec.step", SpecDecoder, "step"),
               ("spec.advance", SpecDecoder, "advance"), ("spec.follow", SpecDecoder, "_follow"),
               ("spec.accept", SpecDecoder, "_accept"), ("draft.first_pass", Drafter, "_first_pass"),
               ("draft.chain", StepExecutor, "run_chain"), ("executor.run", StepExecutor, "run"),
               ("tolist", torch.Tensor, "tolist")]
    saved = []
    for name, cls, attr in targets:
        original = getattr(cls, attr)
        saved.append((cls, attr, original))

        def timed(*args: Any, _f: Any = original, _n: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                phases.setdefault(_n, []).append(time.perf_counter() - t)

        setattr(cls, attr, timed)
    return saved


def idle_launches(graphs: Any, label: str, repeats: int = 20, kernels: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for shape, entry in sorted(graphs.captured.items(), key=lambda kv: str(kv[0])):
        if entry.graph is None:
            continue
        host, gpu = [], []
        graphs.pad_inputs(shape)  # not the inputs another shape's last step left in the shared buffer
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            entry.graph.replay()
            host.append(1e6 * (time.perf_counter() - t))
            end.record()
            end.synchronize()
            gpu.append(1000 * start.elapsed_time(end))
        rows.append({"executor": label, "shape": str(shape), "host_launch_us": round(statistics.median(host), 1),
                     "gpu_us": round(statistics.median(gpu), 1)})
        if kernels and statistics.median(gpu) >= 200:
            p = profile(entry.graph.replay, torch.device("cuda"), reps=5, top=25)
            rows[-1]["kernels"] = {"kernels_per_replay": round(p["kernels_per_step"], 1),
                                   "by_kind_us": {k: round(v, 1) for k, v in p["by_kind_us"].items()},
                                   "top_us_calls": [[round(r["us_per_step"], 1), r["calls_per_step"], r["name"][:90]]
                                                    for r in p["top"]],
                                   "marginal_us": round(p["marginal_us_per_step"], 1),
                                   "marginal_by_kind_us": {k: round(v, 1) for k, v in p["marginal_by_kind_us"].items()},
                                   "top_marginal_us": [[round(us, 1), name[:90]] for us, name in p["top_marginal"]],
                                   "sequence": p["sequence"]}
    return rows


def host_profile(engine: Any, prompt: list[int], params: Any, top: int = 40) -> list[list[Any]]:
    """cProfile of one generate: [own us per engine step, cumulative us per step, calls per step, function]."""
    import cProfile
    import pstats

    from fusedserve.worker.engine.engine import Engine

    steps = [0]
    original = Engine.step

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        return original(self, *args, **kwargs)

    Engine.step = counted  # type: ignore[method-assign]
    prof = cProfile.Profile()
    try:
        prof.enable()
        engine.generate([prompt], params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.disable()
    finally:
        Engine.step = original  # type: ignore[method-assign]
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    n = max(steps[0], 1)
    rows = [[round(1e6 * tt / n, 1), round(1e6 * ct / n, 1), round(nc / n, 2), f"{Path(f).name}:{line} {fn}"]
            for (f, line, fn), (_cc, nc, tt, ct, _callers) in stats.items()]
    return sorted(rows, key=lambda r: -r[0])[:top]


def timeline(engine: Any, prompt: list[int], params: Any, names: dict[int, str]) -> dict[str, Any]:
    """One generate's GPU timeline against the host's, per engine step: each graph replay's host launch
    and its GPU start and end (CUDA events around it, placed on the host clock by an event recorded on
    an idle GPU at a known host time), the read-backs' waits, the step's end; all relative to the step's
    host start. Summarised over the steps whose replays follow the most common order (medians)."""
    from fusedserve.worker.engine.engine import Engine

    steps: list[tuple[float, float]] = []
    replays: list[tuple[float, int, Any, Any]] = []
    waits: list[tuple[float, float]] = []
    step0, replay0, tolist0 = Engine.step, torch.cuda.CUDAGraph.replay, torch.Tensor.tolist
    sync0 = torch.cuda.Event.synchronize

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return step0(self, *args, **kwargs)
        finally:
            steps.append((t, time.perf_counter()))

    def replay(self: torch.cuda.CUDAGraph) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        replay0(self)
        b.record()
        replays.append((t, id(self), a, b))

    def tolist(self: torch.Tensor) -> Any:
        t = time.perf_counter()
        try:
            return tolist0(self)
        finally:
            waits.append((t, time.perf_counter()))

    def synchronize(self: torch.cuda.Event) -> None:  # a read-back started earlier (host_copy.read_later)
        t = time.perf_counter()
        try:
            sync0(self)
        finally:
            if time.perf_counter() - t > 20e-6:  # not the packing's check of its last copy, done at once
                waits.append((t, time.perf_counter()))

    torch.cuda.synchronize()
    base = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    base.record()
    Engine.step, torch.cuda.CUDAGraph.replay, torch.Tensor.tolist = step, replay, tolist  # type: ignore[method-assign]
    torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
    try:
        engine.generate([prompt], params)
        torch.cuda.synchronize()
    finally:
        Engine.step, torch.cuda.CUDAGraph.replay, torch.Tensor.tolist = step0, replay0, tolist0  # type: ignore[method-assign]
        torch.cuda.Event.synchronize = sync0  # type: ignore[method-assign]
    gpu = [(t, gid, t0 + base.elapsed_time(a) / 1000, t0 + base.elapsed_time(b) / 1000) for t, gid, a, b in replays]
    per_step: list[tuple[tuple[str, ...], list[float]]] = []
    for s, e in steps:
        mine = [r for r in gpu if s <= r[0] < e]
        mine_waits = [w for w in waits if s <= w[0] < e]
        order = tuple(names.get(gid, "?") for _, gid, _, _ in mine) + ("tolist",) * len(mine_waits)
        marks = [1e6 * (x - s) for x in [v for (t, _, g0, g1) in mine for v in (t, g0, g1)]]
        marks += [1e6 * (x - s) for w in mine_waits for x in w] + [1e6 * (e - s)]
        per_step.append((order, marks))
    if not per_step:
        return {}
    orders = [o for o, _ in per_step]
    common = max(set(orders), key=orders.count)
    rows = [m for o, m in per_step if o == common]
    med = [round(statistics.median(col), 1) for col in zip(*rows)]
    graphs = [n for n in common if n != "tolist"]
    out: dict[str, Any] = {"steps": len(per_step), "steps_in_common_order": len(rows), "replays": [], "waits": []}
    for i, n in enumerate(graphs):
        launch, start, end = med[3 * i: 3 * i + 3]
        out["replays"].append({"graph": n, "host_launch_us": launch, "gpu_start_us": start, "gpu_end_us": end,
                               "gpu_us": round(end - start, 1)})
    k = 3 * len(graphs)
    for j in range(common.count("tolist")):
        out["waits"].append({"from_us": med[k + 2 * j], "to_us": med[k + 2 * j + 1]})
    out["step_end_us"] = med[-1]
    busy = sum(r["gpu_us"] for r in out["replays"])
    out["gpu_busy_in_replays_us"] = round(busy, 1)
    out["gpu_idle_us"] = round(med[-1] - busy, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default="")
    ap.add_argument("--configs", default="none,chain-3")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the generates' temperature (above 0: seeded sampling, the sampled rounds' path)")
    ap.add_argument("--out", default="")
    ap.add_argument("--kernels", action="store_true", help="each long captured graph's kernels by GPU time")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of a generate's host functions")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant under fusedserve. first (an A/B), e.g. models.layers.linear_triton.SPLIT_K_MAX=2")
    ap.add_argument("--timeline", action="store_true", help="a generate's GPU timeline per step against the host's")
    ap.add_argument("--drop", default="", help="comma list of bench.common.DROPPABLE kinds (e.g. combine, "
                    "multi_token_attention, norm): left out of every step (garbage tokens; timing only: what the kind "
                    "costs inside each captured graph, e.g. the verify's)")
    args = ap.parse_args()
    settings = apply_settings(args.set)
    dropped = drop_kernels(args.drop)
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    out: dict[str, Any] = {**record_header(), "what": __doc__.split("\n")[0], "settings": settings, "temperature": args.temperature,
                           "dropped_kernels": dropped, "configs": {}}
    for name in args.configs.split(","):
        engine = Engine(args.target, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1,
                                                  speculative=spec_config(args.draft, name), seed=0,
                                                  kv_memory_fraction=0.2, overlap_scheduling=overlap_of(name)))
        tok = engine.tokenizer
        assert tok is not None
        prompt = tok.encode_chat([{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, ignore_eos=True,
                                seed=0 if args.temperature > 0 else None)
        engine.generate([prompt], params)  # warm-up
        log: list[tuple[int, float, bool]] = []
        original = timed_replays(log)
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            [c] = engine.generate([prompt], params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        finally:
            torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]
        phases: dict[str, list[float]] = {}
        saved = phase_timers(phases)
        try:
            engine.generate([prompt], params)
            torch.cuda.synchronize()
        finally:
            for cls, attr, original_fn in saved:
                setattr(cls, attr, original_fn)
        steps = max(len(phases.get("engine.step", [])), 1)
        per_step = {n: {"calls_per_step": round(len(v) / steps, 2), "us_per_step": round(1e6 * sum(v) / steps, 1)}
                    for n, v in phases.items()}
        by_graph: dict[int, list[tuple[float, bool]]] = {}
        for gid, us, busy in log:
            by_graph.setdefault(gid, []).append((us, busy))
        names: dict[int, str] = {}
        rows = idle_launches(engine.executor.graphs, "target", kernels=args.kernels)
        for shape, entry in engine.executor.graphs.captured.items():
            names[id(entry.graph)] = f"target {shape}"
        spec = getattr(engine, "speculator", None)
        if spec is not None and spec.draft.graphs is not None:
            rows += idle_launches(spec.draft.graphs, "draft", kernels=args.kernels)
            for shape, entry in spec.draft.graphs.captured.items():
                names[id(entry.graph)] = f"draft {shape}"
        in_generate: list[dict[str, Any]] = []
        for gid, calls in by_graph.items():
            idle = [us for us, queued in calls if not queued]
            behind = [us for us, queued in calls if queued]
            in_generate.append({"graph": names.get(gid, str(gid)), "calls": len(calls),
                                "host_us_idle_stream_median": round(statistics.median(idle), 1) if idle else None,
                                "calls_idle_stream": len(idle),
                                "host_us_busy_stream_median": round(statistics.median(behind), 1) if behind else None,
                                "host_us_total": round(sum(us for us, _ in calls), 1)})
        out["configs"][name] = {"tokens": len(c.token_ids), "wall_ms": round(1000 * wall, 2),
                                "ms_per_token": round(1000 * wall / max(len(c.token_ids), 1), 3),
                                "engine_steps": steps, "host_phases_per_step": per_step,
                                "replays_in_generate": sorted(in_generate, key=lambda r: -r["host_us_total"]),
                                "idle_launch": rows}
        if args.timeline:
            out["configs"][name]["timeline"] = timeline(engine, prompt, params, names)
        if args.host_profile:
            out["configs"][name]["host_profile_us_per_step"] = host_profile(engine, prompt, params)
        print(json.dumps(out["configs"][name], indent=1), flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
