"""A real Prometheus for the tests: Debian's ``prometheus`` package (2.42), a server on loopback, its HTTP API.

``scripts/ensure-prometheus.sh`` (run by ``scripts/run-tests.sh`` before it enters the private network
namespace) unpacks the package's ``prometheus`` and ``promtool`` into ``.cache/prometheus/bin`` when they are
not on PATH. ``binary(name)`` finds them; when neither place has them the test is skipped with the reason, or
fails where ``FUSEDSERVE_REQUIRE_PROMETHEUS=1`` (CI sets it: there the tests must run, not skip).

``PrometheusServer`` runs one server (its own TSDB under a temp dir, one scrape and evaluation interval)
and wraps the API calls the tests make: instant and range queries, targets, rules and alerts. A query that
Prometheus rejects raises ``PromQLError`` with Prometheus's message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CACHE_BIN = ROOT / ".cache" / "prometheus" / "bin"
REQUIRE_ENV = "FUSEDSERVE_REQUIRE_PROMETHEUS"


def find(name: str) -> str | None:
    """``prometheus`` / ``promtool``: on PATH, else where scripts/ensure-prometheus.sh unpacked it."""
    on_path = shutil.which(name)
    if on_path:
        return on_path
    cached = CACHE_BIN / name
    return str(cached) if os.access(cached, os.X_OK) else None


def binary(name: str) -> str:
    """The binary, or skip the test saying why (fail instead under FUSEDSERVE_REQUIRE_PROMETHEUS=1)."""
    path = find(name)
    if path is not None:
        return path
    reason = (f"{name} not found on PATH nor in {CACHE_BIN}: run `bash scripts/ensure-prometheus.sh` "
              "(fetches Debian's `prometheus` package with apt and unpacks it there) or install Prometheus 2.x")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 and {reason}")
    pytest.skip(reason)


class PromQLError(RuntimeError):
    pass


def file_sd_job(workdir: Path, job: str, **settings: Any) -> dict[str, Any]:
    """A scrape config whose targets ``PrometheusServer.set_targets`` writes later (``file_sd_configs``)."""
    return {"job_name": job, **settings, "file_sd_configs": [{"files": [str(workdir / "targets" / f"{job}.json")]}]}


class PrometheusServer:
    """``prometheus`` on 127.0.0.1:``port`` with ``scrape_configs`` and ``rules`` (a ``{"groups": [...]}`` value).

    Prometheus applies new targets only on its discovery and scrape managers' 5-second ticks (about 10 s after
    its start for static targets): a server started before its targets are known (``file_sd_job``, then
    ``set_targets``) scrapes them sooner."""

    def __init__(self, workdir: Path, port: int, scrape_configs: list[dict[str, Any]],
                 rules: dict[str, Any] | None = None, interval: str = "1s") -> None:
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        (workdir / "targets").mkdir(parents=True, exist_ok=True)  # before the start: file_sd watches the folder
        config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": scrape_configs,
        }
        if rules is not None:
            (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
            config["rule_files"] = [str(workdir / "rules.yaml")]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary("prometheus"), f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def set_targets(self, job: str, targets: list[str], labels: dict[str, str] | None = None) -> None:
        """The targets of a ``file_sd_job`` (written whole, then renamed: Prometheus never reads half a file)."""
        path = self.workdir / "targets" / f"{job}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": targets, "labels": labels or {}}]))
        tmp.replace(path)

    def _api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: ``[{"metric": {...}, "value": [ts, "str"]}, ...]`` (a vector; scalars as one row)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        """``[{"metric": {...}, "values": [[ts, "str"], ...]}, ...]``."""
        data = self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)
        return list(data["result"])

    def samples(self, selector: str, at: float, seconds: float) -> list[dict[str, Any]]:
        """Raw samples of a range selector ``selector[seconds]`` ending at ``at`` (what was really scraped)."""
        data = self._api("query", query=f"{selector}[{int(seconds * 1000)}ms]", time=f"{at:.3f}")
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._api("targets", state="active")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self._api("rules")["groups"] for rule in group["rules"]]

    def wait_for_targets(self, jobs: set[str], scrapes: int = 2, timeout: float = 60.0) -> None:
        """Until every target of ``jobs`` is up and has been scraped ``scrapes`` times since (``up`` series)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            up = {(r["metric"]["job"], r["metric"]["instance"]): r for r in
                  self.query("count_over_time(up[1h]) and up == 1")}
            last = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in self.targets()}
            targets = [(t["labels"]["job"], t["labels"]["instance"]) for t in self.targets()
                       if t["labels"]["job"] in jobs]
            if targets and {j for j, _ in targets} == jobs and all(
                    k in up and float(up[k]["value"][1]) >= scrapes for k in targets):
                return
            time.sleep(0.5)
        raise AssertionError(f"targets of {sorted(jobs)} not all up within {timeout}s: {last}")
