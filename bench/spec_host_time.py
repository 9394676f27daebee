"""Host time of a speculative step outside its forwards, on CPU: what Python and op dispatch cost a round.

    python bench/spec_host_time.py [--temperatures 0,1] [--steps 5] [--tokens 200] [--out FILE]
    python bench/spec_host_time.py --replays [--steps 7] [--calls 3000] [--out FILE]
    python bench/spec_host_time.py --noop-rounds [--temperatures 0,1] [--steps 7] [--tokens 200] [--repeats 3] [--out FILE]
      (no speculation, chain-N read round by round, chain-N with rounds in flight; per temperature)
    python bench/spec_host_time.py --op-counts [--temperatures 0,1] [--steps 7] [--tokens 200] [--out FILE]

The engine runs the tiny pair (examples/checkpoints/tiny-code + tiny-code-eagle3) with ``cuda_graphs=True``,
which on CPU runs every captured shape's forward eagerly on its static buffers (``step_graphs.py``); the
time inside those forwards is the model's, everything else in ``Engine.generate`` is host work the GPU
would wait on between its graph replays: building steps, packing metadata, sampling and acceptance ops,
bookkeeping. Reported per verify round (and per token without speculation), with the number of forwards a
round replays. A CPU proxy, not the GPU's host: the ops outside the forwards run on tiny tensors here and
launch kernels there, so compare configurations with each other, not with GPU timings.

Whole rounds minus their forwards read +-10 % between runs on a shared 2-core machine, too coarse for a change
of tens of microseconds. ``--replays`` times one piece alone instead, the host path of the two replays a round
makes on the GPU: the verify's ``StepExecutor.run`` (chain + 1 rows at position 40) and the draft's
``run_first_chain`` (the first pass with rows dropped on the device, then the chain), each captured shape's
replay a no-op returning its static outputs (as ``graph.replay()`` costs the host one call): packing the
layout, the metadata copy, the device inputs' index copies, the ledger, the output views. Median of 5 x 3000
calls (spread ~2 %). ``--noop-rounds`` runs whole engine rounds with every replay a no-op: the round's wall
time is then all host time (schedule, packing, acceptance ops, bookkeeping, commit), per speculative round and
per plain step, without the model's CPU compute to blur it (the tokens are meaningless: static logits).
``--op-counts`` counts instead of timing (exact, no spread): the torch ops a round dispatches outside its graph
replays (views included: each is a host dispatch; on a GPU the others are kernel launches), rounds in flight as
on a GPU, every replay a no-op. Where the GPU runs a Triton fast path instead of the CPU's torch reference (the
draw at a temperature, the chain rule, a sampled round's outcomes and restaging) the call counts as its
launches on the GPU, not as the reference's ops; a package without some of those paths (an older commit on
``PYTHONPATH``) is counted as it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.executor import step_graphs
from fusedserve.worker.spec_decode.config import SpeculativeConfig

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.common import record_header, write_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")


class ForwardClock:
    """Time spent inside the captured shapes' forwards (patched around ``StepGraphs._forward``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._orig = step_graphs.StepGraphs._forward

    def __enter__(self) -> ForwardClock:
        clock, orig = self, self._orig

        def timed(graphs: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(graphs, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t
                clock.calls += 1

        step_graphs.StepGraphs._forward = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        step_graphs.StepGraphs._forward = self._orig  # type: ignore[method-assign]


def measure(temperature: float, steps: int, tokens: int, repeats: int) -> dict[str, Any]:
    spec = SpeculativeConfig(DRAFT, num_steps=steps) if steps else None
    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=1, cuda_graphs=True, speculative=spec))
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=1)
    engine.generate(["def fib(n):\n    "], params)  # warm-up
    runs = []
    for r in range(repeats):
        before = engine.stats().spec
        with ForwardClock() as clock:
            t = time.perf_counter()
            [out] = engine.generate([f"import os\nx = {r}\n"], params)
            wall = time.perf_counter() - t
        after = engine.stats().spec
        rounds = after.drafts - before.drafts if after and before else len(out.token_ids)
        runs.append({"wall_ms": round(1e3 * wall, 2), "in_forwards_ms": round(1e3 * clock.seconds, 2),
                     "forwards": clock.calls, "rounds": rounds, "tokens": len(out.token_ids),
                     "host_ms_per_round": round(1e3 * (wall - clock.seconds) / rounds, 4)})
    host = sorted(r["host_ms_per_round"] for r in runs)
    return {"temperature": temperature, "steps": steps, "runs": runs,
            "host_ms_per_round_median": host[len(host) // 2], "host_ms_per_round_spread": [host[0], host[-1]],
            "forwards_per_round": round(sum(r["forwards"] for r in runs) / sum(r["rounds"] for r in runs), 2),
            "tokens_per_round": round(sum(r["tokens"] for r in runs) / sum(r["rounds"] for r in runs), 3)}


class _NoReplay:
    """A captured graph whose replay does nothing (its static outputs stay as they are)."""

    def replay(self) -> None:
        pass


def _noop_replays(engine: Engine) -> None:
    """Every captured shape of the engine's target (and draft) replays as a no-op returning the static outputs
    of one padded forward."""
    import torch

    executors = [engine.executor] + ([engine.speculator.draft] if engine.speculator is not None else [])
    for executor in executors:
        graphs = executor.graphs
        assert graphs is not None
        for shape, entry in graphs.captured.items():
            graphs.pad_inputs(shape)
            with torch.inference_mode():
                entry.outputs = graphs._forward(shape, entry.views, entry.attention)
            entry.graph = _NoReplay()


def noop_rounds(steps: int, tokens: int, repeats: int, overlap: bool = False, temperature: float = 0.0
                ) -> dict[str, Any]:
    """Whole engine steps with every replay a no-op: a round's wall time is its host time (the prompt's eager
    prefill aside), with no model compute between to blur it. The tokens are meaningless (static logits).
    ``overlap``: greedy rounds in flight (``SpecDecoder.advance``: each round launched on the inputs the verify
    staged, no schedule or packing), as on a GPU by default."""
    spec = SpeculativeConfig(DRAFT, num_steps=steps) if steps else None
    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=1, cuda_graphs=True, speculative=spec,
                                         overlap_scheduling=overlap))
    _noop_replays(engine)
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=1)
    engine.generate(["def fib(n):\n    "], params)  # warm-up
    per = []
    rounds = 0
    for r in range(repeats):
        before = engine.stats().spec
        t = time.perf_counter()
        [out] = engine.generate([f"import os\nx = {r}\n"], params)
        wall = time.perf_counter() - t
        after = engine.stats().spec
        rounds = after.drafts - before.drafts if after and before else len(out.token_ids)
        per.append(1e6 * wall / rounds)
    per.sort()
    return {"steps": steps, "overlap": overlap, "temperature": temperature, "tokens": tokens, "repeats": repeats,
            "rounds": rounds,
            "us_per_round_median": round(per[len(per) // 2], 1), "us_per_round_spread": [round(per[0], 1),
                                                                                     round(per[-1], 1)]}


class OpCount:
    """Counts the torch ops dispatched while on; ``launches`` wraps a function so that it counts as the kernel
    launches its GPU path makes (its own ops on CPU not counted)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if not counter.paused:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()
        self.ops = 0
        self.paused = 0

    def launches(self, fn: Any, n: int) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += n
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return counted


# the GPU fast paths chosen at construction: (owner, attribute, kernel launches on a GPU)
GPU_PATHS = (("sampler", "at_temperature", 2), ("speculator", "_accept_at_temperature", 1),
             ("speculator", "_chain_outcomes", 1), ("speculator", "_restage", 1))


def op_counts(steps: int, tokens: int, temperature: float) -> dict[str, Any]:
    """Ops per round outside the replays (``--op-counts``), rounds in flight, batch 1, seeded at ``temperature``."""
    spec = SpeculativeConfig(DRAFT, num_steps=steps) if steps else None
    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=1, cuda_graphs=True, speculative=spec,
                                         overlap_scheduling=True))
    _noop_replays(engine)
    count = OpCount()
    counted = []
    for owner_name, attr, n in GPU_PATHS:
        owner = getattr(engine, owner_name, None)
        if owner is not None and hasattr(owner, attr):
            setattr(owner, attr, count.launches(getattr(owner, attr), n))
            counted.append(f"{owner_name}.{attr}")
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=1)
    engine.generate(["def fib(n):\n    "], params)  # warm-up
    before = engine.stats().spec
    with count.mode:
        [out] = engine.generate(["import os\nx = 1\n"], params)
    after = engine.stats().spec
    rounds = after.drafts - before.drafts if after and before else len(out.token_ids)
    return {"steps": steps, "temperature": temperature, "tokens": len(out.token_ids), "rounds": rounds,
            "ops": count.ops, "ops_per_round": round(count.ops / rounds, 1), "counted_as_launches": counted}


def replays(steps: int, calls: int = 3000, repeats: int = 5) -> dict[str, Any]:
    import statistics

    import torch

    from fusedserve.worker.executor.step import SeqRows, Step

    engine = Engine(TARGET, EngineConfig(num_blocks=64, max_num_seqs=1, cuda_graphs=True,
                                         speculative=SpeculativeConfig(DRAFT, num_steps=steps)))
    assert engine.speculator is not None
    target, draft = engine.executor, engine.speculator.draft
    _noop_replays(engine)
    table = tuple(range(10))
    verify = Step((SeqRows(table, tuple(range(steps + 1)), tuple(range(40, 41 + steps)), 41 + steps, steps + 1),))
    bases = Step((SeqRows(table, (0,) * (steps + 1), tuple(range(41, 42 + steps)), 42 + steps),))
    ids = torch.arange(steps + 1)
    aux = torch.zeros(steps + 1, 3 * int(json.loads((TARGET / "config.json").read_text())["hidden_size"]))
    drop = torch.tensor([steps // 2])

    def median_us(fn: Any) -> float:
        per = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t) / calls * 1e6)
        return round(statistics.median(per), 1)

    return {"steps": steps, "calls": calls, "repeats": repeats,
            "verify_run_us": median_us(lambda: target.run(verify, input_ids=ids)),
            "draft_run_first_chain_us": median_us(
                lambda: draft.run_first_chain(bases, aux, steps - 1, None, drop=drop, input_ids=ids))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--steps", type=int, default=5, help="chain steps (0: no speculation, a round = a token)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replays", action="store_true", help="time the two replays' host path alone (no-op replays)")
    ap.add_argument("--calls", type=int, default=3000, help="--replays: calls per timed repeat")
    ap.add_argument("--noop-rounds", action="store_true",
                    help="whole engine rounds with no-op replays (host time alone), with and without speculation")
    ap.add_argument("--op-counts", action="store_true",
                    help="torch ops a round dispatches outside its replays (rounds in flight, no-op replays)")
    args = ap.parse_args()
    numbers: Any
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.op_counts:
        numbers = [op_counts(s, args.tokens, t) for t in temperatures for s in (0, args.steps)]
        for row in numbers:
            print(f"T={row['temperature']:g} {'chain-' + str(row['steps']) if row['steps'] else 'none':8s}: "
                  f"{row['ops_per_round']} ops a round ({row['rounds']} rounds)", flush=True)
        what = ("torch ops dispatched per round outside the graph replays (rounds in flight, no-op replays), CPU; "
                f"package {Path(fusedserve.worker.__file__).parent}")
    elif args.noop_rounds:
        numbers = [noop_rounds(s, args.tokens, args.repeats, o, t) for t in temperatures for s, o in
                   ((0, False), (args.steps, False), (args.steps, True))]
        for row in numbers:
            name = ('chain-' + str(row['steps']) if row['steps'] else 'none') + (' in flight' if row['overlap'] else '')
            print(f"T={row['temperature']:g} {name:18s}: {row['us_per_round_median']} us a round (spread "
                  f"{row['us_per_round_spread']}, {row['rounds']} rounds), no-op replays", flush=True)
        what = "engine rounds with no-op replays (host time alone), CPU"
    elif args.replays:
        numbers = replays(args.steps, args.calls)
        print(f"chain-{args.steps}: verify StepExecutor.run {numbers['verify_run_us']} us, draft run_first_chain "
              f"{numbers['draft_run_first_chain_us']} us (host path, no-op replays)", flush=True)
        what = "host path of a round's two replays (no-op replays), CPU"
    if args.noop_rounds or args.replays or args.op_counts:
        if args.out:
            write_record({**record_header(), "what": what, "numbers": numbers}, args.out)
        return
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for steps in (0, args.steps):
            row = measure(temperature, steps, args.tokens, args.repeats)
            rows.append(row)
            print(f"T={temperature:g} {'chain-' + str(steps) if steps else 'none':8s}: host "
                  f"{row['host_ms_per_round_median']:.3f} ms a round (spread {row['host_ms_per_round_spread']}), "
                  f"{row['forwards_per_round']} forwards and {row['tokens_per_round']} tokens a round", flush=True)
    if args.out:
        write_record({**record_header(), "what": __doc__.strip().splitlines()[0], "numbers": rows}, args.out)


if __name__ == "__main__":
    main()
