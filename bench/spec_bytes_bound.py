"""Issue #15: how fast EAGLE3 speculation could be over plain decoding if every step read only its bytes.

    python bench/spec_bytes_bound.py --target DIR --draft DIR --acceptance chain-7=3.085 tree-s6-k4-t16=3.81
        [--context 450] [--measured plain=0.483 chain-7=0.914] [--out FILE]

No GPU, no weights: the counts come from the two ``config.json`` files (a Llama-family target and its
``LlamaForCausalLMEagle3`` draft). At batch 1 a decode step of a small model is bound by its kernels' latency or
by its bytes, whichever is more; this is the second bound, the best case for speculation, since every row a
verify or a tree step adds is free when a step costs only its bytes.

Bytes a step reads, in the serving dtype (``--dtype-bytes``, 2 for bf16):
- a plain step: every target weight once (the LM head whole, tied or not; the embedding only its row) and the
  K/V of ``--context`` cached tokens in every layer;
- a verify of T rows: the same (the T rows' own K/V are written, not read from memory);
- the draft's first pass: the draft layer, its ``fc`` (the three aux states down to one) and head, and the
  draft's K/V of the context;
- each later draft step: the layer and head without ``fc``; a tree step over K leaves reads the weights once.

A round of ``chain-N`` is one verify of N + 1 rows, the first pass and N - 1 draft steps; ``tree-sS-kK-tT`` one
verify of T rows, the first pass and S - 1 steps. The bound speed-up of a configuration is its acceptance length
(tokens a round) times a plain step's bytes over a round's. ``--measured`` adds what a GPU took (a plain step and
each configuration's round, ms, from a record): their ratio is the latency regime the bound leaves out.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

GOAL = 2.0


def _config(path: str) -> dict[str, Any]:
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def target_bytes(cfg: dict[str, Any], context: int, dtype_bytes: int) -> dict[str, int]:
    """A Llama-family target's per-step reads: weights (layers, final norm, LM head) and K/V at ``context``."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * h * inter
    layer = attn + mlp + 2 * h
    weights = (layers * layer + h + cfg["vocab_size"] * h) * dtype_bytes
    kv = layers * context * 2 * kv_heads * head_dim * dtype_bytes
    return {"weights": weights, "kv": kv, "step": weights + kv}


def draft_bytes(cfg: dict[str, Any], context: int, dtype_bytes: int) -> dict[str, int]:
    """An EAGLE3 draft's reads: one layer whose q / k / v take [embedding; hidden] (2 x hidden wide), its head over
    the draft vocabulary, ``fc`` (3 x target hidden -> hidden) in the first pass only, and its one layer's K/V."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or h // heads
    target_h = cfg.get("target_hidden_size") or h
    vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim * 2 + heads * head_dim * h
    layer = attn + 3 * h * inter + 4 * h
    step = (layer + vocab * h) * dtype_bytes + context * 2 * kv_heads * head_dim * dtype_bytes
    fc = 3 * target_h * h * dtype_bytes
    return {"step": step, "fc": fc, "first_pass": step + fc}


def parse_config(name: str) -> tuple[int, int, int]:
    """(draft forwards after the first pass, rows a step, verified rows) of ``chain-N`` or ``tree-sS-kK-tT``."""
    m = re.fullmatch(r"chain-(\d+)", name)
    if m:
        n = int(m.group(1))
        return n - 1, 1, n + 1
    m = re.fullmatch(r"tree-s(\d+)-k(\d+)-t(\d+)", name)
    if m:
        return int(m.group(1)) - 1, int(m.group(2)), int(m.group(3))
    raise ValueError(f"unknown configuration {name!r}: chain-N or tree-sS-kK-tT")


def bound(target: dict[str, int], draft: dict[str, int], name: str, acceptance: float) -> dict[str, Any]:
    steps, rows, verified = parse_config(name)
    round_bytes = target["step"] + draft["first_pass"] + steps * draft["step"]
    ratio = round_bytes / target["step"]
    return {"draft_steps_after_first_pass": steps, "rows_a_step": rows, "verified_rows": verified,
            "acceptance": acceptance, "round_over_plain_bytes": round(ratio, 4),
            "speedup_bound": round(acceptance / ratio, 3),
            "acceptance_for_goal": round(GOAL * ratio, 3)}


def pairs(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's checkpoint folder or config.json")
    ap.add_argument("--draft", required=True, help="the EAGLE3 draft's checkpoint folder or config.json")
    ap.add_argument("--acceptance", nargs="+", required=True, metavar="CONFIG=LENGTH")
    ap.add_argument("--measured", nargs="*", default=[], metavar="NAME=MS",
                    help="plain=MS (a plain step) and CONFIG=MS (its round), from a GPU record")
    ap.add_argument("--context", type=int, default=450, help="cached tokens a step reads (prompt + half the output)")
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t = target_bytes(_config(args.target), args.context, args.dtype_bytes)
    d = draft_bytes(_config(args.draft), args.context, args.dtype_bytes)
    measured = pairs(args.measured)
    rows = {}
    for name, acc in pairs(args.acceptance).items():
        rows[name] = bound(t, d, name, acc)
        if "plain" in measured and name in measured:
            ratio = measured[name] / measured["plain"]
            rows[name]["measured_round_over_plain"] = round(ratio, 4)
            rows[name]["measured_speedup"] = round(acc / ratio, 3)
    record = {"target": args.target, "draft": args.draft, "context": args.context, "dtype_bytes": args.dtype_bytes,
              "plain_step_bytes": t, "draft_bytes": d,
              "draft_step_over_plain_step": round(d["step"] / t["step"], 4), "configs": rows}
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
