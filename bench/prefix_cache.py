"""Prefix caching on a repeated long system prompt: the same engine settings with caching on and off, in one run.

    python -P bench/prefix_cache.py [--model DIR] [--system-tokens 512] [--requests 8] [--reps 3] \
        [--out bench/results/<date>-prefix-cache-cpu.json]

Workload: every request is one long system prompt (a fixed text repeated to ``--system-tokens`` tokens) and
its own short question; greedy, ``ignore_eos``, ``--max-tokens`` new tokens. The questions of each repetition
are new (a number right after the system prompt), so only the system prompt can be shared. Per arm (caching
on, caching off; both engines built once, the repetitions alternate between them to share the machine's
noise) and repetition:

- ``sequential`` (engine API: ``Engine.add_request`` / ``step``): one request at a time; TTFT and
  end-to-end latency of the first (cold: the system prompt not cached yet in this repetition's arm, except
  from earlier repetitions) and of the later requests;
- ``concurrent`` (engine API): all requests at once; wall time, requests/s, output tokens/s, TTFT p50/max;
- ``http`` (the OpenAI HTTP server in front of the same engine, ``LocalEngineClient``, streaming
  ``/v1/completions``): one request at a time, TTFT.

The record holds every repetition's numbers and the median and relative spread ((max - min) / median) per
figure: that spread is the noise to read a difference against (on this shared 2-core machine other
processes run too; the load average at start and end is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, record_header, spread, write_record

progress = Progress("prefix_cache")
SYSTEM_TEXT = ("You are the support assistant of a small bakery in Lyon. Answer in one short sentence. Name prices "
               "in euros, never invent opening hours, and say so when you do not know. The bakery sells baguettes, "
               "croissants, pains au chocolat, rye bread, brioche and seasonal tarts; it takes orders by phone. ")


def default_model() -> str:
    from fusedserve.model_store import default_dir, is_complete, known

    smol = default_dir("smollm2")
    if is_complete(smol, known("smollm2")):
        return str(smol)
    return str(Path(__file__).resolve().parents[1] / "examples/checkpoints/tiny-code")


def system_prompt(tokenizer: Any, tokens: int) -> str:
    text = SYSTEM_TEXT
    while len(tokenizer.encode(text)) < tokens:
        text += SYSTEM_TEXT
    return text


def questions(rep: int, n: int) -> list[str]:
    topics = ("croissants", "rye bread", "opening hours", "a birthday cake", "gluten-free bread", "brioche",
              "delivery", "the price of a baguette")
    return [f"\nQuestion {rep}.{i}: what about {topics[i % len(topics)]}?\nAnswer:" for i in range(n)]


def sequential(engine: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    ttft: list[float] = []
    e2e: list[float] = []
    for p in prompts:
        t0 = time.perf_counter()
        engine.add_request(p, params)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first = time.perf_counter() - t0
        ttft.append(first or 0.0)
        e2e.append(time.perf_counter() - t0)
    return {"ttft_first_s": ttft[0], "ttft_later_mean_s": statistics.mean(ttft[1:]),
            "e2e_first_s": e2e[0], "e2e_later_mean_s": statistics.mean(e2e[1:])}


def concurrent(engine: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    ttfts = sorted(first[i] for i in ids)
    return {"wall_s": wall, "requests_per_s": len(ids) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1]}


def http_sequential(engine: Any, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from bench.serve_load import http_sender
    from fusedserve.worker.serving.http_api import build_app
    from fusedserve.worker.serving.http_server import HttpServer
    from fusedserve.worker.serving.local_engine_client import LocalEngineClient
    from fusedserve.worker.serving.metrics import MetricsRegistry

    client = LocalEngineClient(engine, {}, model_name=model)
    server = HttpServer(build_app(client, MetricsRegistry({}, model))).start()
    try:
        tokenizer = engine.tokenizer
        send = http_sender(server.url, model)

        async def run() -> list[Any]:
            return [await send(tokenizer.encode(p), max_tokens) for p in prompts]

        results = asyncio.run(run())
        if not all(r.ok for r in results):
            raise RuntimeError(f"HTTP requests failed: {[r.error for r in results if not r.ok]}")
        return {"ttft_first_s": results[0].ttft, "ttft_later_mean_s": statistics.mean(r.ttft for r in results[1:])}
    finally:
        server.stop()
        client.close()


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in reps[0]:
        out[phase] = {k: spread([r[phase][k] for r in reps]) for k in reps[0][phase]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2 if cached, else tiny-code)")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model()
    header = record_header()
    load_start = os.getloadavg()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {}
    for arm, caching in (("caching_on", True), ("caching_off", False)):
        per_seq = -(-(args.system_tokens + 64 + args.max_tokens) // args.block_size)
        engines[arm] = Engine(model, EngineConfig(num_blocks=per_seq * (args.requests + 2), block_size=args.block_size,
                                                  max_num_seqs=max(args.requests, 1), max_batch_tokens=8192,
                                                  enable_prefix_caching=caching))
    tokenizer = engines["caching_on"].tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    system_tokens = len(tokenizer.encode(system))
    progress(f"{model}: system prompt {system_tokens} tokens, {args.requests} requests x {args.reps} reps")
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in engines}
    rep_index = 0
    for rep in range(args.reps):
        for arm in (("caching_on", "caching_off") if rep % 2 == 0 else ("caching_off", "caching_on")):
            engine = engines[arm]
            rep_index += 1
            seq = sequential(engine, [system + q for q in questions(3 * rep_index, args.requests)], params)
            conc = concurrent(engine, [system + q for q in questions(3 * rep_index + 1, args.requests)], params)
            runs[arm].append({"sequential": seq, "concurrent": conc})
            progress(f"rep {rep} {arm}: sequential TTFT later {seq['ttft_later_mean_s'] * 1000:.1f} ms, "
                     f"concurrent {conc['requests_per_s']:.2f} req/s")
    stats = {arm: engines[arm].stats() for arm in engines}
    http: dict[str, Any] = {}
    if not args.no_http:  # last: the HTTP server's engine thread then owns the engine
        for arm, engine in engines.items():
            http[arm] = http_sequential(engine, "bench", [system + q for q in questions(999, args.requests)],
                                        args.max_tokens)
            progress(f"http {arm}: TTFT later {http[arm]['ttft_later_mean_s'] * 1000:.1f} ms")
    summary = {arm: summarize(r) for arm, r in runs.items()}

    def ratio(phase: str, key: str) -> float:
        return summary["caching_off"][phase][key]["median"] / summary["caching_on"][phase][key]["median"]

    record = {
        **header,
        "what": (f"{Path(model).name}, fp32, greedy ignore_eos, {args.max_tokens} new tokens; each request = one "
                 f"system prompt of {system_tokens} tokens + its own ~15-token question; block size "
                 f"{args.block_size}; CPU: the numbers are what prefix caching saves in prefill on this machine, "
                 "not GPU figures"),
        "load_average_1_5_15min": {"start": [round(x, 2) for x in load_start],
                                   "end": [round(x, 2) for x in os.getloadavg()]},
        "torch_threads": torch.get_num_threads(),
        "requests_per_rep": args.requests, "reps": args.reps,
        "prefix_cache": {arm: {"queries_tokens": s.prefix_cache_queries, "hits_tokens": s.prefix_cache_hits,
                               "hit_rate": round(s.prefix_cache_hits / s.prefix_cache_queries, 4)
                               if s.prefix_cache_queries else None} for arm, s in stats.items()},
        "speedup_off_over_on": {
            "sequential_ttft_later": round(ratio("sequential", "ttft_later_mean_s"), 3),
            "sequential_e2e_later": round(ratio("sequential", "e2e_later_mean_s"), 3),
            "concurrent_wall": round(ratio("concurrent", "wall_s"), 3),
            "concurrent_ttft_p50": round(ratio("concurrent", "ttft_p50_s"), 3),
        },
        "summary": summary,
        "http_sequential": http,
        "runs": runs,
    }
    if http:
        record["speedup_off_over_on"]["http_ttft_later"] = round(
            http["caching_off"]["ttft_later_mean_s"] / http["caching_on"]["ttft_later_mean_s"], 3)
    out = args.out or f"bench/results/{header['date']}-prefix-cache-cpu.json"
    progress(f"speedup (off / on): {record['speedup_off_over_on']}; written to {write_record(record, out)}")


if __name__ == "__main__":
    main()
