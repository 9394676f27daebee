"""Benchmark (f): the tiny EAGLE3 pair on one GPU, engine tokens/s with vs without speculation.

    . bench/device_env.sh && python3 -P bench/spec_decode_gpu.py --out $OUT/spec-decode-gpu.json
    python bench/spec_decode_gpu.py --tiny          # CPU, a few prompts: checks the script only

The real engine path: ``worker/engine/`` (scheduler, executor, sampler, detokenizer) with
``EngineConfig(device="cuda", speculative=..., cuda_graphs=...)`` over examples/checkpoints/tiny-code
and its EAGLE3 draft tiny-code-eagle3, with CUDA graphs (decode / verify / draft steps replayed,
``worker/executor/step_graphs.py``) and eager (``--graphs on,off``; CPU: the padded static-shape path
run eagerly). Prompts: the first ``--prompt-len`` tokens of held-out
standard-library files of this interpreter (never trained on), greedy, ``ignore_eos``,
``--new-tokens`` each; configurations as in bench/spec_decode_cpu.py (none, chains of 3/4/5
steps, a tree of topk 4 / 4 steps / 8 verified tokens), each at batch 1 and batch 8, a fresh
engine per run after one warm-up generation per configuration, repeats interleaved over the
configurations, the fastest run counting. Outputs must equal the no-speculation outputs.
Then one batch-1 run per configuration with the engine's phases timed (the device
synchronised at each phase's end): target forward (prepare + model), drafting, acceptance
(incl. K/V relocation), and the rest of the step (scheduler, sampler, detokenizer, commit);
inside drafting, the draft forwards alone (``draft_forwards_within_drafting``), and how many
forwards ran as graph replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.*; fusedserve stays the installed one (bench/common.py)

from bench.spec_decode_cpu import CONFIGS, TARGET, heldout_prompts

_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[spec_decode_gpu {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def configs() -> dict[str, Any]:
    return dict(CONFIGS)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PhaseTimer:
    """Wraps engine methods: seconds spent in each (device synchronised at the end of each call)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.seconds[phase] += time.perf_counter() - t
            self.calls[phase] += 1
            return out

        setattr(obj, method, timed)


NESTED = "draft_forwards_within_drafting"  # inside "drafting": not subtracted from the step


def run(label: str, spec: Any, prompts: list[list[int]], batch: int, args: Any, graphs: bool, phases: bool = False
        ) -> dict[str, Any]:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engine = Engine(TARGET, EngineConfig(num_blocks=args.num_blocks, max_num_seqs=batch, speculative=spec,
                                         device=args.device, dtype=args.dtype, cuda_graphs=graphs))
    timer = None
    if phases:
        timer = PhaseTimer(args.device)
        timer.wrap(engine.runner, "run", "target_forward")
        timer.wrap(engine, "step", "engine_step")
        if engine.speculator is not None:
            timer.wrap(engine.speculator, "propose", "drafting")
            timer.wrap(engine.speculator, "_accept", "accept_and_relocate")
            timer.wrap(engine.speculator.draft, "run", NESTED)
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    steps = 0
    sync(args.device)
    start = time.perf_counter()
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            tokens[ids[out.request_id]] += out.new_token_ids
    sync(args.device)
    seconds = time.perf_counter() - start
    outputs = [tokens[i] for i in range(len(prompts))]
    res: dict[str, Any] = {"seconds": seconds, "steps": steps, "outputs": outputs,
                           "tokens": sum(len(t) for t in outputs),
                           "tok_per_s": sum(len(t) for t in outputs) / seconds}
    spec_stats = engine.stats().spec
    if spec_stats is not None:
        res["acceptance_length"] = spec_stats.acceptance_length
        res["accepted_per_position_rate"] = [n / spec_stats.drafts for n in spec_stats.accepted_per_position] \
            if spec_stats.drafts else []
    graphed = {"target": engine.executor.graphs.runs if engine.executor.graphs is not None else 0}
    if engine.speculator is not None:
        dg = engine.speculator.draft.graphs
        graphed["draft"] = dg.runs if dg is not None else 0
    res["graph_runs"] = graphed
    if timer is not None:
        per_step = {k: 1000 * v / steps for k, v in timer.seconds.items()}
        step_ms = per_step.pop("engine_step", 0.0)
        per_step["rest_of_step"] = step_ms - sum(v for k, v in per_step.items() if k != NESTED)
        res["phases_ms_per_engine_step"] = {"engine_step": step_ms, **per_step}
        res["phase_calls"] = dict(timer.calls)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-blocks", type=int, default=160)
    ap.add_argument("--graphs", default="on,off", help="CUDA graphs: on, off or both (on,off)")
    ap.add_argument("--tiny", action="store_true", help="CPU, 3 prompts of 16 new tokens, 1 repeat")
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-spec-decode-gpu-graphs-h200.json")
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.new_tokens, args.repeats = 3, 16, 1
    args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    modes = {"on": True, "off": False}
    graph_modes = [m for m in args.graphs.split(",") if m]
    if not graph_modes or any(m not in modes for m in graph_modes):
        raise SystemExit(f"--graphs takes on, off or on,off, not {args.graphs!r}")
    prompts, names = heldout_prompts(args.prompts, args.prompt_len)
    cfgs = configs()
    batches = (1, 8)
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    all_s: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    for mode in graph_modes:  # warm-up (allocator, cuBLAS handles, first-call paths, graph pools)
        for label, spec in cfgs.items():
            run(label, spec, prompts[:1], 1, argparse.Namespace(**{**vars(args), "new_tokens": 8}), modes[mode])
    progress(f"warmed up on {args.device} ({args.dtype}); {len(prompts)} prompts x {args.new_tokens} new tokens")
    for rep in range(args.repeats):
        for mode in graph_modes:
            for label, spec in cfgs.items():
                secs = []
                for batch in batches:
                    r = run(label, spec, prompts, batch, args, modes[mode])
                    secs.append(round(r["seconds"], 3))
                    key = (mode, label, batch)
                    if key not in best or r["seconds"] < best[key]["seconds"]:
                        best[key] = r
                    progress(f"repeat {rep + 1} graphs {mode:3s} {label:26s} batch {batch}: {r['tok_per_s']:8.1f} "
                             f"tok/s, {r['steps']} steps, graph runs {r['graph_runs']}"
                             + (f", acceptance length {r['acceptance_length']:.3f}" if "acceptance_length" in r else ""))
                all_s[(mode, label)].append(secs)
    phases: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in graph_modes:
        for label, spec in cfgs.items():
            r = run(label, spec, prompts, 1, args, modes[mode], phases=True)
            phases[(mode, label)] = {"tok_per_s_with_sync": r["tok_per_s"], "steps": r["steps"],
                                     "phases_ms_per_engine_step": r["phases_ms_per_engine_step"],
                                     "phase_calls": r["phase_calls"], "graph_runs": r["graph_runs"],
                                     "ms_per_token": 1000 * r["seconds"] / r["tokens"]}
            progress(f"phases graphs {mode:3s} {label:26s}: " + json.dumps(
                {k: round(v, 3) for k, v in r["phases_ms_per_engine_step"].items()}))
    numbers: dict[str, Any] = {}
    for mode in graph_modes:
        rows: dict[str, Any] = {}
        for label in cfgs:
            row: dict[str, Any] = {}
            for batch in batches:
                r, base = best[(mode, label, batch)], best[(mode, "none", batch)]
                row[f"tok_per_s_batch{batch}"] = round(r["tok_per_s"], 1)
                row[f"speedup_batch{batch}"] = round(r["tok_per_s"] / base["tok_per_s"], 3)
                if "off" in graph_modes:
                    eager = best[("off", "none", batch)]
                    row[f"speedup_vs_eager_no_speculation_batch{batch}"] = round(r["tok_per_s"] / eager["tok_per_s"], 3)
                    row[f"greedy_equal_to_eager_batch{batch}"] = r["outputs"] == best[("off", label, batch)]["outputs"]
                row[f"greedy_equal_to_no_speculation_batch{batch}"] = r["outputs"] == base["outputs"]
                row[f"engine_steps_batch{batch}"] = r["steps"]
                row[f"graph_runs_batch{batch}"] = r["graph_runs"]
                if "acceptance_length" in r:
                    row[f"acceptance_length_batch{batch}"] = round(r["acceptance_length"], 4)
            if (mode, label) in phases:
                row["phases_batch1"] = phases[(mode, label)]
            row["all_runs_seconds_batch1_batch8"] = all_s[(mode, label)]
            rows[label] = row
        numbers[f"graphs_{mode}"] = rows
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    record = {
        "date": str(datetime.date.today()), "machine": machine,
        "software": f"Python {platform.python_version()}, torch {torch.__version__}",
        "command": " ".join(["python", *sys.argv]),
        "what": f"tiny-code + tiny-code-eagle3 through the engine (worker/engine/) on {args.device}, {args.dtype}; graphs_on: "
                f"CUDA graphs (torch graph-safe kernels, decode/verify/draft steps replayed at padded batch sizes), "
                f"graphs_off: eager (reference kernels); greedy ignore_eos; prompts = first {args.prompt_len} "
                f"tokens of {len(prompts)} held-out stdlib files, {args.new_tokens} new tokens each",
        "prompt_files": names, "numbers": numbers,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({m: {k: {x: v[x] for x in v if x.startswith(("tok_per_s", "speedup", "acceptance", "greedy"))}
                          for k, v in rows.items()} for m, rows in numbers.items()}))


if __name__ == "__main__":
    main()
