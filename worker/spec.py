"""The InferenceDeployment spec (runtime part) and the frozen config the runtime uses: the public
types of ``fusedserve.worker`` and the only module of it the operator imports.

One manifest is the input both locally (`fusedserve run file.yaml`) and on Kubernetes (the
operator extends ``DeploymentSpec`` with placement, image, rollout...). No torch or ray import
here.

    apiVersion: fusedserve.io/v1alpha1
    kind: InferenceDeployment
    metadata: {name: tiny-code, namespace: default}
    spec:
      model: {path: examples/checkpoints/tiny-code, dtype: float32, quantization: auto}
      replicas: 1
      parallelism: {tensor: 2, data: 1, expert: 1, dataParallelAttention: false}
      communication: {allReduceFusion: auto}
      speculative: {method: eagle3, draftModel: examples/checkpoints/tiny-code-eagle3, numSteps: 3}
      serving: {port: 8000, maxBatchTokens: 2048, maxSequences: 64, kvCacheFraction: 0.9,
                drainGracePeriodSeconds: 30, maxRequestBytes: 8388608, auth: {health: public}}

``RuntimeConfig.from_manifest(manifest)`` is the frozen value the Ray runtime works from (rank
actors, placement, the group controller); its ``revision`` changes exactly when running engine
groups must be rebuilt (a new ``replicas`` count, HTTP port or HTTP limit does not roll them).
The HTTP server's bounds (``spec.serving``: drain grace period, body size, sequences per request,
timeouts, connections, which routes need the API key) are one frozen ``ServingLimits``;
docs/serving.md explains each.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

API_VERSION = "fusedserve.io/v1alpha1"
KIND = "InferenceDeployment"
RESTART_TOKEN_ANNOTATION = "fusedserve.io/restart-token"


class SpecError(ValueError):
    """An invalid manifest; the message names every offending field."""


class SpecModel(BaseModel):
    """Base of every spec section: camelCase aliases, unknown fields refused, frozen."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ModelSpec(SpecModel):
    path: str = Field(min_length=1, max_length=1024, description="checkpoint directory (HF layout) in the worker")
    name: str | None = Field(default=None, max_length=253, description="served model name (default: deployment name)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Block-FP8 checkpoints (DeepSeek-V3 / Kimi-K2 releases, detected from config.json's quantization_config):
    # auto keeps them in FP8 with FP8 GEMMs where the GPU has them (SM89+) and dequantizes them to dtype
    # elsewhere; fp8 requires the FP8 path (an unquantized checkpoint or an unfit GPU fails the group);
    # none refuses it: the weights are dequantized to dtype at load. models/quantization.py decides per rank.
    quantization: Literal["auto", "fp8", "none"] = "auto"
    # dummy: random weights from config.json alone (benchmarks at real shapes; vLLM's --load-format dummy)
    load_format: Literal["auto", "dummy"] = "auto"
    # serve token ids only, no tokenizer (vLLM's --skip-tokenizer-init): prompts must be token-id lists
    skip_tokenizer: bool = False


class ParallelismSpec(SpecModel):
    tensor: int = Field(default=1, ge=1, le=64, description="ranks (GPUs) per engine group")
    data: int = Field(default=1, ge=1, le=64, description="attention data-parallel groups inside an engine group")
    expert: int = Field(default=1, ge=1, le=64, description="expert-parallel ranks")
    data_parallel_attention: bool = False

    @model_validator(mode="after")
    def _divides(self) -> ParallelismSpec:
        if self.tensor % self.data:
            raise ValueError(f"data={self.data} must divide tensor={self.tensor}")
        if self.tensor % self.expert:
            raise ValueError(f"expert={self.expert} must divide tensor={self.tensor}")
        if self.data_parallel_attention and self.data < 2:
            raise ValueError("dataParallelAttention needs data > 1")
        if self.data > 1 and not self.data_parallel_attention:
            raise ValueError("data > 1 means attention data parallelism: set dataParallelAttention: true "
                             "(independent engine copies are spec.replicas)")
        return self


class Fusion(str, Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class CommunicationSpec(SpecModel):
    # allReduceFusion: FlashInfer's fused all-reduce + add + RMSNorm (auto: where the GPU can run it; on: else
    # the reference all-reduce, add and norm; off). Under DP attention a sum owed by the experts is always
    # completed by one reduce-scatter: no setting reaches another plan.
    all_reduce_fusion: Fusion = Fusion.AUTO


class SpeculativeSpec(SpecModel):
    method: Literal["eagle3"] = "eagle3"
    draft_model: str = Field(min_length=1, max_length=1024)
    num_steps: int = Field(default=3, ge=1, le=16)
    top_k: int = Field(default=1, ge=1, le=16)
    num_draft_tokens: int | None = Field(default=None, ge=2, le=256)

    @model_validator(mode="after")
    def _tree(self) -> SpeculativeSpec:
        if self.top_k == 1 and self.num_draft_tokens is not None and self.num_draft_tokens < self.num_steps + 1:
            raise ValueError(f"numDraftTokens={self.num_draft_tokens} must be >= numSteps + 1 = "
                             f"{self.num_steps + 1} when topK = 1")
        return self

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens or (self.num_steps + 1 if self.top_k == 1 else 2 * self.num_steps)


# Defaults of the HTTP server's bounds (``ServingSpec`` and ``ServingLimits`` share them; docs/serving.md).
DRAIN_GRACE_S = 30
SHUTDOWN_MARGIN_S = 15  # after the drain: HTTP server, rank actors, placement groups and Ray stop
MAX_REQUEST_BYTES = 8 << 20
MAX_SEQUENCES_PER_REQUEST = 256
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 1024


class ApiAuthSpec(SpecModel):
    """Which routes need the API key when one is set (``fusedserve run --api-key`` or ``$FUSEDSERVE_API_KEY``;
    on Kubernetes the operator injects the variable from a Secret). ``/v1/*`` and ``/status`` always do;
    ``/health`` (kubelet probes) and ``/metrics`` (Prometheus) are public unless set to ``apiKey``."""

    health: Literal["public", "apiKey"] = "public"
    metrics: Literal["public", "apiKey"] = "public"


class ServingSpec(SpecModel):
    port: int = Field(default=8000, ge=1024, le=65535)
    max_batch_tokens: int = Field(default=2048, ge=16, le=1 << 20)
    max_sequences: int = Field(default=64, ge=1, le=4096)
    kv_cache_fraction: float = Field(default=0.9, gt=0.0, le=0.98)
    block_size: int = Field(default=16, ge=1, le=1024)
    max_model_len: int | None = Field(default=None, ge=16)
    metrics_port: int | None = Field(default=None, ge=1024, le=65535)
    drain_grace_period_seconds: int = Field(
        default=DRAIN_GRACE_S, ge=0, le=3600,
        description="on SIGTERM, requests in flight get this long to finish (new ones get 503)")
    max_request_bytes: int = Field(default=MAX_REQUEST_BYTES, ge=1024, le=1 << 30,
                                   description="largest request body; larger ones get 413")
    max_sequences_per_request: int = Field(default=MAX_SEQUENCES_PER_REQUEST, ge=1, le=1 << 16,
                                           description="prompts x n of one request; more get 400")
    header_timeout_seconds: float = Field(default=HEADER_TIMEOUT_S, gt=0, le=3600,
                                          description="a connection must send a request's headers within this")
    body_timeout_seconds: float = Field(default=BODY_TIMEOUT_S, gt=0, le=3600,
                                        description="a request's whole body must arrive within this (else 408)")
    send_timeout_seconds: float = Field(default=SEND_TIMEOUT_S, gt=0, le=3600,
                                        description="a client that reads none of a response for this long is cut off")
    max_connections: int = Field(default=MAX_CONNECTIONS, ge=1, le=1 << 20,
                                 description="open connections + requests in progress; beyond it, 503")
    auth: ApiAuthSpec = ApiAuthSpec()

    @property
    def termination_grace_period_seconds(self) -> int:
        """What a pod serving this spec needs between SIGTERM and SIGKILL: the drain, then the shutdown."""
        return self.drain_grace_period_seconds + SHUTDOWN_MARGIN_S


class ResourcesSpec(SpecModel):
    gpus_per_rank: int = Field(default=1, ge=0, le=1)
    cpu: str | None = None
    memory: str | None = None


class DeploymentSpec(SpecModel):
    model: ModelSpec
    replicas: int = Field(default=1, ge=0, le=128)
    parallelism: ParallelismSpec = ParallelismSpec()
    communication: CommunicationSpec = CommunicationSpec()
    speculative: SpeculativeSpec | None = None
    serving: ServingSpec = ServingSpec()
    resources: ResourcesSpec = ResourcesSpec()


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = "default"


class Manifest(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)
    api_version: Literal["fusedserve.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceDeployment"]
    metadata: Metadata
    spec: DeploymentSpec
    status: dict[str, Any] | None = None


def format_validation_error(e: ValidationError, root: str) -> str:
    """One line per offending field: ``spec.parallelism.tensor: ...``."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in (root, *err["loc"]) if x != "__root__")
        parts.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def parse_manifest(doc: dict[str, Any]) -> Manifest:
    if not isinstance(doc, dict):
        raise SpecError("a manifest must be a mapping (apiVersion, kind, metadata, spec)")
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, "").removeprefix(".")) from e


def load_manifest(path: str) -> Manifest:
    """The one InferenceDeployment of a YAML file; ``SpecError`` (one line) for anything else."""
    import yaml

    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not a YAML text file (byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8)"
                        ) from None
    if "\x00" in text:
        raise SpecError(f"{path}: not a YAML text file (a NUL byte at offset {text.index(chr(0))})")
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SpecError(f"{path}: not valid YAML: {e.problem or e.context or 'syntax error'}{where}") from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise SpecError(f"{path}: not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(found) != 1:
        raise SpecError(f"{path}: expected exactly one {KIND}, found {len(found)}")
    return parse_manifest(found[0])


# --- the runtime's frozen view of a manifest -----------------------------------------------------

@dataclass(frozen=True)
class SpeculativeRuntime:
    draft_model: str
    num_steps: int
    top_k: int
    num_draft_tokens: int | None


@dataclass(frozen=True)
class ServingLimits:
    """The HTTP server's bounds (``spec.serving``); none of them changes an engine group."""

    drain_grace_s: float = DRAIN_GRACE_S
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_sequences_per_request: int = MAX_SEQUENCES_PER_REQUEST
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    send_timeout_s: float = SEND_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    health_needs_key: bool = False
    metrics_needs_key: bool = False

    @classmethod
    def from_spec(cls, s: ServingSpec) -> ServingLimits:
        return cls(drain_grace_s=float(s.drain_grace_period_seconds), max_request_bytes=s.max_request_bytes,
                   max_sequences_per_request=s.max_sequences_per_request, header_timeout_s=s.header_timeout_seconds,
                   body_timeout_s=s.body_timeout_seconds, send_timeout_s=s.send_timeout_seconds,
                   max_connections=s.max_connections, health_needs_key=s.auth.health == "apiKey",
                   metrics_needs_key=s.auth.metrics == "apiKey")


@dataclass(frozen=True)
class RuntimeConfig:
    """What the Ray runtime needs from a manifest, as one frozen value (no pydantic, no torch)."""

    name: str
    namespace: str
    model_name: str  # served name (``spec.model.name``, default the deployment's name)
    model_path: str
    dtype: str
    quantization: str  # "auto" | "fp8" | "none" (models/quantization.py)
    load_format: str  # "auto" | "dummy"
    skip_tokenizer: bool
    replicas: int
    tensor: int  # ranks per engine group
    data: int
    expert: int
    dp_attention: bool
    all_reduce_fusion: str  # "auto" | "on" | "off" (models/parallel/fusion/selection.py decides per rank)
    speculative: SpeculativeRuntime | None
    port: int
    metrics_port: int | None
    max_batch_tokens: int
    max_sequences: int
    kv_cache_fraction: float
    block_size: int
    max_model_len: int | None
    gpus_per_rank: int
    restart_token: str | None = None  # metadata.annotations["fusedserve.io/restart-token"]: a new one rolls every group
    limits: ServingLimits = ServingLimits()

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> RuntimeConfig:
        """Raises ``SpecError`` for specs the runtime cannot run although the schema allows them."""
        spec = manifest.spec
        par, s = spec.parallelism, spec.speculative
        if s is not None and par.data_parallel_attention:
            raise SpecError("spec.speculative: EAGLE3 with parallelism.dataParallelAttention is not supported yet; "
                            "drop spec.speculative or dataParallelAttention")
        return cls(
            name=manifest.metadata.name, namespace=manifest.metadata.namespace,
            model_name=spec.model.name or manifest.metadata.name, model_path=spec.model.path,
            dtype=spec.model.dtype, quantization=spec.model.quantization, load_format=spec.model.load_format,
            skip_tokenizer=spec.model.skip_tokenizer, replicas=spec.replicas, tensor=par.tensor, data=par.data,
            expert=par.expert, dp_attention=par.data_parallel_attention,
            all_reduce_fusion=spec.communication.all_reduce_fusion.value,
            speculative=None if s is None else SpeculativeRuntime(s.draft_model, s.num_steps, s.top_k,
                                                                  s.num_draft_tokens),
            port=spec.serving.port, metrics_port=spec.serving.metrics_port,
            max_batch_tokens=spec.serving.max_batch_tokens, max_sequences=spec.serving.max_sequences,
            kv_cache_fraction=spec.serving.kv_cache_fraction, block_size=spec.serving.block_size,
            max_model_len=spec.serving.max_model_len, gpus_per_rank=spec.resources.gpus_per_rank,
            restart_token=(getattr(manifest.metadata, "annotations", None) or {}).get(RESTART_TOKEN_ANNOTATION),
            limits=ServingLimits.from_spec(spec.serving),
        )

    @property
    def ranks(self) -> int:
        """Ranks (GPUs) per engine group."""
        return self.tensor

    @property
    def attn_tp(self) -> int:
        return self.tensor // self.data

    @property
    def revision(self) -> str:
        """A short hash of everything an engine group is built from: groups of another revision
        are rolled. Excludes ``replicas``, the HTTP ports and limits (they change no group)."""
        fields = {k: v for k, v in self.__dict__.items() if k not in ("replicas", "port", "metrics_port", "limits")}
        blob = json.dumps(fields, sort_keys=True, default=lambda o: o.__dict__)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dtype_on(self, cuda: bool) -> str:
        """``auto`` is bfloat16 on GPUs and float32 on CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if cuda else "float32"
