"""InferenceDeployment API types (fusedserve.io/v1alpha1): the single source of the CRD.

The runtime part of the spec (model, replicas, parallelism, communication, speculative,
serving, resources) is ``fusedserve.worker.spec.DeploymentSpec``; Kubernetes adds the image,
Ray version, placement, rollout, suspend, restart token, monitoring, where the model comes from
(``model.uri``, ``modelStorage``), pod settings of the head and the workers, the API key Secret,
the NetworkPolicy and the PodDisruptionBudget. The runtime only ever sees a local model path:
the operator turns ``model.uri`` into the path it mounts (model_source.py). ``crd.py`` turns these
types into ``crds/fusedserve.io_inferencedeployments.yaml``. No torch or ray import here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fusedserve.worker.spec import DeploymentSpec, ModelSpec, ServingSpec, SpecModel

from .pod_types import (
    DNS_SUBDOMAIN,
    ModelStorageSpec,
    NetworkPolicySpec,
    PodDisruptionBudgetSpec,
    PodSettings,
    SecretKeyRef,
    ServiceSettings,
    Toleration,
)

GROUP = "fusedserve.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]
CATEGORIES = ["fusedserve", "all"]


class PlacementSpec(SpecModel):
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    gpu_type: str | None = Field(default=None, max_length=128, description="e.g. nvidia.com/gpu.product value")
    gpus_per_node: int = Field(default=8, ge=1, le=16, description="GPUs of one worker node")


class RolloutSpec(SpecModel):
    max_unavailable: int = Field(default=0, ge=0, le=128, description="engine groups down at once during a roll")
    max_surge: int = Field(default=1, ge=0, le=128, description="extra engine groups during a roll")
    cluster_deletion_delay_seconds: int = Field(
        default=60, ge=0, le=3600,
        description="a change that needs new pods brings up a new RayCluster and switches the Service to it "
                    "once it serves; the old one is deleted this long after the switch")


# hf://org/name[@revision], s3://bucket[/prefix], pvc://claim[/path], or a plain path in the image (no colon)
MODEL_URI = (r"^(hf://([A-Za-z0-9][-A-Za-z0-9_.]*/)?[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]+)?"
             r"|s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/[^\s]*)?"
             r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^\s]*)?"
             r"|[^:\s]+)$")


class ModelSource(ModelSpec):
    """The runtime's model settings, located by ``uri`` (hf://, s3://, pvc:// or a path) or, as the runtime has
    it, ``path`` (a path in the image). The runtime manifest gets ``path`` = where the pods mount the source."""

    uri: str | None = Field(default=None, min_length=1, max_length=1024, pattern=MODEL_URI,
                            description="hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path, or a path")
    path: str | None = Field(default=None, min_length=1, max_length=1024,  # type: ignore[assignment]
                             description="checkpoint directory (HF layout) in the worker image")

    @model_validator(mode="after")
    def _one_location(self) -> ModelSource:
        if (self.uri is None) == (self.path is None):
            raise ValueError("set exactly one of uri and path")
        return self

    @property
    def location(self) -> str:
        return self.uri if self.uri is not None else str(self.path)


HEALTH_NEEDS_NO_KEY = ("spec.serving.auth.health must be public on Kubernetes: the head's readiness probe "
                       "(the kubelet) sends no API key")


class ServingSettings(ServingSpec):
    """The runtime's serving settings plus what only Kubernetes has: the API key's Secret."""

    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="the API key clients send as `Authorization: Bearer`; given to the head as "
                                  "$FUSEDSERVE_API_KEY")

    @model_validator(mode="after")
    def _probe_reaches_health(self) -> ServingSettings:
        if self.auth.health == "apiKey":
            raise ValueError(HEALTH_NEEDS_NO_KEY)
        return self


class MonitoringSpec(SpecModel):
    pod_monitor: bool = Field(default=True, description="create a PodMonitor when the Prometheus Operator CRD exists")


class InferenceDeploymentSpec(DeploymentSpec):
    model: ModelSource
    serving: ServingSettings = ServingSettings()
    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="worker image of the head and the workers (default: the operator's)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    ray_version: str = Field(default="2.60.0", max_length=32, pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    placement: PlacementSpec = PlacementSpec()
    rollout: RolloutSpec = RolloutSpec()
    suspend: bool = False
    restart_token: str | None = Field(default=None, max_length=63, description="change it to recreate every group")
    monitoring: MonitoringSpec = MonitoringSpec()
    model_storage: ModelStorageSpec = ModelStorageSpec()
    head: PodSettings = PodSettings()
    workers: PodSettings = PodSettings()
    service: ServiceSettings = ServiceSettings()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    pod_disruption_budget: PodDisruptionBudgetSpec = PodDisruptionBudgetSpec()


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
    ray_cluster: str | None = Field(default=None, max_length=63, pattern=DNS_SUBDOMAIN,
                                    description="the RayCluster the Service sends requests to")
    pending_ray_cluster: str | None = Field(default=None, max_length=63, pattern=DNS_SUBDOMAIN,
                                            description="a new RayCluster coming up, switched to once it serves")


class InferenceDeployment(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["fusedserve.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceDeployment"]
    metadata: dict[str, Any]
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None
