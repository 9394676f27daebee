"""``fusedserve-operator`` (the command the chart runs) against the emulated API server, for the e2e tests.

``Operator(workdir, status_url)`` starts the API server (tests/kube) with our CRD and KubeRay's, and the
operator process reading every controller's ``/status`` from ``status_url``; ``apply`` creates examples/02
(the test plays KubeRay: it becomes Ready) and one InferenceDeployment whose spec is invalid.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.eventually import eventually
from tests.kube.api_server import KubeAPI, object_path
from tests.kube.fixtures import CRDS_DIR
from tests.serve_process import free_port

ROOT = Path(__file__).resolve().parents[1]
TP2 = "tiny-code-tp2"




class Operator:
    """``fusedserve-operator`` (the command the chart runs) against the emulated API server."""

    def __init__(self, workdir: Path, status_url: str) -> None:
        self.api = KubeAPI(workdir / "kube-api").start()
        self.api.kubectl("apply", "-f", "crds/", cwd=ROOT)
        self.api.kubectl("apply", "-f", str(CRDS_DIR), cwd=ROOT)
        self.metrics_port, health = free_port(), free_port()
        self.log_path = workdir / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(self.api.kubeconfig_path), "FUSEDSERVE_OPERATOR_RETRY_DELAY": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fusedserve.operator.main", "--all-namespaces", "--standalone",
                 "--listen-address", "127.0.0.1", "--health-port", str(health),
                 "--metrics-port", str(self.metrics_port), "--status-interval", "1",
                 "--status-url-template", status_url],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        eventually(lambda: httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2).status_code == 200,
                   timeout=60)

    def apply(self, tmp: Path) -> None:
        """examples/02 (reaches Ready: the test plays KubeRay) and one with an invalid spec (a permanent error)."""
        bad = yaml.safe_load((ROOT / "examples/02-tiny-code-tp2.yaml").read_text())
        bad["metadata"]["name"] = "bad-parallelism"
        bad["spec"]["parallelism"] = {"tensor": 3, "data": 2, "dataParallelAttention": True}
        (tmp / "bad.yaml").write_text(yaml.safe_dump(bad))
        self.api.kubectl("apply", "-f", "examples/02-tiny-code-tp2.yaml", cwd=ROOT)
        self.api.kubectl("apply", "-f", str(tmp / "bad.yaml"))
        def cluster() -> str | None:  # named by the pod revision: found by the deployment's label
            found = self.api.list_objects("ray.io", "v1", "rayclusters", "default",
                                          label_selector=f"fusedserve.io/deployment={TP2}")
            return str(found[0]["metadata"]["name"]) if len(found) == 1 else None

        path = object_path("ray.io", "v1", "rayclusters", "default", eventually(cluster, timeout=60))
        self.api.patch(path + "/status", {"status": {"state": "ready", "desiredWorkerReplicas": 1,
                                                     "readyWorkerReplicas": 1}})

    def ready(self) -> bool:
        obj = self.api.get(object_path("fusedserve.io", "v1alpha1", "inferencedeployments", "default", TP2))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", []))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.api.stop()
