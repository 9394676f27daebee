"""`fusedserve run FILE`: embedded local Ray + group controller + HTTP API, until Ctrl-C.

Without GPUs every rank is a CPU actor (gloo) holding one unit of the custom resource
``fake_gpu``. ``--smoke`` sends a completion and a chat request with the openai client, prints
them and the key metrics, and exits (what `make run` does).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .config import Manifest, SpecError, load_manifest

log = logging.getLogger(__name__)


def _resolve_paths(manifest: Manifest, manifest_path: str) -> Manifest:
    """Relative checkpoint paths are relative to the working directory, else to the manifest."""
    def resolve(p: str) -> str:
        for base in (Path.cwd(), Path(manifest_path).resolve().parent):
            if (base / p).exists():
                return str((base / p).resolve())
        if not Path(p).is_absolute():
            raise SpecError(f"spec.model.path / draftModel {p!r} does not exist here")
        return p

    spec = manifest.spec
    model = spec.model.model_copy(update={"path": resolve(spec.model.path)})
    speculative = spec.speculative
    if speculative is not None:
        speculative = speculative.model_copy(update={"draft_model": resolve(speculative.draft_model)})
    return manifest.model_copy(update={"spec": spec.model_copy(update={"model": model, "speculative": speculative})})


def start_local_ray(manifest: Manifest) -> bool:
    """Start an embedded Ray sized for the spec; returns whether it has GPUs."""
    import ray
    import torch

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ranks = manifest.spec.replicas * manifest.spec.parallelism.tensor
    gpus = torch.cuda.device_count()
    if gpus:
        ray.init(num_gpus=gpus, include_dashboard=False, namespace="fusedserve", log_to_driver=False)
        return True
    ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=0, resources={"fake_gpu": ranks},
             include_dashboard=False, namespace="fusedserve", log_to_driver=False)
    return False


def run(manifest_path: str, smoke: bool = False, port: int | None = None) -> int:
    import ray

    from .group_controller import GroupController
    from .http_api import build_app
    from .http_server import HttpServer
    from .metrics import MetricsRegistry

    manifest = _resolve_paths(load_manifest(manifest_path), manifest_path)
    gpus = start_local_ray(manifest)
    controller = GroupController(manifest, gpus=gpus)
    server = None
    try:
        t0 = time.time()
        controller.start()
        labels = {"deployment": manifest.metadata.name, "namespace": manifest.metadata.namespace}
        app = build_app(controller, MetricsRegistry(labels))
        server = HttpServer(app, host="127.0.0.1", port=port if port is not None else manifest.spec.serving.port)
        server.start()
        url = server.url
        print(f"fusedserve: {manifest.metadata.name} ready in {time.time() - t0:.1f}s "
              f"({manifest.spec.replicas} group(s) x tp={manifest.spec.parallelism.tensor})", flush=True)
        print(f"  OpenAI API: {url}/v1   status: {url}/status   metrics: {url}/metrics", flush=True)
        first = _first_request(url, controller.model_name)
        print(first, flush=True)
        if smoke:
            return 0
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        print("fusedserve: shutting down", flush=True)
        return 0
    finally:
        if server is not None:
            server.stop()
        controller.shutdown()
        ray.shutdown()


def _first_request(url: str, model: str) -> str:
    """One completion and one chat with the openai client, and the acceptance length so far."""
    from openai import OpenAI
    from prometheus_client.parser import text_string_to_metric_families

    import httpx

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    comp = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=32, temperature=0)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "import os"}],
                                          max_tokens=24, temperature=0)
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    drafts = values.get("fusedserve_spec_decode_drafts_total", 0.0)
    accepted = values.get("fusedserve_spec_decode_accepted_tokens_total", 0.0)
    accept = f"{1 + accepted / drafts:.2f}" if drafts else "n/a (no speculation)"
    lines = [
        "  completion: " + repr("def fibonacci(n):" + comp.choices[0].text),
        "  chat:       " + repr(chat.choices[0].message.content),
        f"  acceptance length: {accept}   generated tokens: {values.get('fusedserve_generation_tokens_total', 0):.0f}"
        f"   collectives: {values.get('fusedserve_collective_calls_total', 0):.0f}",
    ]
    return "\n".join(lines)


def describe(manifest: Any) -> str:
    return f"{manifest.metadata.namespace}/{manifest.metadata.name}"
