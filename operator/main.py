"""`fusedserve-operator`: runs the kopf operator for InferenceDeployments.

    fusedserve-operator --all-namespaces --metrics-port 8080 --health-port 8081
    fusedserve-operator --namespace team-a --namespace team-b
    fusedserve-operator --all-namespaces --standalone          # one process, no peering (development)

Availability: replicas peer through kopf's peering object (``ClusterKopfPeering`` when watching every
namespace, a ``KopfPeering`` per watched namespace otherwise; created here when missing, its CRDs come
with the chart). Each process takes a random priority; the highest live one works, the others wait
paused and take over ``--peering-lifetime`` seconds after it stops renewing its entry. Reconciles are
idempotent (server-side apply of deterministically named children), so a replica taking over mid-way
continues where the other stopped.

Liveness and readiness: ``http://<listen-address>:<health-port>/healthz`` (kopf's probe endpoint).
Metrics: operator/metrics.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys

from .operator_config import ENV_PREFIX

PEERING_NAME = "fusedserve"
PRIORITY_RANGE = (1, 2**31 - 1)  # random per process: two peers of equal priority would both pause


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusedserve-operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    where.add_argument("-n", "--namespace", action="append", help="watch this namespace (repeatable)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    p.add_argument("--health-port", type=int, help="serve the liveness/readiness probe on this port (/healthz)")
    p.add_argument("--listen-address", default="0.0.0.0",
                   help="address of the metrics and health endpoints (default 0.0.0.0; 127.0.0.1 for local runs)")
    p.add_argument("--standalone", action="store_true",
                   help="no peering with other operator instances (run one replica)")
    p.add_argument("--peering", default=PEERING_NAME, help=f"name of the peering object (default {PEERING_NAME})")
    p.add_argument("--priority", type=int, help="peering priority (default: random, so one replica is active)")
    p.add_argument("--peering-lifetime", type=int,
                   help="seconds after which a silent peer is presumed gone and another takes over (default 15)")
    p.add_argument("--status-interval", type=float, help="seconds between status mirrors (default 10)")
    p.add_argument("--status-url-template",
                   help='where group controllers serve /status (default '
                        '"http://{cluster}-head-svc.{namespace}.svc:{port}/status")')
    p.add_argument("--worker-image", help="spec.image of InferenceDeployments that set none")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def ensure_peering(name: str, namespaces: list[str] | None) -> None:
    """Create the peering object(s) kopf will use, when missing (kopf does not create them)."""
    from .kube_client import KubeClient

    kube = KubeClient()
    if namespaces:
        objs = [{"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}}
                for ns in namespaces]
    else:
        objs = [{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    for obj in objs:
        kube.create(obj)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Settings travel through the environment so `kopf run -m fusedserve.operator.handlers` reads the same.
    for flag, key in ((args.metrics_port, "METRICS_PORT"), (args.status_interval, "STATUS_INTERVAL"),
                      (args.status_url_template, "STATUS_URL_TEMPLATE"), (args.listen_address, "LISTEN_ADDRESS"),
                      (args.worker_image, "WORKER_IMAGE"), (args.peering_lifetime, "PEERING_LIFETIME")):
        if flag is not None:
            os.environ[ENV_PREFIX + key] = str(flag)
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    liveness = f"http://{args.listen_address}:{args.health_port}/healthz" if args.health_port else None
    peering: dict[str, object] = {"standalone": True}
    if not args.standalone:
        ensure_peering(args.peering, args.namespace)
        priority = args.priority if args.priority is not None else random.randint(*PRIORITY_RANGE)
        peering = {"peering_name": args.peering, "priority": priority}
        logging.getLogger(__name__).info("peering %r with priority %d", args.peering, priority)
    kopf.run(clusterwide=bool(args.all_namespaces), namespaces=args.namespace or (), liveness_endpoint=liveness,
             **peering)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
