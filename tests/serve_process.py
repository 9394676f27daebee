"""A `fusedserve run` process joined to a test Ray, as a user starts it (shared by the Ray-backed tests).

One Ray per test session (conftest's ``ray_address``), started inside the suite's private network namespace
with ``fake_gpu`` standing in for GPUs; ``Server`` runs the real CLI in a subprocess.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
FAKE_GPUS = 6
NAMESPACE = "fusedserve"
READY_MARK = "acceptance length:"
# The banner's line with the URL the API really listens on (``--port 0``: the CLI binds a free port itself).
API_LINE = re.compile(r"OpenAI API: (http://127\.0\.0\.1:(\d+))/v1")


def ray_address() -> Iterator[str]:
    """The session's test Ray: ``tests/conftest.py``'s ``ray_address`` fixture."""
    yield from _ray()


def _ray() -> Iterator[str]:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, num_gpus=0, resources={"fake_gpu": FAKE_GPUS}, include_dashboard=False,
             namespace=NAMESPACE, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    stop_ray()


def stop_ray() -> None:
    """The session's Ray stopped (again: a no-op)."""
    import ray

    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_groups(deployment: str) -> list[str]:
    from ray.util import placement_group_table

    return sorted(e["name"] for e in placement_group_table().values()
                  if e["name"].startswith(f"fusedserve/default/{deployment}/") and e["state"] != "REMOVED")


class Server:
    """`fusedserve run MANIFEST --ray-address ...`, ready once it printed its first acceptance figure.

    Without ``port`` the CLI is started with ``--port 0`` and ``url``/``port`` are read from its banner: a port
    picked here and bound by the CLI seconds later (after its imports) could be taken by then (a gloo or Ray
    socket of another server), and the run failed with "Address already in use"."""

    def __init__(self, manifest: str | Path, address: str | None, timeout: float = 120, port: int | None = None,
                 extra_args: tuple[str, ...] = (), ready_mark: str = READY_MARK, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``address`` None: the CLI starts its embedded Ray; ``env`` replaces the environment's Ray
        settings (default: RAY_AUTH_MODE=disabled, as the test Ray runs)."""
        self.manifest, self.address = str(manifest), address
        self.port = port if port is not None else 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.output: list[str] = []
        self._ready = threading.Event()
        self._exited = threading.Event()
        self._ready_mark = ready_mark
        joined = ("--ray-address", address) if address is not None else ()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fusedserve.cli", "run", self.manifest, "--port", str(self.port), *joined,
             *extra_args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env if env is not None else {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self._exited.is_set():
            self.stop()
            raise RuntimeError("fusedserve run did not become ready:\n" + "".join(self.output[-40:]))
        self.model = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30).json()["data"][0]["id"]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            api = API_LINE.search(line)
            if api is not None and not self._ready.is_set():
                self.url, self.port = api.group(1), int(api.group(2))
            if self._ready_mark in line:
                self._ready.set()
        self._exited.set()
        self._ready.set()

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=120)

    def complete(self, prompt: str = "x = ", max_tokens: int = 4) -> str:
        comp = self.client().completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0)
        return comp.choices[0].text

    def samples(self) -> list[Any]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30).text
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def total(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples()
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/status", headers=self.headers, timeout=30).json()  # type: ignore[no-any-return]

    def wait_status(self, ok: Any, timeout: float = 120) -> dict[str, Any]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.status()
            if ok(s):
                return s
            time.sleep(0.5)
        pytest.fail(f"status never satisfied the condition: {self.status()}")

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# Examples that several modules serve unchanged (test_prometheus_e2e, test_ray_runtime): ``ExampleServers``.
EXAMPLES = {"tiny-code-tp2": "examples/02-tiny-code-tp2.yaml", "tiny-moe": "examples/03-tiny-moe-dp-ep.yaml"}


class ExampleServers:
    """examples/02 and /03 as `fusedserve run` serves them, shared by the tests that send them requests and read
    their metrics, status and plan without changing their spec (conftest's ``example_servers``): each starts on
    first use (those asked for together start in parallel) and all stop after the last test that uses them.
    A test that ends a rank (the group is recreated) or reads counters reads deltas or invariants."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.servers: dict[str, Server] = {}

    def get(self, *names: str) -> dict[str, Server]:
        missing = [n for n in names if n not in self.servers]
        failures: list[BaseException] = []

        def start(name: str) -> None:
            try:
                self.servers[name] = Server(ROOT / EXAMPLES[name], self.address, timeout=300)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                failures.append(e)

        threads = [threading.Thread(target=start, args=(n,)) for n in missing]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        return {n: self.servers[n] for n in names}

    def stop(self) -> dict[str, str]:
        """Stop every server (in parallel); the output tails of those that did not exit 0."""
        servers, self.servers = self.servers, {}
        codes: dict[str, int] = {}
        stopping = [threading.Thread(target=lambda n=n, s=s: codes.update({n: s.stop()})) for n, s in servers.items()]
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()
        return {n: "".join(servers[n].output[-30:]) for n, code in codes.items() if code != 0}
