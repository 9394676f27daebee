"""What handing a request's outputs to a serving thread costs the engine, without Ray and HTTP.

    python bench/output_handoff.py [--model examples/checkpoints/tiny-code] [--draft DIR [--steps 3]] [--tokens 300]
        [--reps 3] [--busy-us 0,100,300] [--out FILE]

One request at a time, batch 1, greedy, ``ignore_eos``: ms per generated token of
- ``direct``: ``Engine.generate`` on the calling thread (no other thread);
- ``final_only``: the engine behind ``LocalEngineClient`` (its own thread), the request submitted with
  ``final_only`` — what a response sent whole asks for: one output at the end;
- ``streamed``: the same, every step's outputs delivered to the consumer's event loop (an ``OutputChannel``,
  as a Ray group leader's output stream reads them) and turned into dicts there, as ``RankActor.outputs``
  does; ``streamed+Nus``: plus N µs of pure-Python work per delivery (what a Ray stream's yield adds).
The engine thread and the consumer share the process's GIL: on a host-bound step every delivery's Python
lands on the engine's step. Median of ``--reps`` runs. CPU by default (torch on one thread: several OpenMP
threads fight the engine thread and hide the effect); on a GPU machine the model's device.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.common import record_header, write_record

PROMPT = "def fibonacci(n):\n    "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "examples/checkpoints/tiny-code"))
    ap.add_argument("--draft", default=None, help="an EAGLE3 draft: a chain of --steps draft steps")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--busy-us", default="0,100,300")
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-output-handoff-cpu.json")
    args = ap.parse_args()

    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.serving.local_engine_client import LocalEngineClient
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    engine = Engine(args.model, EngineConfig(
        device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32", max_num_seqs=1, seed=0,
        speculative=SpeculativeConfig(args.draft, args.steps) if args.draft else None))
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up

    def direct() -> float:
        t = time.perf_counter()
        [c] = engine.generate([prompt], params)
        return (time.perf_counter() - t) / len(c.token_ids)

    client = LocalEngineClient(engine)
    counter = itertools.count()

    async def served(final_only: bool, busy_us: int) -> tuple[float, int]:
        channel = client.open_channel()
        t = time.perf_counter()
        await client.submit(prompt, params, f"r{next(counter)}", channel, final_only=final_only)
        tokens = deliveries = 0
        while channel.requests:
            items = [asdict(out) for out in await channel.next_batch()]  # as RankActor.outputs sends them
            deliveries += 1
            end = time.perf_counter() + busy_us * 1e-6
            while time.perf_counter() < end:
                pass
            tokens += sum(len(i.get("new_token_ids", ())) for i in items)
        return (time.perf_counter() - t) / tokens, deliveries

    rows: dict[str, Any] = {}
    try:
        cases: list[tuple[str, bool, int]] = [("final_only", True, 0)] + [
            ("streamed" + (f"+{b}us" if b else ""), False, b) for b in (int(x) for x in args.busy_us.split(","))]
        rows["direct"] = {"ms_per_token": round(1e3 * statistics.median(direct() for _ in range(args.reps)), 4)}
        for name, final_only, busy in cases:
            runs = [asyncio.run(served(final_only, busy)) for _ in range(args.reps)]
            rows[name] = {"ms_per_token": round(1e3 * statistics.median(r[0] for r in runs), 4),
                          "deliveries": runs[0][1]}
            print(f"{name:16s} {rows[name]['ms_per_token']:.3f} ms/token, {runs[0][1]} deliveries", flush=True)
    finally:
        client.close()
    base = rows["direct"]["ms_per_token"]
    for row in rows.values():
        row["over_direct_ms"] = round(row["ms_per_token"] - base, 4)
    record = {**record_header(), "what": __doc__.split("\n\n")[0], "model": args.model, "draft": args.draft,
              "steps": args.steps if args.draft else None,
              "tokens": args.tokens, "reps": args.reps, "rows": rows}
    print(f"wrote {write_record(record, args.out)}")


if __name__ == "__main__":
    main()
