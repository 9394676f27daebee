"""The KubeRay RayCluster of a deployment (pure): a head running the group controller, one GPU worker group.

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

from dataclasses import dataclass
from typing import Any

from fusedserve.worker.spec import SpecError

from .api import InferenceDeploymentSpec
from .engine_config import CONFIG_DIR, CONFIG_FILE
from .naming import ANNOTATION_CONFIG_HASH, Owner

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CPU_RANK_RESOURCE = "fake_gpu"  # worker.placement.LOCAL_GPU_RESOURCE: CPU ranks (gloo) when gpusPerRank is 0
WORKER_GROUP = "gpu"
SHM_SIZE = "16Gi"  # NCCL's shared-memory transport between ranks of one pod
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


def _resources(spec: InferenceDeploymentSpec, gpus: int) -> dict[str, Any]:
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.resources.gpus_per_rank and gpus:
        limits[GPU_RESOURCE] = str(gpus)
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value:
            limits[key] = requests[key] = value
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def controller_command(spec: InferenceDeploymentSpec) -> str:
    return (f"{RAY_START} & exec fusedserve run {CONFIG_DIR}/{CONFIG_FILE} --host 0.0.0.0 "
            f"--ray-address 127.0.0.1:6379 --watch")


def _head(owner: Owner, spec: InferenceDeploymentSpec, config_hash: str) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": spec.serving.port, "protocol": "TCP"},
             {"name": "gcs", "containerPort": 6379, "protocol": "TCP"},
             {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"}]
    if spec.serving.metrics_port is not None and spec.serving.metrics_port != spec.serving.port:
        ports.append({"name": "metrics", "containerPort": spec.serving.metrics_port, "protocol": "TCP"})
    container = {
        "name": "ray-head", "image": spec.image,
        "command": ["/bin/bash", "-lc", "--"], "args": [controller_command(spec)],
        "ports": ports,
        "volumeMounts": [{"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
    }
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": {"labels": owner.labels("head"), "annotations": {ANNOTATION_CONFIG_HASH: config_hash}},
            "spec": {
                "containers": [container],
                "volumes": [{"name": "engine-config", "configMap": {"name": owner.config_map}}],
            },
        },
    }


def _workers(owner: Owner, spec: InferenceDeploymentSpec, sizing: WorkerSizing) -> dict[str, Any]:
    placement = spec.placement
    node_selector = dict(placement.node_selector)
    if placement.gpu_type:
        node_selector[GPU_PRODUCT_LABEL] = placement.gpu_type
    start: dict[str, str] = {}
    if spec.resources.gpus_per_rank:
        start["num-gpus"] = str(sizing.gpus_per_pod)
    else:  # CPU ranks: the custom resource the placement planner counts instead of GPUs
        start["resources"] = f'"{{\\"{CPU_RANK_RESOURCE}\\": {sizing.gpus_per_pod}}}"'
    pod_spec: dict[str, Any] = {
        "containers": [{
            "name": "ray-worker", "image": spec.image,
            "command": ["/bin/bash", "-lc", "--"], "args": [RAY_START],
            "resources": _resources(spec, sizing.gpus_per_pod),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if placement.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations]
    return {
        "groupName": WORKER_GROUP,
        "replicas": sizing.pods, "minReplicas": 0, "maxReplicas": max(sizing.pods, 1),
        "rayStartParams": start,
        "template": {"metadata": {"labels": owner.labels("worker")}, "spec": pod_spec},
    }


def desired_ray_cluster(owner: Owner, spec: InferenceDeploymentSpec, config_hash: str) -> dict[str, Any]:
    sizing = worker_sizing(spec)
    meta = owner.metadata(owner.ray_cluster, "ray-cluster", {"ray.io/overwrite-container-cmd": "true"})
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": meta,
        "spec": {
            "rayVersion": spec.ray_version,
            "suspend": spec.suspend,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head(owner, spec, config_hash),
            "workerGroupSpecs": [_workers(owner, spec, sizing)],
        },
    }
