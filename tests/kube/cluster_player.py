"""Plays the controllers and pods the emulated API server lacks, for operator tests without Ray.

``ClusterPlayer`` runs one HTTP server on 127.0.0.1 and a polling thread:

- **KubeRay**: every RayCluster of the namespace is marked ready (``status.state``, worker counts)
  ``start_delay`` seconds after it appears; a deleted RayCluster's head goes away (KubeRay deletes pods).
- **the heads**: ``GET /<cluster>/status`` answers as a group controller does (``ready_replicas`` =
  the replicas its engine ConfigMap asks for) while that cluster's head is up; the operator reads it
  through ``--status-url-template http://127.0.0.1:<port>/{cluster}/status``.
- **kube-proxy**: ``POST /svc/<service>/v1/completions`` goes to the head of the cluster the Service
  selects *now* (read from the API server on each request); 200 while that head is up, else 503.
- **the kubelet**, on demand: ``fail_download(cluster)`` gives that cluster's head a Pod whose model
  download init container failed; ``hold(cluster)`` keeps a cluster's head from starting.

Everything is bounded: the thread polls every ``interval`` seconds and stops with ``stop()``.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

import yaml
from typing_extensions import Self

from tests.kube.api_server import KubeAPI, KubeAPIError, object_path

RAY = ("ray.io", "v1", "rayclusters")


class ClusterPlayer:
    def __init__(self, api: KubeAPI, namespace: str = "default", start_delay: float = 0.5,
                 interval: float = 0.2) -> None:
        self.api, self.namespace, self.start_delay, self.interval = api, namespace, start_delay, interval
        self.seen: dict[str, float] = {}  # cluster -> when it appeared
        self.up: set[str] = set()  # clusters whose head serves
        self.held: set[str] = set()
        self.max_clusters = 0  # most RayClusters of the namespace seen at once
        self._targets: dict[str, str | None] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        player = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                cluster = self.path.strip("/").split("/")[0]
                doc = player.status_of(cluster)
                self._answer(200 if doc is not None else 503, doc or {"error": "head not running"})

            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                target = player.service_target(parts[1]) if len(parts) > 1 and parts[0] == "svc" else None
                with player.lock:
                    serving = target is not None and target in player.up
                if serving:
                    self._answer(200, {"object": "text_completion", "model": "m", "served_by": target,
                                       "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})
                else:
                    self._answer(503, {"error": {"message": f"no ready head behind the Service ({target})"}})

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up (the operator's bounded /status read): nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                         threading.Thread(target=self._loop, daemon=True)]

    # --- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    @property
    def status_url_template(self) -> str:
        return f"http://127.0.0.1:{self.port}/{{cluster}}/status"

    def service_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.port}/svc/{service}"

    # --- what the operator and clients see ------------------------------------------------------------------
    def status_of(self, cluster: str) -> dict[str, Any] | None:
        with self.lock:
            if cluster not in self.up:
                return None
        replicas = self._replicas(cluster)
        groups = [{"index": i, "phase": "Ready", "revision": "r1", "outdated": False, "acceptance_length": 2.0,
                   "ranks": [{"rank": 0, "node": f"{cluster}-worker"}]} for i in range(replicas)]
        return {"ready": replicas > 0, "replicas": replicas, "ready_replicas": replicas, "updated_replicas": replicas,
                "groups": groups, "conditions": [], "creating": [], "last_failure": None}

    def service_target(self, service: str) -> str | None:
        """The Service's cluster now; when the API server does not answer, the last one seen (as kube-proxy keeps
        its last endpoints)."""
        try:
            svc = self.api.get(object_path("", "v1", "services", self.namespace, service))
        except KubeAPIError as e:
            if e.status == 404:
                self._targets.pop(service, None)
                return None
            return self._targets.get(service)
        except OSError:
            return self._targets.get(service)
        target = ((svc.get("spec") or {}).get("selector") or {}).get("ray.io/cluster")
        self._targets[service] = target
        return target

    def _replicas(self, cluster: str) -> int:
        try:
            cm = self.api.get(object_path("", "v1", "configmaps", self.namespace, f"{cluster}-engine-config"))
        except KubeAPIError:
            return 0
        return int((yaml.safe_load(cm["data"]["deployment.yaml"])["spec"]).get("replicas", 1))

    # --- the kubelet, on demand -----------------------------------------------------------------------------
    def hold(self, cluster: str) -> None:
        with self.lock:
            self.held.add(cluster)
            self.up.discard(cluster)

    def release(self, cluster: str) -> None:
        with self.lock:
            self.held.discard(cluster)

    def fail_download(self, cluster: str, deployment: str, message: str, restarts: int = 2) -> None:
        """The head pod of ``cluster``, its model download exited 1 (CrashLoopBackOff)."""
        self.hold(cluster)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{cluster}-head-abcde", "namespace": self.namespace,
                            "labels": {"fusedserve.io/deployment": deployment, "ray.io/cluster": cluster,
                                       "ray.io/node-type": "head"}},
               "spec": {"containers": [{"name": "ray-head", "image": "x"}]}}
        path = object_path("", "v1", "pods", self.namespace)
        try:
            self.api.create(path, pod)
        except KubeAPIError:
            pass
        status = {"phase": "Pending", "initContainerStatuses": [{
            "name": "model-download", "restartCount": restarts, "ready": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}]}
        self.api.patch(object_path("", "v1", "pods", self.namespace, pod["metadata"]["name"], "status"),
                       {"status": status})

    # --- KubeRay -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except (KubeAPIError, OSError):
                continue  # the server is going away, or a transient refusal: next tick

    def _tick(self) -> None:
        clusters = self.api.list_objects(*RAY, self.namespace)
        names = {c["metadata"]["name"] for c in clusters}
        now = time.monotonic()
        with self.lock:
            self.max_clusters = max(self.max_clusters, len(names))
            self.up &= names  # deleted clusters: their pods are gone
            for name in set(self.seen) - names:
                del self.seen[name]
        for c in clusters:
            name = c["metadata"]["name"]
            first = self.seen.setdefault(name, now)
            with self.lock:
                startable = name not in self.held and name not in self.up and now - first >= self.start_delay
            if startable and not c["spec"].get("suspend"):
                workers = sum(int(g.get("replicas", 0)) for g in c["spec"].get("workerGroupSpecs") or [])
                self.api.patch(object_path(*RAY, self.namespace, name, "status"),
                               {"status": {"state": "ready", "desiredWorkerReplicas": workers,
                                           "readyWorkerReplicas": workers}})
                with self.lock:
                    self.up.add(name)
