"""Operator kills mid-rollout on the emulated cluster (issue #18 item 7): duplicates, lost status, recovery.

    python bench/operator_chaos.py [--kills 20] [--out bench/results/<date>-operator-chaos-cpu.json]

Two peered ``fusedserve-operator`` processes (as the chart runs them, ``--peering-lifetime 3``) reconcile one
InferenceDeployment on the emulated API server (tests/kube), with tests/kube/cluster_player.py playing
KubeRay, the heads and kube-proxy, and a client loop sending completions through the Service the whole time.
Each round changes the worker image (a rollout to a new RayCluster), waits a random 0-2 s, SIGKILLs the
active operator (the peer of highest priority) and starts a new process in its place, then waits until the
deployment has converged: one RayCluster of the new revision, the Service on it, status Ready with the
round's generation. Checked throughout (every 0.25 s): at most 2 RayClusters (the serving one and the new
one), at most one of every other child, a status with conditions. Bounded: ``--round-timeout`` per round.
Run inside the private network namespace as the tests are (``scripts/run-tests.sh`` shows how).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from tests.kube import fixtures
from tests.kube.api_server import KubeAPI, KubeAPIError, object_path
from tests.kube.cluster_player import ClusterPlayer

SINGLES = {"Service": ("", "v1", "services"), "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
           "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
           "PodMonitor": ("monitoring.coreos.com", "v1", "podmonitors"), "Secret": ("", "v1", "secrets")}
RAY = ("ray.io", "v1", "rayclusters")
INFD = ("fusedserve.io", "v1alpha1", "inferencedeployments")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Operators:
    def __init__(self, api: KubeAPI, template: str, log: Path) -> None:
        self.api, self.template, self.log = api, template, log
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.started = 0

    def start(self) -> str:
        self.started += 1
        identity = f"op-{self.started}"
        env = {**os.environ, "KUBECONFIG": str(self.api.kubeconfig_path), "POD_ID": identity,
               "FUSEDSERVE_OPERATOR_RETRY_DELAY": "1"}
        args = [sys.executable, "-m", "fusedserve.operator.main", "--all-namespaces", "--listen-address", "127.0.0.1",
                "--health-port", str(free_port()), "--status-interval", "1", "--peering-lifetime", "3",
                "--status-url-template", self.template]
        out = open(self.log, "a")  # noqa: SIM115 (closed with the process)
        self.procs[identity] = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                text=True)
        return identity

    def active(self) -> str | None:
        peering = self.api.get(object_path("kopf.dev", "v1", "clusterkopfpeerings", None, "fusedserve"))
        live = {k: v for k, v in (peering.get("status") or {}).items()
                if isinstance(v, dict) and v.get("lifetime") and k in self.procs and self.procs[k].poll() is None}
        return max(live, key=lambda k: live[k]["priority"]) if live else None

    def kill(self, identity: str) -> None:
        self.procs[identity].send_signal(signal.SIGKILL)
        self.procs[identity].wait(10)
        del self.procs[identity]

    def stop(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


class Watcher:
    """Samples the children and the status every 0.1 s; records the worst it saw."""

    def __init__(self, api: KubeAPI) -> None:
        self.api = api
        self.max_clusters, self.max_singles, self.status_missing, self.samples = 0, 0, 0, 0
        self.max_same_revision = 0
        self.generations: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                clusters = self.api.list_objects(*RAY, "default")
                singles = max(len(self.api.list_objects(*plural, "default")) for plural in SINGLES.values())
                status = self.api.get(object_path(*INFD, "default", "tiny-code")).get("status") or {}
            except (KubeAPIError, OSError, ValueError, KeyError):
                continue
            self.samples += 1
            self.max_clusters = max(self.max_clusters, len(clusters))
            revisions = [(c["metadata"].get("annotations") or {}).get("fusedserve.io/pod-revision") for c in clusters]
            self.max_same_revision = max([self.max_same_revision, *(revisions.count(r) for r in revisions)])
            self.max_singles = max(self.max_singles, singles)
            if not status.get("conditions"):
                self.status_missing += 1
            if status.get("observedGeneration") is not None:
                self.generations.append(int(status["observedGeneration"]))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def generation_regressions(self) -> int:
        return sum(1 for a, b in zip(self.generations, self.generations[1:]) if b < a)


def converged(api: KubeAPI, player: ClusterPlayer, generation: int, image: str) -> bool:
    try:
        return _converged(api, player, generation, image)
    except (KubeAPIError, OSError):
        return False  # the emulated server busy: ask again


def _converged(api: KubeAPI, player: ClusterPlayer, generation: int, image: str) -> bool:
    clusters = api.list_objects(*RAY, "default")
    if len(clusters) != 1:
        return False
    rc = clusters[0]
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    obj = api.get(object_path(*INFD, "default", "tiny-code"))
    status = obj.get("status") or {}
    ready = {c["type"]: c["status"] for c in status.get("conditions") or []}.get("Ready")
    return (head["image"] == image and player.service_target("tiny-code") == rc["metadata"]["name"]
            and status.get("observedGeneration") == generation and status.get("rayCluster") == rc["metadata"]["name"]
            and ready == "True")


def run(kills: int, round_timeout: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="operator-chaos-"))
    api = KubeAPI(work / "kube-api").start()
    ops: Operators | None = None
    try:
        api.kubectl("apply", "-f", "crds/", cwd=ROOT)
        api.kubectl("apply", "-f", str(fixtures.CRDS_DIR), cwd=ROOT)
        with ClusterPlayer(api, start_delay=0.3) as player:
            ops = Operators(api, player.status_url_template, work / "operators.log")
            ops.start()
            ops.start()
            doc = yaml.safe_load((ROOT / "examples" / "01-tiny-code.yaml").read_text())
            doc["spec"]["rollout"] = {"clusterDeletionDelaySeconds": 1}
            (work / "infd.yaml").write_text(yaml.safe_dump(doc))
            api.kubectl("apply", "-f", str(work / "infd.yaml"))
            deadline = time.monotonic() + 90
            while not converged(api, player, 1, "ghcr.io/fusedserve/worker:0.1.0"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the first deployment did not become Ready")
                time.sleep(0.2)
            watcher = Watcher(api)
            watcher.start()
            requests: list[int] = []
            times: list[float] = []
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(timeout=5.0) as c:
                    while not stop.is_set() and len(requests) < 100_000:
                        try:
                            r = c.post(player.service_url("tiny-code") + "/v1/completions", json={"prompt": "x"})
                            requests.append(r.status_code)
                        except httpx.HTTPError:
                            requests.append(0)
                        times.append(time.monotonic())
                        time.sleep(0.05)

            loop = threading.Thread(target=client, daemon=True)
            loop.start()
            rounds = []
            for i in range(kills):
                t_round = time.monotonic()
                image = f"ghcr.io/fusedserve/worker:0.2.{i}"
                generation = int(api.get(object_path(*INFD, "default", "tiny-code"))["metadata"]["generation"]) + 1
                api.kubectl("patch", "infd", "tiny-code", "--type=merge", "-p",
                            json.dumps({"spec": {"image": image}}))
                time.sleep(rng.uniform(0.0, 2.0))
                victim = ops.active()
                t_kill = time.monotonic()
                if victim is not None:
                    ops.kill(victim)
                    ops.start()
                ok = False
                while time.monotonic() - t_kill < round_timeout:
                    if converged(api, player, generation, image):
                        ok = True
                        break
                    time.sleep(0.1)
                codes = [code for t, code in zip(list(times), list(requests)) if t >= t_round]
                rounds.append({"round": i, "killed": victim, "converged": ok,
                               "seconds_to_converge": round(time.monotonic() - t_kill, 2),
                               "client_503": codes.count(503), "client_timeouts": codes.count(0)})
                print(json.dumps(rounds[-1]), file=sys.stderr)
            stop.set()
            loop.join(10)
            watcher.stop()
        times = sorted(r["seconds_to_converge"] for r in rounds if r["converged"])
        log = (work / "operators.log").read_text()
        return {
            "kills": sum(1 for r in rounds if r["killed"]), "rounds": rounds,
            "all_converged": all(r["converged"] for r in rounds),
            # RayClusters are named by their pod revision, so two for one revision cannot exist; more than two at
            # once means the serving one, the new one and a superseded one not yet deleted (a round that had not
            # finished when the next change came). Duplicates: more than one of a child of which there is one.
            "duplicate_children": {"max_rayclusters_at_once": watcher.max_clusters,
                                   "max_rayclusters_of_one_revision": watcher.max_same_revision,
                                   "max_of_any_single_child": watcher.max_singles,
                                   "duplicates": max(0, watcher.max_same_revision - 1) + max(0, watcher.max_singles - 1)},
            "status": {"samples": watcher.samples, "samples_without_conditions": watcher.status_missing,
                       "observed_generation_regressions": watcher.generation_regressions},
            "seconds_to_converge_after_kill": {
                "p50": statistics.median(times) if times else None,
                "p95": times[min(len(times) - 1, int(0.95 * len(times)))] if times else None,
                "max": times[-1] if times else None},
            # 503: the Service selected a cluster whose head was not serving (a gap); 0: the client's 5 s timeout
            # (the harness itself starved of CPU), not an answer of any head
            "client": {"requests": len(requests), "failed_503": requests.count(503), "timeouts": requests.count(0)},
            "tracebacks_in_operator_logs": log.count("Traceback"),
        }
    finally:
        if ops is not None:
            ops.stop()
        api.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    t0, load_before = time.monotonic(), os.getloadavg()
    numbers = run(args.kills, args.round_timeout, args.seed)
    record = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs, emulated API server (tests/kube)",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "wall_seconds": round(time.monotonic() - t0, 1),
              "load_average_1m_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
              **numbers}
    text = json.dumps(record, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    ok = numbers["all_converged"] and numbers["duplicate_children"]["duplicates"] == 0 and \
        numbers["client"]["failed_503"] == 0 and \
        numbers["status"]["samples_without_conditions"] == 0 and numbers["status"]["observed_generation_regressions"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
