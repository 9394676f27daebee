"""`fusedserve-operator`: runs the kopf operator for InferenceDeployments.

    fusedserve-operator --all-namespaces --metrics-port 8080 --health-port 8081 --standalone
    fusedserve-operator --namespace team-a --namespace team-b

Liveness: ``http://<listen-address>:<health-port>/healthz`` (kopf's probe endpoint). Metrics: operator/metrics.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .operator_config import ENV_PREFIX


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusedserve-operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    where.add_argument("-n", "--namespace", action="append", help="watch this namespace (repeatable)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    p.add_argument("--health-port", type=int, help="serve the liveness probe on this port (/healthz)")
    p.add_argument("--listen-address", default="0.0.0.0",
                   help="address of the metrics and health endpoints (default 0.0.0.0; 127.0.0.1 for local runs)")
    p.add_argument("--standalone", action="store_true",
                   help="no peering with other operator instances (run one replica)")
    p.add_argument("--status-interval", type=float, help="seconds between status mirrors (default 10)")
    p.add_argument("--status-url-template",
                   help='where group controllers serve /status (default "http://{service}.{namespace}.svc:{port}/status")')
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Settings travel through the environment so `kopf run -m fusedserve.operator.handlers` reads the same.
    for flag, key in ((args.metrics_port, "METRICS_PORT"), (args.status_interval, "STATUS_INTERVAL"),
                      (args.status_url_template, "STATUS_URL_TEMPLATE"), (args.listen_address, "LISTEN_ADDRESS")):
        if flag is not None:
            os.environ[ENV_PREFIX + key] = str(flag)
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    liveness = f"http://{args.listen_address}:{args.health_port}/healthz" if args.health_port else None
    kopf.run(standalone=args.standalone, clusterwide=bool(args.all_namespaces),
             namespaces=args.namespace or (), liveness_endpoint=liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
