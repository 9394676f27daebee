"""`fusedserve run FILE`: Ray + group controller + HTTP API, until Ctrl-C / SIGTERM.

Without ``--ray-address`` it starts an embedded local Ray sized from the spec: with GPUs one
``GPU`` per rank; without, CPU ranks (gloo), each holding one unit of the custom resource
``fake_gpu`` (``replicas x ranks`` plus one group's worth, so a spec change can roll with a surge
group). With ``--ray-address`` (or ``RAY_ADDRESS``) it joins a running cluster and, on exit,
removes only what it created. SIGHUP re-reads the manifest and rolls the engine groups.

Ctrl-C or SIGTERM drains (``serving/drain.py``): ``/health`` turns 503 at once, new ``/v1``
requests get 503 + ``Retry-After``, the requests in flight get ``spec.serving.
drainGracePeriodSeconds`` to finish and are then ended with a JSON error or an SSE error event
and ``[DONE]``; a second signal ends the grace period early. Then the HTTP server, rank actors,
placement groups and Ray stop (``ServingSpec.termination_grace_period_seconds`` covers both).

The embedded Ray listens on 127.0.0.1 only (its node address, with Ray's multi-node switch off: else Ray
swaps 127.0.0.1 for an address it probes and listens on every interface), without a dashboard, and with
Ray's token authentication (``auth_token.py``, as on Kubernetes: a fresh token per run in a file
only its user can read, removed at exit) unless ``RAY_AUTH_MODE`` says otherwise; joining a
cluster uses whatever ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN_PATH`` the environment holds. `make run`
(scripts/run-main.sh) runs the CLI inside a private network namespace with only loopback when it
is root (TESTING.md), as the tests run.

The API key (``--api-key`` or ``$FUSEDSERVE_API_KEY``) guards ``/v1/*`` and ``/status``
(``serving/access.py``); without one, ``/status`` shows rank PIDs, node addresses and failure
texts only when the API listens on loopback. ``replicas: 0`` serves ``/health`` (503, not
ready) and answers 503 "no ready engine groups" until scaled up.

``--smoke`` sends a completion and a chat request through the OpenAI API, prints them and the
key metrics, and exits 0 (what `make run` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .. import startup_gc
from ..spec import Manifest, RuntimeConfig, SpecError, load_manifest
from . import auth_token
from .placement import LOCAL_GPU_RESOURCE, LOOPBACK_HOSTS, RAY_NAMESPACE, ClusterShape

# Nothing above imports torch or ray: a bad manifest is refused before they load (check_checkpoint_split
# imports torch for a valid one; _serve imports ray).

log = logging.getLogger(__name__)

SMOKE_PROMPT = "def fibonacci(n):"
RAY_CONNECT_TIMEOUT_S = 300.0
WATCH_INTERVAL_S = 2.0
SMOKE_CHAT = "import os"
NO_GROUPS_MARK = "no engine groups (replicas: 0)"


def resolve_paths(manifest: Manifest, manifest_path: str) -> Manifest:
    """Relative checkpoint paths are relative to the working directory, else to the manifest's folder;
    ``~`` is the user's home (``fusedserve fetch-model`` caches under ``~/.cache/fusedserve``)."""
    def resolve(field: str, p: str) -> str:
        p = str(Path(p).expanduser())
        if Path(p).is_absolute():
            return p
        for base in (Path.cwd(), Path(manifest_path).resolve().parent):
            if (base / p).exists():
                return str((base / p).resolve())
        raise SpecError(f"{field}: {p!r} exists neither under {Path.cwd()} nor next to {manifest_path}")

    spec = manifest.spec
    model = spec.model.model_copy(update={"path": resolve("spec.model.path", spec.model.path)})
    speculative = spec.speculative
    if speculative is not None:
        speculative = speculative.model_copy(
            update={"draft_model": resolve("spec.speculative.draftModel", speculative.draft_model)})
    return manifest.model_copy(update={"spec": spec.model_copy(update={"model": model, "speculative": speculative})})


def load_runtime_config(manifest_path: str) -> RuntimeConfig:
    rc = RuntimeConfig.from_manifest(resolve_paths(load_manifest(manifest_path), manifest_path))
    check_checkpoint_split(rc)
    return rc


def check_checkpoint_split(rc: RuntimeConfig) -> None:
    """Refuse, before any rank actor starts, a parallelism the checkpoint cannot split (e.g. 9
    attention heads over tensor: 2). Here the runtime first sees the checkpoint; where it cannot
    (the checkpoint only on the workers' nodes) the ranks refuse it themselves."""
    if not (Path(rc.model_path) / "config.json").is_file():
        log.info("%s: no config.json here; the ranks check the split", rc.model_path)
        return
    from ...models.loader import CheckpointError, architecture_of, checkpoint_quantization, load_config
    from ...models.parallel.groups import ParallelConfig
    from ...models.quantization import QuantizationError, choose_quantization
    from ...models.split_check import SplitError, check_split

    try:
        config = load_config(rc.model_path)
        fp8 = None
        if rc.quantization == "fp8":  # FP8 on any GPU, so its blocks must survive the split (auto: the ranks check)
            try:
                fp8 = choose_quantization("fp8", checkpoint_quantization(config), architecture_of(config), None,
                                          rc.load_format == "dummy").fp8
            except QuantizationError as e:
                raise SpecError(f"spec.model.quantization: {e}") from e
        check_split(config, ParallelConfig(rc.tensor, rc.data, rc.expert), fp8)
    except (CheckpointError, SplitError) as e:
        raise SpecError(f"spec.parallelism: {e}") from e


# Ray's switch for multi-node clusters (read once, when ``ray`` is imported): on, a node asked for 127.0.0.1
# takes the address Ray probes for as its own instead (``ray._private.services.resolve_ip_for_localhost``) and
# its servers listen there and on every interface; off, they listen on 127.0.0.1 alone.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def embedded_ray_loopback() -> None:
    """The embedded Ray (one node, this process's) on loopback only: multi-node clusters off in the environment
    Ray and its processes read, unless it says otherwise. Call it before ``ray`` is imported."""
    os.environ.setdefault(RAY_CLUSTER_ENV, "0")


def embedded_ray_auth() -> Path | None:
    """Token authentication for the embedded Ray unless ``RAY_AUTH_MODE`` is set, the way the operator's
    pods have it (``auth_token.py``): a fresh token of this run in a file only this user can read, named
    by ``RAY_AUTH_TOKEN_PATH`` in the environment Ray's processes inherit. Returns the file's directory,
    to remove when the run ends (None: the environment's own settings, or its token, are used). Call it
    before ``ray`` is imported: Ray reads the mode once."""
    if auth_token.MODE_ENV in os.environ:
        return None
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get(auth_token.TOKEN_PATH_ENV):
        os.environ[auth_token.MODE_ENV] = "token"
        return None
    directory = Path(tempfile.mkdtemp(prefix="fusedserve-ray-auth-"))  # mode 0700
    os.environ.update(auth_token.token_env(str(auth_token.write_token_file(directory, auth_token.new_token()))))
    return directory


def connect_ray(rc: RuntimeConfig, address: str | None) -> ClusterShape:
    """Join the cluster at ``address``, or start an embedded one sized for ``rc``."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        deadline = time.monotonic() + RAY_CONNECT_TIMEOUT_S
        while True:  # in a pod, the head's `ray start` may still be coming up
            try:
                ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
                break
            except ConnectionError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no Ray cluster at {address} after {RAY_CONNECT_TIMEOUT_S:.0f}s: {e}") from e
                log.info("waiting for Ray at %s: %s", address, e)
                time.sleep(2.0)
        return _shape_of(ray.nodes())
    import torch

    gpus = torch.cuda.device_count() if rc.gpus_per_rank else 0
    common: dict[str, Any] = {"include_dashboard": False, "namespace": RAY_NAMESPACE, "log_to_driver": False,
                              "_node_ip_address": "127.0.0.1"}
    if gpus:
        ray.init(num_gpus=gpus, **common)
        _warn_unless_loopback(ray.get_runtime_context().gcs_address)
        return ClusterShape("GPU", gpus)
    fake = (rc.replicas + 1) * rc.ranks
    ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=0, resources={LOCAL_GPU_RESOURCE: fake}, **common)
    _warn_unless_loopback(ray.get_runtime_context().gcs_address)
    return ClusterShape(LOCAL_GPU_RESOURCE, fake)


def _warn_unless_loopback(gcs_address: str) -> None:
    host = gcs_address.rsplit(":", 1)[0].strip("[]")
    if host not in LOOPBACK_HOSTS:
        print(f"fusedserve: warning: the embedded Ray listens on {host}, not on loopback alone (ray was imported "
              f"before {RAY_CLUSTER_ENV}=0 could be set: `fusedserve run` sets it itself)", flush=True)


def _shape_of(nodes: list[dict[str, Any]]) -> ClusterShape:
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    gpus = max((r.get("GPU", 0.0) for r in alive), default=0.0)
    if gpus:
        return ClusterShape("GPU", int(gpus))
    return ClusterShape(LOCAL_GPU_RESOURCE, int(max((r.get(LOCAL_GPU_RESOURCE, 0.0) for r in alive), default=0.0)))


def run(manifest_path: str, smoke: bool = False, port: int | None = None, ray_address: str | None = None,
        host: str = "127.0.0.1", watch: bool = False, api_key: str | None = None) -> int:
    startup_gc.pause()  # until the API is up: torch, transformers, Ray (startup_gc.py)
    try:
        rc = load_runtime_config(manifest_path)  # before the heavy imports: a bad manifest fails fast
    except BaseException:
        startup_gc.resume()
        raise
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if not address:
        embedded_ray_loopback()
    token_dir = None if address else embedded_ray_auth()
    try:
        return _serve(rc, manifest_path, smoke, port, address, host, watch, api_key)
    finally:
        if token_dir is not None:  # after Ray has stopped: its processes read the file until then
            shutil.rmtree(token_dir, ignore_errors=True)


def _serve(rc: RuntimeConfig, manifest_path: str, smoke: bool, port: int | None, address: str | None, host: str,
           watch: bool, api_key: str | None) -> int:
    import ray

    from ..serving.access import ApiAccess
    from ..serving.drain import Drain
    from ..serving.http_api import build_app
    from ..serving.http_server import HttpServer
    from ..serving.metrics import MetricsRegistry
    from .group_controller import GroupController, GroupError

    signal.signal(signal.SIGTERM, _interrupt)  # while starting: unwind through the cleanup below
    t0 = time.time()
    cluster = connect_ray(rc, address)
    controller = GroupController(rc, cluster)
    drain = Drain(rc.limits.drain_grace_s)
    servers: list[Any] = []
    try:
        try:
            controller.start()
        except GroupError as e:
            print(f"fusedserve run: {rc.name}: {e.reason}", flush=True)
            return 1
        labels = {"deployment": rc.name, "namespace": rc.namespace}
        access = ApiAccess(api_key or None, rc.limits.health_needs_key, rc.limits.metrics_needs_key,
                           status_details=host in LOOPBACK_HOSTS)
        app = build_app(controller, MetricsRegistry(labels, model_name=rc.model_name), limits=rc.limits,
                        access=access, drain=drain)
        server = HttpServer(app, host=host, port=port if port is not None else rc.port, limits=rc.limits).start()
        servers.append(server)
        url = metrics_url = server.url
        if rc.metrics_port is not None and rc.metrics_port != server.port:  # a separate scrape port
            servers.append(HttpServer(app, host=host, port=rc.metrics_port, limits=rc.limits).start())
            metrics_url = servers[-1].url
        print(banner(rc, cluster.gpus, time.time() - t0, url, metrics_url, address), flush=True)
        if api_key is None and host not in LOOPBACK_HOSTS:
            print(f"fusedserve: warning: no API key; anyone who reaches {host}:{server.port} can use the API "
                  "(--api-key or $FUSEDSERVE_API_KEY)", flush=True)
        if rc.replicas == 0:
            print(f"  {NO_GROUPS_MARK}: /health answers 503 and /v1 'no ready engine groups' until scaled up",
                  flush=True)
        else:
            print(first_request(url, rc, smoke, api_key), flush=True)
        startup_gc.resume()
        if smoke:
            return 0
        wait_for_signals(lambda: reload(controller, manifest_path), manifest_path if watch else None)
        return 0
    finally:
        startup_gc.resume()  # (again) when the start failed
        if servers:
            shutdown_http(drain, quiet=smoke)
        for server in servers:
            server.stop()
        controller.shutdown()
        ray.shutdown()


def banner(rc: RuntimeConfig, gpus: int, seconds: float, url: str, metrics_url: str, address: str | None) -> str:
    import ray

    auth = "token authentication" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else "no authentication"
    ray_line = f"joined {address}" if address else f"embedded at {ray.get_runtime_context().gcs_address}, no dashboard"
    ready = (f"fusedserve: {rc.name} ready in {seconds:.1f}s: {rc.replicas} engine group(s) x {rc.ranks} rank(s) "
             f"(tp={rc.tensor} dp={rc.data} ep={rc.expert}) on {'GPUs' if gpus else 'CPU (gloo)'}")
    return "\n".join([
        ready,
        f"  OpenAI API: {url}/v1   status: {url}/status   metrics: {metrics_url}/metrics",
        f"  Ray: {ray_line}, {auth}"])


def reload(controller: Any, manifest_path: str) -> None:
    new = load_runtime_config(manifest_path)
    if new.limits != controller.config.limits:
        print("fusedserve: spec.serving limits take effect at the next start", flush=True)
    controller.apply(new)


def shutdown_http(drain: Any, quiet: bool = False) -> None:
    """Drain the API (a second SIGINT/SIGTERM ends the grace period early)."""
    stop_early = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_early.set())
    busy = drain.in_flight()
    if busy or not quiet:
        print(f"fusedserve: draining: {busy} request(s) in flight, grace period {drain.grace_s:.0f}s", flush=True)
    ended = drain.shutdown(stop_early)
    if busy or not quiet:
        print(f"fusedserve: shutting down ({ended} request(s) ended at the end of the grace period)", flush=True)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def wait_for_signals(reload: Any, watched: str | None = None) -> None:
    """Block until SIGINT/SIGTERM; SIGHUP, or a change of the ``watched`` file (a mounted ConfigMap,
    checked every 2 s), calls ``reload`` (errors are printed, serving goes on)."""
    stop = threading.Event()
    hup = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    seen, checked = (_digest(watched) if watched else None), time.monotonic()
    while not stop.wait(0.2):
        if watched and time.monotonic() - checked > WATCH_INTERVAL_S:
            checked = time.monotonic()
            now = _digest(watched)
            if now is not None and now != seen:
                seen = now
                hup.set()
        if hup.is_set():
            hup.clear()
            try:
                reload()
                print("fusedserve: manifest reloaded; rolling engine groups", flush=True)
            except (SpecError, ValueError) as e:
                print(f"fusedserve: reload refused: {e}", flush=True)


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _post(url: str, body: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
    """One JSON request with the standard library (the runtime needs no HTTP client package)."""
    import json
    import urllib.request

    headers = {"Content-Type": "application/json", **_auth_headers(api_key)}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def first_request(url: str, rc: RuntimeConfig, smoke: bool, api_key: str | None = None) -> str:
    """A warm-up completion (and with ``smoke`` a chat too) through the OpenAI API, and the key metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if rc.skip_tokenizer:  # token ids in, token ids out: a token-id prompt, no chat
        comp = _post(f"{url}/v1/completions", {"model": rc.model_name, "prompt": [1, 2, 3, 4], "max_tokens": 8,
                                                 "temperature": 0}, api_key)
        lines = [f"  completion (token ids, no tokenizer): {comp['usage']['completion_tokens']} tokens"]
    else:
        comp = _post(f"{url}/v1/completions", {"model": rc.model_name, "prompt": SMOKE_PROMPT, "max_tokens": 32,
                                                 "temperature": 0}, api_key)
        lines = [f"  completion: {SMOKE_PROMPT + comp['choices'][0]['text']!r}"]
    if smoke and not rc.skip_tokenizer:
        chat = _post(f"{url}/v1/chat/completions", {"model": rc.model_name, "max_tokens": 24, "temperature": 0,
                                                      "messages": [{"role": "user", "content": SMOKE_CHAT}]}, api_key)
        lines.append(f"  chat:       {chat['choices'][0]['message']['content']!r}")
    metrics_req = urllib.request.Request(f"{url}/metrics", headers=_auth_headers(api_key))
    with urllib.request.urlopen(metrics_req, timeout=30) as resp:
        metrics_text = resp.read().decode()
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    drafts = values.get("fusedserve_spec_decode_drafts_total", 0.0)
    accepted = values.get("fusedserve_spec_decode_accepted_tokens_total", 0.0)
    accept = f"{1 + accepted / drafts:.2f}" if drafts else "n/a (no speculation)"
    lines.append(f"  acceptance length: {accept}   generated tokens: "
                 f"{values.get('fusedserve_generation_tokens_total', 0):.0f}   collectives: "
                 f"{values.get('fusedserve_collective_calls_total', 0):.0f}   forwards: "
                 f"{values.get('fusedserve_forwards_total', 0):.0f}")
    return "\n".join(lines)
