"""Kubernetes-shaped parts of the InferenceDeployment spec: pod settings, Secret references, model storage,
the NetworkPolicy's peers and the PodDisruptionBudget (API types only; the planners read them).

Fields whose full Kubernetes schema is large and stable (affinity, topology spread constraints, volumes,
envFrom, security contexts) are kept as objects the API server does not check here: the operator passes
them into the RayCluster's pod templates, where KubeRay's CRD schema checks them, and an apply the API
server refuses (422) is reported like an invalid spec.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from fusedserve.worker.spec import SpecModel

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i?|[mkMGTPE]|u|n)?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


class Toleration(SpecModel):
    key: str | None = Field(default=None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=253)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


class SecretKeyRef(SpecModel):
    """One key of a Secret in the deployment's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field(min_length=1, max_length=253, pattern=SECRET_KEY)


class SecretRef(SpecModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class LocalObjectReference(SpecModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


Quantity = Annotated[str | int, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


class ResourceRequirements(SpecModel):
    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


class EnvVar(SpecModel):
    name: str = Field(min_length=1, max_length=256, pattern=ENV_NAME)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(default=None, description="a core/v1 EnvVarSource")


class VolumeMount(SpecModel):
    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    mount_path: str = Field(min_length=1, max_length=1024)
    read_only: bool = False
    sub_path: str | None = Field(default=None, max_length=1024)


class PodSettings(SpecModel):
    """Pod and container settings of the head or of the workers (core/v1 names and meanings).

    Security defaults (both kinds of pods): runAsNonRoot as UID/GID 1000 (the worker image's user),
    RuntimeDefault seccomp, no privilege escalation, every capability dropped; ``securityContext`` and
    ``podSecurityContext`` override them key by key."""

    resources: ResourceRequirements | None = Field(
        default=None, description="the head's defaults to 4 CPUs / 16Gi requested and limited; the workers' "
                                  "add to spec.resources (their GPUs always come from the sizing)")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    affinity: dict[str, Any] | None = Field(default=None, description="a core/v1 Affinity")
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list, max_length=16,
                                                              description="core/v1 TopologySpreadConstraints")
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    scheduler_name: str | None = Field(default=None, max_length=253,
                                       description="e.g. a gang scheduler (Volcano, Kueue's)")
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    service_account_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    env_from: list[dict[str, Any]] = Field(default_factory=list, max_length=16, description="core/v1 EnvFromSources")
    volumes: list[dict[str, Any]] = Field(default_factory=list, max_length=32, description="core/v1 Volumes")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32)
    security_context: dict[str, Any] | None = Field(default=None, description="core/v1 SecurityContext overrides")
    pod_security_context: dict[str, Any] | None = Field(default=None,
                                                        description="core/v1 PodSecurityContext overrides")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)


class CacheSpec(SpecModel):
    claim_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="a PersistentVolumeClaim (ReadWriteMany) shared by every pod, so replicas download once; "
                    "default: an emptyDir per pod")
    size_limit: str | None = Field(default=None, pattern=QUANTITY, description="of the emptyDir cache")


class HuggingFaceSpec(SpecModel):
    token_secret: SecretKeyRef | None = Field(default=None, description="given to the download as $HF_TOKEN")
    endpoint: str | None = Field(default=None, max_length=512, description="a Hub mirror ($HF_ENDPOINT)")


class S3Spec(SpecModel):
    credentials_secret: SecretRef | None = Field(
        default=None, description="a Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and optionally "
                                  "AWS_SESSION_TOKEN), given to the download as environment")
    endpoint: str | None = Field(default=None, max_length=512, description="an S3-compatible endpoint URL")
    region: str | None = Field(default=None, max_length=64)


class ModelStorageSpec(SpecModel):
    """Where hf:// and s3:// models are downloaded to (by an init container of each pod) and with what."""

    cache: CacheSpec = CacheSpec()
    hugging_face: HuggingFaceSpec = HuggingFaceSpec()
    s3: S3Spec = S3Spec()


class LabelSelectorRequirement(SpecModel):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=64)


class LabelSelector(SpecModel):
    match_labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)


class IPBlock(SpecModel):
    cidr: str = Field(min_length=1, max_length=64)
    except_: list[str] = Field(default_factory=list, alias="except", max_length=32)


class NetworkPeer(SpecModel):
    """A networking/v1 NetworkPolicyPeer."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None


class NetworkPolicySpec(SpecModel):
    """Only the deployment's own pods talk Ray (every port) to each other; the API port takes the operator
    (it reads /status) and ``apiClients``; the metrics port ``metricsClients`` (on the API port when the
    metrics share it)."""

    enabled: bool = True
    api_clients: list[NetworkPeer] | None = Field(default=None, max_length=32,
                                                  description="default: every pod of the deployment's namespace")
    metrics_clients: list[NetworkPeer] | None = Field(
        default=None, max_length=32, description="default: pods labelled app.kubernetes.io/name=prometheus, "
                                                 "in any namespace")


class ServiceSettings(SpecModel):
    """The API Service: its type and metadata (e.g. a cloud load balancer's annotations)."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)


class PodDisruptionBudgetSpec(SpecModel):
    enabled: bool = True
    max_unavailable: int = Field(default=1, ge=0, le=1024,
                                 description="pods of the serving RayCluster a voluntary disruption may take at once")
