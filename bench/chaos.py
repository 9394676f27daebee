"""Chaos, bounded: random rank kills under steady load; every request answered, recovery timed.

    python bench/chaos.py [--kills 50] [--clients 3] [--seed 0] [--out bench/results/<date>-chaos-cpu.json]

One Ray on this machine (``fake_gpu`` standing in for GPUs, as the tests run it) and one
`fusedserve run` per example joined to it: examples/02 (tp=2, fused all-reduce, EAGLE3) and
examples/03 (tp=2 as dp=2 + ep=2, a tiny DeepSeek-V3). ``--clients`` threads per deployment send
completions back to back (half of them streamed, 4-24 tokens, honouring ``Retry-After`` up to 1 s).
The kills alternate between the deployments: wait until the deployment is ready, wait 0.5-3 s
(requests in flight), ``ray.kill`` a random rank actor of its group, and time until ``/status``
is ready again with one more restart (the recovery time).

Every request ends as one of: ``ok`` (200 with a finish reason; a stream ending in ``[DONE]``),
``retryable`` (503 with code engine_dead / no_ready_engine / shutting_down, as JSON or as the
stream's error event before ``[DONE]``), ``error`` (anything else: a non-retryable status, a
broken stream, a transport error) or ``hung`` (no answer within ``--request-timeout``). The run
passes when errors and hangs are 0 and every group came back. Ray needs a private network
namespace with only loopback (TESTING.md): as root the script re-runs itself inside one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fusedserve.worker  # noqa: F401  (the installed package first: bench/common.py says why)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.common import Progress, record_header, write_record

EXAMPLES = ("examples/02-tiny-code-tp2.yaml", "examples/03-tiny-moe-dp-ep.yaml")
RETRYABLE = {"engine_dead", "no_ready_engine", "shutting_down"}
PROMPTS = ("def fib(n):", "import os\n", "class Stack:", "for i in range(", "x = [", "async def main():")
NETNS_MARK = "FUSEDSERVE_CHAOS_NETNS"


@dataclass
class Deployment:
    name: str
    manifest: str
    server: Any  # tests.serve_process.Server
    outcomes: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)
    recoveries: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str, detail: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.details[detail] += 1


def classify(status: int, body: str, stream: bool) -> tuple[str, str, float]:
    """(outcome, detail, retry-after seconds) of one answered request."""
    if stream and status == 200:
        events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "error", "stream without [DONE]", 0.0
        last = json.loads(events[-2]) if len(events) >= 2 else {}
        if "error" in last:
            code = last["error"].get("code")
            return ("retryable" if code in RETRYABLE else "error"), f"stream error {code}", 0.5
        return "ok", "stream ok", 0.0
    if status == 200:
        return ("ok", "ok", 0.0) if json.loads(body)["choices"][0]["finish_reason"] else ("error", "no finish", 0.0)
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "error", f"{status} not JSON", 0.0
    if status == 503 and code in RETRYABLE:
        return "retryable", f"503 {code}", 0.5
    return "error", f"{status} {code}", 0.0


def client_loop(dep: Deployment, stop: threading.Event, seed: int, timeout: float) -> None:
    import httpx

    rng = random.Random(seed)
    url = f"{dep.server.url}/v1/completions"
    while not stop.is_set():
        stream = rng.random() < 0.5
        body = {"model": dep.server.model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 24),
                "temperature": 0, "stream": stream}
        try:
            if stream:
                with httpx.stream("POST", url, json=body, timeout=timeout) as r:
                    text = "\n".join(r.iter_lines())
                    status, retry = r.status_code, r.headers.get("Retry-After")
            else:
                r = httpx.post(url, json=body, timeout=timeout)
                text, status, retry = r.text, r.status_code, r.headers.get("Retry-After")
            outcome, detail, pause = classify(status, text, stream)
            if retry is not None:
                pause = min(1.0, float(retry))
        except httpx.TimeoutException:
            outcome, detail, pause = "hung", "timeout", 0.0
        except (httpx.TransportError, ValueError) as e:
            outcome, detail, pause = "error", f"{type(e).__name__}", 0.5
        dep.count(outcome, detail)
        if pause:
            stop.wait(pause)


def wait_ready(dep: Deployment, restarts: int, timeout: float) -> float | None:
    """Seconds until /status is ready with at least ``restarts`` restarts (None: not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            s = dep.server.status()
        except Exception:  # noqa: BLE001 (a status read during a restart may fail: poll on)
            s = {}
        if s.get("ready") and s.get("ready_replicas", 0) >= 1 and s.get("restarts", 0) >= restarts:
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def kill_one(dep: Deployment, rng: random.Random) -> tuple[str, int]:
    import ray

    s = dep.server.status()
    group = s["groups"][0]
    rank = rng.randrange(len(group["ranks"]))
    name = f"{group['placement_group']}/rank{rank}"
    ray.kill(ray.get_actor(name, namespace="fusedserve"))
    return name, int(s["restarts"])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_chaos(address: str, kills: int, clients: int, seed: int, request_timeout: float, recovery_timeout: float,
              log: Any, examples: tuple[str, ...] = EXAMPLES) -> dict[str, Any]:
    """Serve ``examples`` on the Ray at ``address``, load them, kill ``kills`` ranks; the numbers."""
    from tests.serve_process import Server

    rng = random.Random(seed)
    deps: list[Deployment] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    kill_log: list[dict[str, Any]] = []
    try:
        for path in examples:
            server = Server(ROOT / path, address, timeout=300)
            deps.append(Deployment(server.model, path, server))
            log(f"{server.model}: serving on {server.url}")
        for i, dep in enumerate(deps):
            for c in range(clients):
                t = threading.Thread(target=client_loop, args=(dep, stop, seed * 1000 + i * 100 + c, request_timeout),
                                     daemon=True)
                t.start()
                threads.append(t)
        for k in range(kills):
            dep = deps[k % len(deps)]
            if wait_ready(dep, 0, recovery_timeout) is None:
                raise RuntimeError(f"{dep.name} is not ready: {dep.server.status()}")
            time.sleep(rng.uniform(0.5, 3.0))
            name, restarts = kill_one(dep, rng)
            recovery = wait_ready(dep, restarts + 1, recovery_timeout)
            kill_log.append({"kill": k, "deployment": dep.name, "actor": name,
                             "recovery_s": None if recovery is None else round(recovery, 2)})
            if recovery is not None:
                dep.recoveries.append(recovery)
            log(f"kill {k + 1}/{kills}: {name}: back in {recovery if recovery is None else round(recovery, 1)} s; "
                f"{dict(dep.outcomes)}")
        time.sleep(2.0)  # the last requests after the last recovery
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=request_timeout + 10)
        codes = {dep.name: dep.server.stop() for dep in deps}
    recoveries = [r for dep in deps for r in dep.recoveries]
    per = {dep.name: {"manifest": dep.manifest, "kills": sum(1 for k in kill_log if k["deployment"] == dep.name),
                      "requests": dict(dep.outcomes), "by_answer": dict(dep.details),
                      "recovery_s": summary(dep.recoveries), "exit_code": codes[dep.name]} for dep in deps}
    totals: Counter[str] = Counter()
    for dep in deps:
        totals.update(dep.outcomes)
    return {"kills": len(kill_log), "recovered": len(recoveries), "requests": dict(totals),
            "hung": totals["hung"], "non_retryable_errors": totals["error"], "recovery_s": summary(recoveries),
            "deployments": per, "kill_log": kill_log,
            "passed": totals["hung"] == 0 and totals["error"] == 0 and len(recoveries) == len(kill_log)}


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(statistics.median(values), 2), "p95": round(percentile(values, 0.95), 2),
            "max": round(max(values), 2), "min": round(min(values), 2), "n": len(values)}


def in_private_netns() -> None:
    """Re-run inside a network namespace with only loopback (root), like scripts/run-tests.sh."""
    if os.environ.get(NETNS_MARK) or os.geteuid() != 0 or shutil.which("unshare") is None:
        return
    os.environ[NETNS_MARK] = "1"
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$@"', "sh",
                          sys.executable, *sys.argv])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--clients", type=int, default=3, help="client threads per deployment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="a request unanswered this long hung")
    parser.add_argument("--recovery-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    in_private_netns()
    import ray

    log = Progress("chaos")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    load_start = os.getloadavg()
    ray.init(num_cpus=2, num_gpus=0, resources={"fake_gpu": 6}, include_dashboard=False, namespace="fusedserve",
             log_to_driver=False)
    t0 = time.time()
    try:
        numbers = run_chaos(ray.get_runtime_context().gcs_address, args.kills, args.clients, args.seed,
                            args.request_timeout, args.recovery_timeout, log)
    finally:
        ray.shutdown()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    record = {**record_header(), "machine": f"{record_header()['machine']}, nproc {os.cpu_count()}", "commit": commit,
              "what": "random rank kills under steady load, examples/02 (tp=2) and examples/03 (dp=2 + ep=2) on one "
                      "CPU Ray (fake_gpu), one `fusedserve run` each; recovery = kill -> /status ready again",
              "clients_per_deployment": args.clients, "seed": args.seed, "wall_s": round(time.time() - t0, 1),
              "load_average_1_5_15min": {"start": list(load_start), "end": list(os.getloadavg())}, **numbers}
    out = args.out or str(ROOT / "bench" / "results" / f"{record['date']}-chaos-cpu.json")
    write_record(record, out)
    log(f"wrote {out}: {json.dumps({k: record[k] for k in ('kills', 'requests', 'recovery_s', 'passed')})}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
