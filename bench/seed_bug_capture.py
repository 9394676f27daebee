"""Seed bug 1 measured: EAGLE3 acceptance with the aux states captured after vs before the input-side
completion (sglang before PR #28343), same prompts, tp ranks with the reference fused all-reduce.

    python bench/seed_bug_capture.py --target SMOLLM2_DIR --draft DRAFT_DIR [--tp 3] [--mtbench 24]
        [--humaneval 24] [--max-new-tokens 96] [--steps 5] [--out FILE]
    python bench/seed_bug_capture.py --tiny      # the tiny pair at tp=2 (its 4 heads), a few prompts

Each capture runs one engine group of ``--tp`` ranks on CPU (gloo; ``run_engine_group``, the product's
multi-rank engine) with ``fusion="reference"``: every MLP sum is deferred into the next layer's fused
all-reduce + add + RMSNorm. The benchmark-only model keyword ``aux_capture`` (``models/decoder_stack.py``,
through ``build_rank(**model_kwargs)`` like ``dp_combine``; no spec or CLI reaches it) picks the capture:
``complete`` (the rule: the residual after the boundary) or ``before_completion`` (``partial + residual``
in front of it: each rank's own partial sum). Prompts: MT-bench first turns and HumanEval problems as
chat messages, greedy (the tokens must be the same both ways: verification is exact; only acceptance
may differ), batch 1, chain drafting of ``--steps``. Per prompt the engine's counters give drafts and
accepted tokens; the record has per-set pooled acceptance length, per-prompt spread, bootstrap
intervals and the paired difference (``bench/acceptance_stats.py``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.acceptance_stats import paired, summary
from bench.common import Progress, record_header, write_record
from bench.real_prompts import DEFAULT_DIR, humaneval, mtbench

CAPTURES = ("complete", "before_completion")
progress = Progress("seed_bug_capture")


def _rank(rank: int, world: int, backend: str, args: dict[str, Any], sets: dict[str, list[list[int]]],
          capture: str) -> dict[str, list[tuple[int, int, list[int]]]] | None:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.parallel.rank import run_engine_group
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    config = EngineConfig(num_blocks=args["num_blocks"], max_num_seqs=1, skip_tokenizer=True,
                          speculative=SpeculativeConfig(args["draft"], num_steps=args["steps"]))

    def lead(engine: Any) -> dict[str, list[tuple[int, int, list[int]]]]:
        out: dict[str, list[tuple[int, int, list[int]]]] = {}
        params = SamplingParams(temperature=0.0, max_tokens=args["max_new_tokens"])
        for name, prompts in sets.items():
            rows = out[name] = []
            for i, p in enumerate(prompts):
                before = engine.stats().spec
                [c] = engine.generate([p], params)
                after = engine.stats().spec
                rows.append((after.drafts - before.drafts, after.accepted_tokens - before.accepted_tokens,
                             c.token_ids))
                if (i + 1) % 4 == 0 or i + 1 == len(prompts):
                    progress(f"{capture}: {name} {i + 1}/{len(prompts)} prompts")
        return out

    return run_engine_group(rank, world, backend, args["target"], config, lead, fusion="reference",
                            aux_capture=capture)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--data-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--mtbench", type=int, default=24)
    ap.add_argument("--humaneval", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="the tiny pair at tp=2, 3 + 3 prompts, 24 new tokens")
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-seed-bug-capture-cpu.json")
    args = ap.parse_args()
    if args.tiny:
        args.target = args.target or str(ROOT / "examples/checkpoints/tiny-code")
        args.draft = args.draft or str(ROOT / "examples/checkpoints/tiny-code-eagle3")
        args.tp, args.max_new_tokens = 2, min(args.max_new_tokens, 24)
        args.mtbench, args.humaneval = min(args.mtbench, 3), min(args.humaneval, 3)
    if not args.target or not args.draft:
        ap.error("--target and --draft are needed (or --tiny)")
    from fusedserve.models.loader import load_config
    from fusedserve.models.parallel.groups import ParallelConfig
    from fusedserve.models.split_check import check_split
    from fusedserve.worker.engine.tokenizer import Tokenizer
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    check_split(load_config(args.target), ParallelConfig(args.tp))
    tok = Tokenizer.from_dir(args.target)
    sets = {"mtbench": [tok.encode_chat([{"role": "user", "content": t[0]}])
                        for _, _, t in mtbench(args.data_dir, args.mtbench)],
            "humaneval": [tok.encode_chat([{"role": "user", "content": p}]) for _, p in humaneval(args.data_dir,
                                                                                                 args.humaneval)]}
    sets = {k: v for k, v in sets.items() if v}
    plain = dict(vars(args))
    results: dict[str, dict[str, list[tuple[int, int, list[int]]]]] = {}
    for capture in CAPTURES:
        progress(f"{capture}: {', '.join(f'{k} {len(v)}' for k, v in sets.items())} prompts at tp={args.tp} "
                 "(reference fused all-reduce)")
        results[capture] = run_on_ranks(_rank, args.tp, plain, sets, capture, timeout_s=3600)[0]
    numbers: dict[str, Any] = {}
    for name in sets:
        good = [(d, a) for d, a, _ in results["complete"][name]]
        bad = [(d, a) for d, a, _ in results["before_completion"][name]]
        numbers[name] = {
            "complete": summary(good), "before_completion": summary(bad),
            "before_completion_vs_complete": paired(good, bad),
            "same_tokens": [t for _, _, t in results["complete"][name]] ==
                           [t for _, _, t in results["before_completion"][name]],
        }
        progress(f"{name}: acceptance length complete {numbers[name]['complete']['acceptance_length']:.3f}, "
                 f"before completion {numbers[name]['before_completion']['acceptance_length']:.3f}")
    record = {**record_header(), "what": f"EAGLE3 chain-{args.steps}, greedy, batch 1, {args.max_new_tokens} new "
              f"tokens; target {args.target}, draft {args.draft}; tp={args.tp} on CPU (gloo), reference fused "
              "all-reduce + add + RMSNorm (MLP sums deferred into the next layer's input norm); aux states captured "
              "after the boundary (complete) vs before it (before_completion, sglang before PR #28343)",
              "peers": {"sglang_pr_28343": "fix raised acceptance length by 0.3-4.2% (MT-Bench +2.5%, HumanEval "
                                            "+3.1%) on Kimi K2.5 + EAGLE3 with TP and all-reduce fusion"},
              "numbers": numbers}
    path = write_record(record, args.out)
    progress(f"wrote {path}")


if __name__ == "__main__":
    main()
