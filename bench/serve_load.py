"""Served load benchmark in the style of sglang's ``bench_serving`` / vLLM's ``benchmark_serving``.

    # against `fusedserve run` (Ray + HTTP):
    python -P bench/serve_load.py --url http://127.0.0.1:8123 --model llama-8b-shape \
        --requests .whl/sharegpt-requests.json --out $OUT/serve-http.json
    # against the engine in-process (the same engine, no Ray, no HTTP):
    python -P bench/serve_load.py --in-process /tmp/llama-8b-shape --requests ... --out $OUT/serve-engine.json

Requests are ShareGPT conversations as token ids (``bench/sharegpt_subset.py``): prompt = the first
human turn, ``max_tokens`` = the first answer's length, greedy, ``ignore_eos`` (so every request
generates exactly its output length). For each request rate of ``--rates`` (requests/s, Poisson
arrivals; ``inf`` = all at once) ``rate x --duration`` requests are sent (``--num-inf`` at ``inf``);
per rate: completed / failed, request and output-token throughput, and TTFT, inter-token latency
(between streamed chunks) and end-to-end latency p50 / p90 / p99 in ms. HTTP requests stream
(``/v1/completions``, ``stream_options.include_usage``); in-process requests stream from
``LocalEngineClient.generate``, the engine thread the HTTP server itself uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import Progress, record_header, write_record  # noqa: E402

progress = Progress("serve_load")


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


Send = Callable[[list[int], int], Awaitable[Result]]


def http_sender(url: str, model: str) -> Send:
    import httpx

    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1024))

    async def send(prompt: list[int], max_tokens: int) -> Result:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        r = Result()
        start = last = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        r.tokens = int(chunk["usage"]["completion_tokens"])
                    if chunk.get("choices"):
                        now = time.perf_counter()
                        if r.ttft == 0.0:
                            r.ttft = now - start
                        else:
                            r.itl.append(now - last)
                        last = now
            r.e2e = time.perf_counter() - start
            r.ok = r.tokens > 0
        except Exception as e:  # noqa: BLE001 (a failed request is a result)
            r.error = f"{type(e).__name__}: {e}"
        return r

    return send


def engine_sender(model_dir: str, max_num_seqs: int) -> tuple[Send, Any]:
    import torch

    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.serving.local_engine_client import LocalEngineClient

    cuda = torch.cuda.is_available()
    engine = Engine(model_dir, EngineConfig(device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                                            load_format="dummy", seed=0, skip_tokenizer=True,
                                            max_num_seqs=max_num_seqs, kv_memory_fraction=0.9 if cuda else 0.5))
    client = LocalEngineClient(engine, {})
    counter = iter(range(1 << 30))

    async def send(prompt: list[int], max_tokens: int) -> Result:
        r = Result()
        start = last = time.perf_counter()
        try:
            stream: AsyncIterator[Any] = client.generate(
                prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), f"r{next(counter)}")
            async for out in stream:
                if out.new_token_ids:
                    now = time.perf_counter()
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.tokens += len(out.new_token_ids)
            r.e2e = time.perf_counter() - start
            r.ok = r.tokens > 0
        except Exception as e:  # noqa: BLE001
            r.error = f"{type(e).__name__}: {e}"
        return r

    return send, client


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return 1000 * s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def run_rate(send: Send, reqs: list[dict[str, Any]], rate: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for r in reqs:
        tasks.append(asyncio.create_task(send(r["prompt_ids"], r["output_len"])))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    itl = [x for r in ok for x in r.itl]
    out = {"rate": "inf" if rate == float("inf") else rate, "requests": len(reqs), "completed": len(ok),
           "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
           "duration_s": wall, "request_throughput": len(ok) / wall, "output_tok_per_s": tokens / wall,
           "input_tok_per_s": sum(len(q["prompt_ids"]) for q in reqs) / wall}
    for name, vals in (("ttft", [r.ttft for r in ok]), ("itl", itl), ("e2e", [r.e2e for r in ok])):
        for q in (0.5, 0.9, 0.99):
            out[f"{name}_p{int(q * 100)}_ms"] = pct(vals, q)
    return out


async def sweep(send: Send, reqs: list[dict[str, Any]], rates: list[float], duration: float,
                num_inf: int) -> list[dict[str, Any]]:
    rows = []
    await run_rate(send, reqs[:4], float("inf"), 0)  # warm-up
    for i, rate in enumerate(rates):
        n = num_inf if rate == float("inf") else max(4, int(rate * duration))
        rng = random.Random(f"rate {rate}")  # a rate's requests do not depend on the other rates swept
        batch = [reqs[rng.randrange(len(reqs))] for _ in range(n)]
        row = await run_rate(send, batch, rate, i)
        rows.append(row)
        progress(f"rate {row['rate']}: {row['completed']}/{row['requests']} ok, {row['output_tok_per_s']:.0f} out tok/s, "
                 f"TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} "
                 f"p99 {row['itl_p99_ms']:.1f} ms")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model", default="default")
    ap.add_argument("--in-process", help="a checkpoint directory (config.json: dummy weights) served in-process")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--requests", required=True, help="bench/sharegpt_subset.py output")
    ap.add_argument("--rates", default="2,4,8,16,inf")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per finite rate")
    ap.add_argument("--num-inf", type=int, default=200)
    ap.add_argument("--max-output", type=int, default=0, help="cap output lengths (0 = as the dataset says)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = json.loads(Path(args.requests).read_text())
    reqs = data["requests"]
    if args.max_output:
        reqs = [{**r, "output_len": min(r["output_len"], args.max_output)} for r in reqs]
    rates = [float(r) for r in args.rates.split(",")]
    client = None
    if args.in_process:
        send, client = engine_sender(args.in_process, args.max_num_seqs)
        target = f"engine in-process ({args.in_process})"
    elif args.url:
        send = http_sender(args.url, args.model)
        target = f"fusedserve run at {args.url} (Ray + HTTP)"
    else:
        raise SystemExit("give --url or --in-process")
    rows = asyncio.run(sweep(send, reqs, rates, args.duration, args.num_inf))
    if client is not None:
        client.close()
    record = {**record_header(), "target": target, "dataset": data["meta"], "max_output": args.max_output,
              "rates": rows}
    write_record(record, args.out)
    progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
