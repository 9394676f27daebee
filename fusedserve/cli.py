"""The `fusedserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _verify(args: argparse.Namespace) -> int:
    from fusedserve.verify import VerifyError, VerifyOptions, load_prompts_file, run_verify

    try:
        opts = VerifyOptions(
            model=args.model, tp=args.tp, dp=args.dp, ep=args.ep, fusion=args.fusion, oracle=args.oracle,
            dtype=args.dtype, prompts=load_prompts_file(args.prompts) if args.prompts else None,
            tolerance=args.tolerance, dp_padding=args.dp_padding,
        )
        report = run_verify(opts)
    except VerifyError as e:
        print(f"fusedserve verify: error: {e}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.ok else 1


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
    v.add_argument("--oracle", default="hf", choices=["hf", "tp1"],
                   help="compare with HF transformers or with our own tp=1 run (default hf)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    v.add_argument("--prompts", help="JSON file: a list of token-id lists")
    v.add_argument("--tolerance", type=float, help="max abs logit difference (default 1e-4 fp32, 1e-1 bf16)")
    v.add_argument("--dp-padding", default="auto", choices=["auto", "max_len", "sum_len"],
                   help="DP attention token padding (default: chosen per forward as sglang does)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_verify)
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
