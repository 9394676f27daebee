"""InferenceDeployment API types (fusedserve.io/v1alpha1): the single source of the CRD.

The runtime part of the spec (model, replicas, parallelism, communication, speculative,
serving, resources) is ``fusedserve.worker.spec.DeploymentSpec``; Kubernetes adds the image,
Ray version, placement, rollout, suspend, restart token and monitoring. ``crd.py`` turns these
types into ``crds/fusedserve.io_inferencedeployments.yaml``. No torch or ray import here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fusedserve.worker.spec import DeploymentSpec, SpecModel

GROUP = "fusedserve.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]
CATEGORIES = ["fusedserve", "all"]


class Toleration(SpecModel):
    key: str | None = Field(default=None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=253)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


class PlacementSpec(SpecModel):
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    gpu_type: str | None = Field(default=None, max_length=128, description="e.g. nvidia.com/gpu.product value")
    gpus_per_node: int = Field(default=8, ge=1, le=16, description="GPUs of one worker node")


class RolloutSpec(SpecModel):
    max_unavailable: int = Field(default=0, ge=0, le=128, description="engine groups down at once during a roll")
    max_surge: int = Field(default=1, ge=0, le=128, description="extra engine groups during a roll")


class MonitoringSpec(SpecModel):
    pod_monitor: bool = Field(default=True, description="create a PodMonitor when the Prometheus Operator CRD exists")


class InferenceDeploymentSpec(DeploymentSpec):
    image: str = Field(default="ghcr.io/fusedserve/worker:0.1.0", min_length=1, max_length=512)
    ray_version: str = Field(default="2.60.0", max_length=32, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    placement: PlacementSpec = PlacementSpec()
    rollout: RolloutSpec = RolloutSpec()
    suspend: bool = False
    restart_token: str | None = Field(default=None, max_length=63, description="change it to recreate every group")
    monitoring: MonitoringSpec = MonitoringSpec()


class Condition(BaseModel):
    """metav1.Condition."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    type: Literal["Ready", "Progressing", "Scheduled", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = Field(default=None, alias="observedGeneration", ge=0)
    last_transition_time: str = Field(alias="lastTransitionTime", description="RFC 3339")
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)


class GroupStatus(SpecModel):
    index: int = Field(ge=0)
    revision: str = Field(max_length=63)
    phase: Literal["Pending", "Starting", "Ready", "Failed", "Terminating"]
    nodes: list[str] = Field(default_factory=list, max_length=64)


class SpeculativeStatus(SpecModel):
    acceptance_length: str | None = Field(default=None, max_length=16,
                                          description="1 + accepted/drafts, as text (e.g. \"2.31\")")


class QuantizationStatus(SpecModel):
    checkpoint: Literal["fp8"] | None = Field(default=None, description="the checkpoint's quantization "
                                              "(config.json quantization_config); null = unquantized")
    weights: Literal["fp8", "dequantized", "unquantized"] = Field(
        description="how the engine keeps them: fp8 (block-scaled FP8 GEMMs), dequantized at load, or unquantized")
    weight_block_size: list[int] | None = Field(default=None, max_length=2)
    description: str = Field(default="", max_length=256)


class InferenceDeploymentStatus(SpecModel):
    observed_generation: int | None = Field(default=None, ge=0)
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    selector: str | None = Field(default=None, max_length=1024)
    conditions: list[Condition] = Field(default_factory=list, max_length=8)
    groups: list[GroupStatus] = Field(default_factory=list, max_length=128)
    endpoint: str | None = Field(default=None, max_length=512)
    speculative: SpeculativeStatus | None = None
    quantization: QuantizationStatus | None = None


class InferenceDeployment(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["fusedserve.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceDeployment"]
    metadata: dict[str, Any]
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None
