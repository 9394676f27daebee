"""The KubeRay RayCluster of a deployment (pure): a head running the group controller, one GPU worker group.

Pods: pod_template.py (settings, secure defaults, resources), model_source.py (volumes and the download
init container), ray_auth.py (Ray's token). ``pod_revision`` names what needs new pods: its hash is part
of the cluster's name, so such a change is a new RayCluster (rollout.py), not an edit KubeRay ignores.

Sizing: an engine group (``parallelism.tensor`` ranks) fits in one node, so a worker pod holds
``gpusPerNode // tensor`` groups; the worker group has room for ``replicas + rollout.maxSurge``
groups (the surge is where a spec change rolls a new group before the old one goes).
``suspend`` keeps the objects and suspends the RayCluster (KubeRay deletes its pods).

The head's container runs KubeRay's generated ``ray start`` (``$KUBERAY_GEN_RAY_START_CMD``, kept
by the ``ray.io/overwrite-container-cmd`` annotation) in the background and then the group
controller: ``fusedserve run`` on the mounted engine config, joining the local Ray, watching
the file, serving the OpenAI API, /status and /metrics on the pod's ``http`` port.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from fusedserve.worker.spec import ServingLimits, SpecError

from . import model_source, pod_template, ray_auth
from .api import InferenceDeploymentSpec
from .engine_config import CONFIG_DIR, CONFIG_FILE
from .model_source import ModelSources
from .naming import ANNOTATION_CONFIG_HASH, ANNOTATION_REVISION, Owner

API_KEY_ENV = "FUSEDSERVE_API_KEY"  # the head's HTTP server checks Authorization: Bearer against it
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CPU_RANK_RESOURCE = "fake_gpu"  # worker.placement.LOCAL_GPU_RESOURCE: CPU ranks (gloo) when gpusPerRank is 0
WORKER_GROUP = "gpu"
SHM_SIZE = "16Gi"  # NCCL's shared-memory transport between ranks of one pod; CPU ranks' all-reduce segments
RAY_START = "ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD"


@dataclass(frozen=True)
class WorkerSizing:
    pods: int
    gpus_per_pod: int
    groups: int  # engine groups there is room for


def worker_sizing(spec: InferenceDeploymentSpec) -> WorkerSizing:
    tp, per_node = spec.parallelism.tensor, spec.placement.gpus_per_node
    if tp > per_node:
        raise SpecError(f"spec.parallelism.tensor={tp} exceeds spec.placement.gpusPerNode={per_node}: "
                        "an engine group must fit in one node")
    if spec.suspend or spec.replicas == 0:
        return WorkerSizing(0, 0, 0)
    groups = spec.replicas + spec.rollout.max_surge
    groups_per_pod = per_node // tp
    pods = -(-groups // groups_per_pod)
    gpus_per_pod = groups * tp if pods == 1 else groups_per_pod * tp
    return WorkerSizing(pods, gpus_per_pod, groups)


def controller_command(spec: InferenceDeploymentSpec) -> str:
    return (f"{RAY_START} & exec fusedserve run {CONFIG_DIR}/{CONFIG_FILE} --host 0.0.0.0 "
            f"--ray-address 127.0.0.1:6379 --watch")


def _image_fields(spec: InferenceDeploymentSpec, image: str) -> dict[str, Any]:
    out: dict[str, Any] = {"image": image}
    if spec.image_pull_policy:
        out["imagePullPolicy"] = spec.image_pull_policy
    return out


def _head(owner: Owner, spec: InferenceDeploymentSpec, cluster: str, config_hash: str, image: str,
          sources: ModelSources) -> dict[str, Any]:
    settings = spec.head
    ports = [{"name": "http", "containerPort": spec.serving.port, "protocol": "TCP"},
             {"name": "gcs", "containerPort": 6379, "protocol": "TCP"}]
    if spec.serving.metrics_port is not None and spec.serving.metrics_port != spec.serving.port:
        ports.append({"name": "metrics", "containerPort": spec.serving.metrics_port, "protocol": "TCP"})
    env = ray_auth.token_env()
    key = spec.serving.api_key_secret
    if key is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}}})
    container = {
        "name": "ray-head", **_image_fields(spec, image),
        "command": ["/bin/bash", "-lc", "--"], "args": [controller_command(spec)],
        "env": env,
        "ports": ports,
        "resources": pod_template.head_resources(settings),
        "volumeMounts": [{"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True},
                         ray_auth.token_mount(), *model_source.volume_mounts(sources)],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
    }
    volumes = [{"name": "engine-config", "configMap": {"name": owner.config_map(cluster)}},
               ray_auth.token_volume(owner), *model_source.volumes(sources, spec)]
    init = model_source.init_container(sources, spec, image, pod_template.container_security(settings),
                                       weights=False)
    pod = pod_template.pod_spec(settings, "spec.head", container, volumes, [init] if init else [], {}, [])
    # SIGTERM drains the API (drainGracePeriodSeconds), then the group controller stops: the kubelet waits for both
    pod["terminationGracePeriodSeconds"] = spec.serving.termination_grace_period_seconds
    labels = {**owner.labels("head"), **owner.pod_labels()}
    return {
        "serviceType": "ClusterIP",
        # The dashboard (Ray's job submission API) only on loopback: nothing outside the pod reaches it.
        "rayStartParams": {"num-gpus": "0", "dashboard-host": "127.0.0.1"},
        "template": {"metadata": pod_template.template_metadata(labels, {ANNOTATION_CONFIG_HASH: config_hash},
                                                                settings),
                     "spec": pod},
    }


def _workers(owner: Owner, spec: InferenceDeploymentSpec, sizing: WorkerSizing, image: str,
             sources: ModelSources) -> dict[str, Any]:
    placement, settings = spec.placement, spec.workers
    node_selector = dict(placement.node_selector)
    if placement.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = placement.gpu_type
    start: dict[str, str] = {}
    if spec.resources.gpus_per_rank:
        start["num-gpus"] = str(sizing.gpus_per_pod)
    else:  # CPU ranks: the custom resource the placement planner counts instead of GPUs
        start["resources"] = f'"{{\\"{CPU_RANK_RESOURCE}\\": {sizing.gpus_per_pod}}}"'
    gpus = sizing.gpus_per_pod if spec.resources.gpus_per_rank else 0
    container = {
        "name": "ray-worker", **_image_fields(spec, image),
        "command": ["/bin/bash", "-lc", "--"], "args": [RAY_START],
        "env": ray_auth.token_env(),
        "resources": pod_template.worker_resources(gpus, spec.resources.cpu, spec.resources.memory, settings),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, ray_auth.token_mount(),
                         *model_source.volume_mounts(sources)],
    }
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
               ray_auth.token_volume(owner), *model_source.volumes(sources, spec)]
    init = model_source.init_container(sources, spec, image, pod_template.container_security(settings),
                                       weights=True)
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations]
    pod = pod_template.pod_spec(settings, "spec.workers", container, volumes, [init] if init else [],
                                node_selector, tolerations)
    labels = {**owner.labels("worker"), **owner.pod_labels()}
    return {
        "groupName": WORKER_GROUP,
        "replicas": sizing.pods, "minReplicas": 0, "maxReplicas": max(sizing.pods, 1),
        "rayStartParams": start,
        "template": {"metadata": pod_template.template_metadata(labels, {}, settings), "spec": pod},
    }


def desired_ray_cluster(owner: Owner, spec: InferenceDeploymentSpec, name: str, config_hash: str,
                        image: str) -> dict[str, Any]:
    sizing = worker_sizing(spec)
    sources = ModelSources.of(spec)
    revision = pod_revision(owner, spec, image)
    meta = owner.metadata(name, "ray-cluster", {"ray.io/overwrite-container-cmd": "true",
                                                 ANNOTATION_REVISION: revision})
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": meta,
        "spec": {
            "rayVersion": spec.ray_version,
            "suspend": spec.suspend,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head(owner, spec, name, config_hash, image, sources),
            "workerGroupSpecs": [_workers(owner, spec, sizing, image, sources)],
        },
    }


def pod_revision(owner: Owner, spec: InferenceDeploymentSpec, image: str) -> str:
    """A hash of everything KubeRay would need new pods for: the pod templates and Ray's start parameters,
    without the worker count (KubeRay scales in place), ``suspend`` and the engine config (rolled inside
    the cluster by the group controller); a suspended deployment keeps the revision it resumes with. The
    HTTP server's limits (``ServingLimits``: body size, timeouts, auth of /health and /metrics, drain) count
    too: the head reads them once, when it starts."""
    spec = spec.model_copy(update={"suspend": False})
    sizing, sources = worker_sizing(spec), ModelSources.of(spec)
    head = _head(owner, spec, "", "", image, sources)
    workers = _workers(owner, spec, sizing, image, sources)
    for key in ("replicas", "minReplicas", "maxReplicas"):
        workers.pop(key)
    limits = dataclasses.asdict(ServingLimits.from_spec(spec.serving))
    blob = json.dumps({"rayVersion": spec.ray_version, "head": head, "workers": workers, "httpLimits": limits},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
