"""EAGLE3 speculative decoding on CPU with the tiny pair: acceptance length and tokens/s.

    python bench/spec_decode_cpu.py [--prompts 24] [--prompt-len 64] [--new-tokens 64] [--threads 1]
                                    [--repeats 3] [--out bench/results/<date>-spec-decode-cpu.json]

Prompts are the first ``--prompt-len`` tokens of the held-out standard-library files of this
interpreter (``bench.train_tiny_pair.stdlib_files``: never seen by the target or the draft),
generated greedily (``ignore_eos``) with examples/checkpoints/tiny-code and its EAGLE3 draft:
without speculation, chains of 3, 4 and 5 steps, and a tree (topk 4, 4 steps, 8 verified
tokens). Each configuration runs every prompt at batch 1 and at batch 8 (a fresh engine per
run, after one warm-up generation in the process); tokens/s = generated tokens / wall time of
the run, the fastest of ``--repeats`` (interleaved over the configurations). Acceptance length =
1 + accepted / drafts (vLLM), over the batch-8 run's verify steps.
A line per finished prompt goes to stderr; the record is written as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams
from fusedserve.worker.spec_decode.config import SpeculativeConfig
from fusedserve.worker.spec_decode.stats import SpecDecodeStats

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.*, after the installed package is imported (bench/common.py says why)

from bench.train_tiny_pair import read, stdlib_files

TARGET = ROOT / "examples/checkpoints/tiny-code"
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
CONFIGS: dict[str, SpeculativeConfig | None] = {
    "none": None,
    "chain-3": SpeculativeConfig(DRAFT, num_steps=3),
    "chain-4": SpeculativeConfig(DRAFT, num_steps=4),
    "chain-5": SpeculativeConfig(DRAFT, num_steps=5),
    "tree-topk4-steps4-tokens8": SpeculativeConfig(DRAFT, num_steps=4, topk=4, num_draft_tokens=8),
}


def heldout_prompts(count: int, length: int) -> tuple[list[list[int]], list[str]]:
    from fusedserve.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(TARGET)
    _train, held = stdlib_files()
    prompts, names = [], []
    for path in held:
        texts = read([path])
        ids = tok.encode(texts[0]) if texts else []
        if len(ids) >= length:
            prompts.append(ids[:length])
            names.append(str(path.relative_to(sysconfig.get_paths()["stdlib"])))
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} held-out files have {length} tokens")
    return prompts, names


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]
    spec: SpecDecodeStats | None

    @property
    def tokens_per_s(self) -> float:
        return round(sum(len(t) for t in self.outputs) / self.seconds, 1)


def run(label: str, spec: SpeculativeConfig | None, prompts: list[list[int]], batch: int,
        params: SamplingParams) -> Run:
    engine = Engine(TARGET, EngineConfig(num_blocks=160, max_num_seqs=batch, speculative=spec))
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[ids[out.request_id]] += out.new_token_ids
            if out.finished:
                done += 1
                print(f"[{label} batch {batch}] prompt {ids[out.request_id] + 1:2d} done ({done}/{len(prompts)}), "
                      f"{time.perf_counter() - start:6.2f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    return Run(seconds, [tokens[i] for i in range(len(prompts))], engine.stats().spec)


def summary(b1: Run, b8: Run, base1: Run, base8: Run) -> dict[str, object]:
    row: dict[str, object] = {
        "tokens_per_s_batch1": b1.tokens_per_s, "tokens_per_s_batch8": b8.tokens_per_s,
        "speedup_batch1": round(b1.tokens_per_s / base1.tokens_per_s, 3),
        "speedup_batch8": round(b8.tokens_per_s / base8.tokens_per_s, 3),
        "greedy_equal_to_no_speculation": b1.outputs == base1.outputs and b8.outputs == base8.outputs,
        "seconds_batch1": round(b1.seconds, 3), "seconds_batch8": round(b8.seconds, 3),
    }
    if b8.spec is not None and b1.spec is not None:
        s = b8.spec
        row["acceptance_length"] = round(s.acceptance_length, 4)
        row["acceptance_rate"] = round(s.acceptance_rate, 4)
        row["acceptance_rate_per_position"] = [round(n / s.drafts, 4) for n in s.accepted_per_position]
        row["spec_counters_batch8"] = s.to_dict()
        row["acceptance_length_batch1"] = round(b1.spec.acceptance_length, 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the fastest counts")
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-spec-decode-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    prompts, names = heldout_prompts(args.prompts, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    times: dict[str, list[list[float]]] = {}
    Engine(TARGET, EngineConfig(num_blocks=16, speculative=CONFIGS["chain-3"])).generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    # Repeats are interleaved over the configurations, so a busy moment of the machine hits them
    # alike; each configuration keeps its fastest run (outputs and counters are the same every time).
    runs: dict[str, tuple[Run, Run]] = {}
    for _ in range(args.repeats):
        for label, spec in CONFIGS.items():
            new = (run(label, spec, prompts, 1, params), run(label, spec, prompts, 8, params))
            old = runs.get(label, new)
            runs[label] = (min(old[0], new[0], key=lambda r: r.seconds), min(old[1], new[1], key=lambda r: r.seconds))
            times.setdefault(label, []).append([round(new[0].seconds, 3), round(new[1].seconds, 3)])
    base1, base8 = runs["none"]
    numbers: dict[str, object] = {}
    for label, (b1, b8) in runs.items():
        numbers[label] = row = summary(b1, b8, base1, base8)
        row["all_runs_seconds_batch1_batch8"] = times[label]
        print(f"{label:28s} {json.dumps(row)}", file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    record = {
        "date": str(datetime.date.today()),
        "machine": f"{platform.node()}: nproc {len(os.sched_getaffinity(0))}, CPU {cpu}, "
                   f"{torch.get_num_threads()} torch thread(s)",
        "software": f"Python {platform.python_version()}, torch {torch.__version__}",
        "load_average_1_5_15min": {"start": [round(x, 2) for x in load_start],
                                   "end": [round(x, 2) for x in os.getloadavg()]},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "what": "tiny-code + tiny-code-eagle3, fp32 CPU, greedy ignore_eos; prompts = first "
                f"{args.prompt_len} tokens of {len(prompts)} held-out stdlib files, {args.new_tokens} new tokens each",
        "prompt_files": names,
        "numbers": numbers,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
