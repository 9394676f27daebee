"""Host time of the streaming text a step makes: ``IncrementalDetokenizer.push`` per engine step, on CPU.

    python bench/detokenize_time.py [--model DIR] [--tokens 4000] [--repeats 5] [--out FILE]

Every engine step pushes each sequence's new tokens into its detokenizer, on the host between the step's
read-back and the next launch: one token a plain step, a speculative round's accepted tokens (chain-7 on
SmolLM2: ~3-3.6 a round) at once. The text is real (MT-bench questions and HumanEval prompts from
``.whl/real/data`` if packed, else a built-in paragraph) tokenized by the model's tokenizer (SmolLM2's
byte-level BPE by default: ``fusedserve fetch-model smollm2``), pushed k tokens at a time after a short prompt.
Two decoders: the fast tokenizer's own (what ``Tokenizer.decode`` takes where transformers adds nothing after
it) and transformers' ``decode`` around it (what it took before). Median of ``--repeats`` passes over the
stream, in microseconds per push; the machine's ``python_loop_ms`` says how fast its host is (the H200
leases' hosts read 7-17 ms against this one's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.worker.engine.detokenizer import IncrementalDetokenizer
from fusedserve.worker.engine.tokenizer import Tokenizer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.common import record_header, write_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".whl/real/data"
FALLBACK = ("Paris is the capital of France. It's known for the Eiffel Tower, café culture and museums — the "
            "Louvre holds ~35 000 works. def mean(xs):\n    return sum(xs) / len(xs)  # naïve 🙂\n") * 40


def corpus() -> str:
    texts: list[str] = []
    mt = DATA / "mt_bench.jsonl"
    if mt.is_file():
        texts += [t for line in mt.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    he = DATA / "HumanEval.jsonl.gz"
    if he.is_file():
        texts += [json.loads(line)["prompt"] for line in gzip.open(he, "rt") if line.strip()]
    return "\n\n".join(texts) or FALLBACK


def per_push_us(tok: Tokenizer, ids: list[int], k: int, repeats: int) -> float:
    prompt = tok.encode("Answer:")
    times = []
    for _ in range(repeats):
        d = IncrementalDetokenizer(tok, prompt)
        t = time.perf_counter()
        for i in range(0, len(ids), k):
            d.push(ids[i:i + k])
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / -(-len(ids) // k)


def main() -> None:
    from fusedserve.model_store import default_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_dir("smollm2")), help="a checkpoint directory with a tokenizer")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    direct = Tokenizer.from_dir(args.model)
    via_transformers = Tokenizer.from_dir(args.model)
    via_transformers._decode = via_transformers.hf.decode
    ids = direct.encode(corpus(), add_special_tokens=False)[:args.tokens]
    rows: list[dict[str, Any]] = []
    for k in (1, 3, 4, 8):
        row = {"tokens_per_push": k,
               "us_per_push_direct": round(per_push_us(direct, ids, k, args.repeats), 2),
               "us_per_push_transformers": round(per_push_us(via_transformers, ids, k, args.repeats), 2)}
        rows.append(row)
        print(row, flush=True)
    # before this change a push of k tokens decoded them one by one through transformers' decode
    one_by_one = rows[0]["us_per_push_transformers"]
    record = {**record_header(), "what": "IncrementalDetokenizer.push per engine step on the host (CPU), by tokens "
              f"per push, {len(ids)} tokens of real text, tokenizer of {args.model}",
              "tokens": len(ids), "numbers": rows,
              "before": {f"k={r['tokens_per_push']}": round(one_by_one * r["tokens_per_push"], 2) for r in rows}}
    if args.out:
        write_record(record, args.out)
    print(json.dumps({"before_us_per_push (k x one token via transformers)": record["before"]}))


if __name__ == "__main__":
    main()
