"""Pod templates of the head and the workers from their ``PodSettings`` (pure).

Secure by default (both pods, and the model download's init container): run as the worker image's
non-root user (UID/GID 1000, files of mounted volumes owned by that group), RuntimeDefault seccomp, no
privilege escalation, every capability dropped. The user's ``podSecurityContext`` / ``securityContext``
override those defaults key by key (e.g. ``capabilities: {add: [IPC_LOCK], drop: [ALL]}`` for RDMA).
The head gets resource requests and limits by default (Guaranteed QoS: it serves every request and runs
the GCS, so it must not be the first pod evicted).
"""

from __future__ import annotations

import copy
from typing import Any

from fusedserve.worker.spec import SpecError

from .pod_types import PodSettings

RUN_AS = 1000  # the worker image's user (docker/worker.Dockerfile)
HEAD_RESOURCES = {"cpu": "4", "memory": "16Gi"}
GPU_RESOURCE = "nvidia.com/gpu"

POD_SECURITY_DEFAULTS: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_DEFAULTS: dict[str, Any] = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pod_security(settings: PodSettings) -> dict[str, Any]:
    return copy.deepcopy({**POD_SECURITY_DEFAULTS, **(settings.pod_security_context or {})})


def container_security(settings: PodSettings) -> dict[str, Any]:
    return copy.deepcopy({**CONTAINER_SECURITY_DEFAULTS, **(settings.security_context or {})})


def _quantities(values: dict[str, str | int]) -> dict[str, str]:
    return {k: str(v) for k, v in values.items()}


def head_resources(settings: PodSettings) -> dict[str, Any]:
    """Requests and limits of the head: the defaults unless ``head.resources`` gives its own."""
    if settings.resources is None:
        return {"requests": dict(HEAD_RESOURCES), "limits": dict(HEAD_RESOURCES)}
    out: dict[str, Any] = {}
    if settings.resources.requests:
        out["requests"] = _quantities(settings.resources.requests)
    if settings.resources.limits:
        out["limits"] = _quantities(settings.resources.limits)
    return out


def worker_resources(gpus: int, cpu: str | None, memory: str | None, settings: PodSettings) -> dict[str, Any]:
    """``spec.resources`` (GPUs from the sizing, cpu/memory requested = limited) plus ``workers.resources``."""
    limits: dict[str, str] = {GPU_RESOURCE: str(gpus)} if gpus else {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", cpu), ("memory", memory)):
        if value:
            limits[key] = requests[key] = value
    extra = settings.resources
    if extra is not None:
        if GPU_RESOURCE in extra.requests or GPU_RESOURCE in extra.limits:
            raise SpecError(f"spec.workers.resources: {GPU_RESOURCE} comes from the sizing "
                            "(spec.parallelism, spec.resources.gpusPerRank); leave it out")
        requests.update(_quantities(extra.requests))
        limits.update(_quantities(extra.limits))
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _named(items: list[dict[str, Any]], what: str, field: str) -> list[dict[str, Any]]:
    seen: set[str] = set()
    for item in items:
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{field}: every {what} needs a name")
        if name in seen:
            raise SpecError(f"{field}: two {what}s are named {name!r}")
        seen.add(name)
    return items


def container_env(settings: PodSettings) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in settings.env]


def pod_spec(settings: PodSettings, field: str, container: dict[str, Any], volumes: list[dict[str, Any]],
             init_containers: list[dict[str, Any]], node_selector: dict[str, str],
             tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod spec around ``container`` (which already has the operator's env, mounts and ports):
    the user's env, envFrom, volumes and mounts are added after the operator's; names may not clash."""
    container = dict(container)
    container["env"] = _named(list(container.get("env") or []) + container_env(settings), "env var", f"{field}.env")
    if not container["env"]:
        del container["env"]
    if settings.env_from:
        container["envFrom"] = list(container.get("envFrom") or []) + list(settings.env_from)
    mounts = list(container.get("volumeMounts") or []) + [m.model_dump(by_alias=True, exclude_none=True)
                                                          for m in settings.volume_mounts]
    if mounts:
        container["volumeMounts"] = mounts
    container["securityContext"] = container_security(settings)
    all_volumes = _named(volumes + list(settings.volumes), "volume", f"{field}.volumes")
    known = {v["name"] for v in all_volumes}
    for m in mounts:
        if m["name"] not in known:
            raise SpecError(f"{field}.volumeMounts: {m['name']!r} is not a volume of the pod")
    spec: dict[str, Any] = {"securityContext": pod_security(settings)}
    if init_containers:
        spec["initContainers"] = init_containers
    spec["containers"] = [container]
    if all_volumes:
        spec["volumes"] = all_volumes
    selector = {**node_selector, **settings.node_selector}
    if selector:
        spec["nodeSelector"] = selector
    tols = tolerations + [t.model_dump(by_alias=True, exclude_none=True) for t in settings.tolerations]
    if tols:
        spec["tolerations"] = tols
    if settings.affinity:
        spec["affinity"] = settings.affinity
    if settings.topology_spread_constraints:
        spec["topologySpreadConstraints"] = settings.topology_spread_constraints
    for key, value in (("priorityClassName", settings.priority_class_name),
                       ("schedulerName", settings.scheduler_name),
                       ("serviceAccountName", settings.service_account_name)):
        if value:
            spec[key] = value
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in settings.image_pull_secrets]
    return spec


def template_metadata(labels: dict[str, str], annotations: dict[str, str],
                      settings: PodSettings) -> dict[str, Any]:
    """The operator's labels win over the user's (selectors depend on them)."""
    meta: dict[str, Any] = {"labels": {**settings.labels, **labels}}
    merged = {**settings.annotations, **annotations}
    if merged:
        meta["annotations"] = merged
    return meta
