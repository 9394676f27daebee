"""``KubeAPI``: the emulated Kubernetes API server (``KubeEmulator``, a kmock subclass) running on
127.0.0.1 on a free port, in a background thread with its own event loop, plus a kubeconfig for it and
helpers to drive it with kubectl or plain HTTP from tests.

    api = KubeAPI(tmp_path).start()
    api.kubectl("apply", "-f", "crds/")
    api.list_objects("fusedserve.io", "v1alpha1", "inferencedeployments", "default")
    api.stop()
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp.web
from typing_extensions import Self

from tests.kube.emulator import KubeEmulator
from tests.kube.paths import object_path

__all__ = ["KubeAPI", "KubeAPIError", "KubeEmulator", "object_path"]

KUBECTL = "kubectl"
WRITE_VERBS = ("apply", "create", "replace")  # the ones that take --validate


class KubeAPIError(RuntimeError):
    """A non-2xx answer of the emulated server; ``body`` is its Status object."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


class KubeAPI:
    def __init__(self, workdir: str | Path | None = None, *, namespace: str = "default",
                 access_log: bool = False) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kube-api-") if workdir is None else None
        self.workdir = Path(self._tmp.name if self._tmp else str(workdir))
        self.namespace = namespace
        self.kubeconfig_path = self.workdir / "kubeconfig"
        self.access_log = access_log  # aiohttp's per-request log lines (the emulator records requests anyway)
        self.handler: KubeEmulator | None = None
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> Self:
        if self._thread is not None:
            raise RuntimeError("KubeAPI can be started only once")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="kube-api", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._port is None:
            raise RuntimeError("the emulated API server did not start (its thread's traceback is above)")
        self.kubeconfig_path.write_text(self._kubeconfig())
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the emulated API server did not stop in time")
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())  # a failure is printed by threading's excepthook
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        handler = KubeEmulator()
        self.handler = handler
        async with handler:
            server = aiohttp.web.Server(handler, access_log=aiohttp.log.access_logger if self.access_log else None)
            runner = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            site = aiohttp.web.SockSite(runner, sock)
            await site.start()
            self._port = sock.getsockname()[1]
            self._ready.set()
            try:
                await self._stopping.wait()
            finally:
                handler.close()
                await runner.cleanup()

    # --- addresses -----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._port is None:
            raise RuntimeError("the emulated API server is not running")
        return f"http://127.0.0.1:{self._port}"

    @property
    def internal_errors(self) -> list[BaseException]:
        """Exceptions the server raised on its own (not API errors such as 404): bugs of the emulator."""
        return list(self.handler.internal_errors) if self.handler is not None else []

    def _kubeconfig(self) -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "kube-api", "cluster": {"server": self.url}}],
            "users": [{"name": "kube-api", "user": {}}],
            "contexts": [{"name": "kube-api",
                          "context": {"cluster": "kube-api", "user": "kube-api", "namespace": self.namespace}}],
            "current-context": "kube-api",
        }
        return json.dumps(config, indent=2) + "\n"  # JSON is YAML

    # --- kubectl ---------------------------------------------------------------------------------------
    def kubectl_args(self, *args: str) -> list[str]:
        """The full kubectl command line (own kubeconfig and discovery cache; --validate=false for writes)."""
        verb = [a for a in args if not a.startswith("-")][:1]
        extra = ["--validate=false"] if verb and verb[0] in WRITE_VERBS else []
        return [KUBECTL, f"--kubeconfig={self.kubeconfig_path}", f"--cache-dir={self.workdir / 'kube-cache'}",
                *args, *extra]

    def kubectl(self, *args: str, check: bool = True, timeout: float = 30.0,
                input: str | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.kubectl_args(*args), check=False, capture_output=True, text=True,
                              timeout=timeout, input=input, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def kubectl_popen(self, *args: str, cwd: str | Path | None = None) -> subprocess.Popen[str]:
        """A long-running kubectl (``get -w``); the caller must kill it."""
        return subprocess.Popen(self.kubectl_args(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd)

    def wait_for_watch(self, plural: str, streams: int = 1, timeout: float = 30.0) -> None:
        """Until ``streams`` watches of ``plural`` are open on the server (e.g. the one ``kubectl get -w`` starts
        after printing what it read: a write before that is folded into the watch's first event, which kubectl
        drops for a single object — as against a real API server)."""
        assert self.handler is not None, "start() the server first"
        deadline = time.monotonic() + timeout
        while self.handler.watch_streams(plural) < streams:
            if time.monotonic() > deadline:
                raise AssertionError(f"no watch of {plural} opened within {timeout:.0f} s")
            time.sleep(0.01)

    # --- plain HTTP ---------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                params: dict[str, str] | None = None, timeout: float = 10.0) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raw = exc.read().decode()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw
            raise KubeAPIError(exc.code, parsed) from None
        return json.loads(text) if text else None

    def get(self, path: str, params: dict[str, str] | None = None) -> Any:
        return self.request("GET", path, params=params)

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.request("POST", path, body)
        return result

    def patch(self, path: str, patch: Any, content_type: str = "application/merge-patch+json") -> dict[str, Any]:
        result: dict[str, Any] = self.request("PATCH", path, patch, content_type=content_type)
        return result

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def list_objects(self, group: str, version: str, plural: str, namespace: str | None = None,
                     label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        items: list[dict[str, Any]] = self.get(object_path(group, version, plural, namespace), params)["items"]
        return items

    def watch_events(self, path: str, *, resource_version: str = "0", timeout_seconds: int = 1,
                     params: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Every event of a watch on ``path`` (a collection) from ``resource_version``, ended by the server
        after ``timeout_seconds``: e.g. ``resource_version="1"`` replays the whole history."""
        query = {"watch": "true", "resourceVersion": resource_version, "timeoutSeconds": str(timeout_seconds)}
        url = self.url + path + "?" + urllib.parse.urlencode(query | (params or {}))
        with urllib.request.urlopen(url, timeout=timeout_seconds + 10) as resp:
            return [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]
