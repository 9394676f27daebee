"""Where a deployment's checkpoints come from, and how its pods get them (pure).

``spec.model.uri`` and ``spec.speculative.draftModel`` each name a source:

    hf://org/name[@revision]   downloaded by the pod's init container (huggingface_hub) into the cache
    s3://bucket[/prefix]       downloaded the same way (boto3) with the credentials Secret's keys
    pvc://claim[/path]         the claim mounted read-only, nothing downloaded
    a plain path               already in the image, as `fusedserve run` reads it

The runtime only ever sees a local path: the runtime manifest (engine_config.py) gets ``local_path``.
The cache is an emptyDir per pod, or ``modelStorage.cache.claimName`` shared by every pod so replicas
download once (the downloader skips what a finished download left there). The head needs only the
configuration and tokenizer files (it renders chat templates), so its init container leaves the weights.
The downloader (``python -m fusedserve.model_download``) retries with backoff itself, writes a one-line
reason to the termination log when it gives up, and the kubelet restarts it with its own backoff.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Literal

from fusedserve.worker.spec import SpecError

from .api import InferenceDeploymentSpec

MODEL_ROOT = "/models"
CACHE_DIR = f"{MODEL_ROOT}/cache"
PVC_DIR = f"{MODEL_ROOT}/pvc"
CACHE_VOLUME = "model-cache"
INIT_CONTAINER = "model-download"
DOWNLOAD_MODULE = "fusedserve.model_download"
HF_HOME = f"{CACHE_DIR}/.huggingface"
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}

Scheme = Literal["hf", "s3", "pvc", "path"]
_HF = re.compile(r"^hf://(?P<repo>([A-Za-z0-9][-A-Za-z0-9_.]*/)?[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[-A-Za-z0-9_./]+))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][-a-z0-9.]{1,61}[a-z0-9])(/(?P<prefix>.*))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/(?P<path>.*))?$")


@dataclass(frozen=True)
class Source:
    scheme: Scheme
    uri: str
    local_path: str  # what the runtime reads
    claim: str | None = None  # pvc://

    @property
    def downloaded(self) -> bool:
        return self.scheme in ("hf", "s3")


def _clean(path: str, field: str) -> str:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise SpecError(f"{field}: {path!r} may not contain . or .. segments")
    return "/".join(parts)


def parse_source(uri: str, field: str) -> Source:
    """Raises ``SpecError`` naming ``field`` for a URI of an unknown scheme or shape."""
    if "://" not in uri:
        return Source("path", uri, uri)
    if m := _HF.match(uri):
        rev = m["rev"] or "main"
        return Source("hf", uri, f"{CACHE_DIR}/hf/{m['repo']}/{_clean(rev, field)}")
    if m := _S3.match(uri):
        prefix = _clean(m["prefix"] or "", field)
        return Source("s3", uri, f"{CACHE_DIR}/s3/{m['bucket']}" + (f"/{prefix}" if prefix else ""))
    if m := _PVC.match(uri):
        path = _clean(m["path"] or "", field)
        return Source("pvc", uri, f"{PVC_DIR}/{m['claim']}" + (f"/{path}" if path else ""), claim=m["claim"])
    raise SpecError(f"{field}: {uri!r} is not hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path "
                    "or a path")


@dataclass(frozen=True)
class ModelSources:
    model: Source
    draft: Source | None

    @classmethod
    def of(cls, spec: InferenceDeploymentSpec) -> ModelSources:
        draft = spec.speculative.draft_model if spec.speculative is not None else None
        field = "spec.model.uri" if spec.model.uri is not None else "spec.model.path"
        model = parse_source(spec.model.location, field)
        if spec.model.path is not None and model.scheme != "path":
            raise SpecError(f"spec.model.path: {spec.model.path!r} is a URI; give it as spec.model.uri")
        return cls(model, None if draft is None else parse_source(draft, "spec.speculative.draftModel"))

    def all(self) -> list[Source]:
        return [self.model] + ([self.draft] if self.draft is not None else [])

    @property
    def claims(self) -> list[str]:
        return sorted({s.claim for s in self.all() if s.claim is not None})

    @property
    def downloads(self) -> list[Source]:
        return [s for s in self.all() if s.downloaded]


def _claim_volume(index: int) -> str:
    return f"model-pvc-{index}"


def volumes(sources: ModelSources, spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if sources.downloads:
        cache = spec.model_storage.cache
        if cache.claim_name:
            out.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}})
        else:
            out.append({"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}})
    for i, claim in enumerate(sources.claims):
        out.append({"name": _claim_volume(i), "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    return out


def volume_mounts(sources: ModelSources) -> list[dict[str, Any]]:
    """Of the serving container: the cache read-only (the init container wrote it), each claim read-only."""
    out: list[dict[str, Any]] = []
    if sources.downloads:
        out.append({"name": CACHE_VOLUME, "mountPath": CACHE_DIR, "readOnly": True})
    for i, claim in enumerate(sources.claims):
        out.append({"name": _claim_volume(i), "mountPath": f"{PVC_DIR}/{claim}", "readOnly": True})
    return out


def _download_env(sources: ModelSources, spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]],
                                                                                    list[dict[str, Any]]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": HF_HOME},
                                 {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    env_from: list[dict[str, Any]] = []
    schemes = {s.scheme for s in sources.downloads}
    hf, s3 = spec.model_storage.hugging_face, spec.model_storage.s3
    if "hf" in schemes:
        if hf.token_secret is not None:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf.token_secret.name,
                                                                           "key": hf.token_secret.key}}})
        if hf.endpoint:
            env.append({"name": "HF_ENDPOINT", "value": hf.endpoint})
    if "s3" in schemes:
        if s3.credentials_secret is not None:
            env_from.append({"secretRef": {"name": s3.credentials_secret.name}})
        if s3.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": s3.endpoint})
        if s3.region:
            env.append({"name": "AWS_DEFAULT_REGION", "value": s3.region})
    return env, env_from


def init_container(sources: ModelSources, spec: InferenceDeploymentSpec, image: str, security: dict[str, Any],
                   weights: bool) -> dict[str, Any] | None:
    """The init container that downloads every hf:// and s3:// source (None when there is none).

    ``weights``: False on the head (configuration and tokenizer files only)."""
    downloads = sources.downloads
    if not downloads:
        return None
    env, env_from = _download_env(sources, spec)
    args = [f"{s.uri}={s.local_path}" for s in downloads] + ([] if weights else ["--no-weights"])
    container: dict[str, Any] = {
        "name": INIT_CONTAINER, "image": image,
        "command": ["python", "-m", DOWNLOAD_MODULE], "args": args,
        "env": env,
        "resources": copy.deepcopy(DOWNLOAD_RESOURCES),
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_DIR}],
    }
    if env_from:
        container["envFrom"] = env_from
    return container
