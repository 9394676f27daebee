"""`python -m fusedserve.model_download SOURCE=DEST ...`: the model download of a pod's init container.

    python -m fusedserve.model_download hf://org/name@rev=/models/cache/hf/org/name/rev [--no-weights]
    python -m fusedserve.model_download s3://bucket/prefix=/models/cache/s3/bucket/prefix

The operator writes this command (operator/model_source.py). Each source is downloaded into its
destination in place and resumably (huggingface_hub's ``snapshot_download`` into a local directory;
boto3 object by object, each written to a temporary name and renamed), then marked complete, so a
restarted pod or another pod sharing the cache PVC skips it. ``--no-weights`` (the head) leaves out the
weight files: it needs only the configuration and the tokenizer.

Transient failures are retried here with exponential backoff; a failure that retrying cannot fix
(unknown repository or revision, no access) ends at once. On giving up, one line saying why goes to
the termination log (``/dev/termination-log``: the pod status, where the operator reads it into the
InferenceDeployment's status) and to stderr, and the exit code is 1; the kubelet then restarts the
init container with its own backoff. Credentials come from the environment: ``HF_TOKEN``,
``HF_ENDPOINT``; ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_ENDPOINT_URL`` /
``AWS_DEFAULT_REGION``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("fusedserve.model_download")

MARKER = ".fusedserve-complete"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ckpt")
TERMINATION_LOG = "/dev/termination-log"
S3_PERMANENT = ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "404")
RETRIES = 4
BACKOFF_S = 5.0


class Permanent(RuntimeError):
    """A failure retrying cannot fix (not found, no access)."""


@dataclass(frozen=True)
class Job:
    uri: str
    dest: Path


def parse_job(arg: str) -> Job:
    uri, sep, dest = arg.partition("=")
    if not sep or not uri or not dest.startswith("/"):
        raise ValueError(f"{arg!r}: expected SOURCE=/absolute/destination")
    if not (uri.startswith(("hf://", "s3://"))):
        raise ValueError(f"{uri!r}: only hf:// and s3:// sources are downloaded")
    return Job(uri, Path(dest))


def is_weight(name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(Path(name).name, p) for p in WEIGHT_PATTERNS)


def _done(dest: Path, weights: bool) -> bool:
    marker = dest / MARKER
    if not marker.is_file():
        return False
    kind = marker.read_text().strip()
    return kind == "full" or (kind == "config" and not weights)


def _mark(dest: Path, weights: bool) -> None:
    marker = dest / MARKER
    if weights or not marker.is_file():
        tmp = dest / f"{MARKER}.{os.getpid()}"
        tmp.write_text("full\n" if weights else "config\n")
        tmp.replace(marker)


# --- sources ------------------------------------------------------------------------------------------------

def download_hf(uri: str, dest: Path, weights: bool) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, revision = uri.removeprefix("hf://").partition("@")
    try:
        snapshot_download(repo_id=repo, revision=revision or None, local_dir=str(dest),
                          ignore_patterns=None if weights else list(WEIGHT_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
        raise Permanent(f"{uri}: {type(e).__name__}: {_first_line(e)} (is spec.modelStorage.huggingFace."
                        "tokenSecret set and allowed to read it?)") from e
    except LocalEntryNotFoundError as e:  # offline, or the Hub unreachable
        raise RuntimeError(f"{uri}: the Hub cannot be reached: {_first_line(e)}") from e
    except HfHubHTTPError as e:
        raise RuntimeError(f"{uri}: {_first_line(e)}") from e


def s3_objects(client: Any, bucket: str, prefix: str) -> Iterable[tuple[str, int]]:
    """(key, size) of every object under ``prefix``."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents") or []:
            if not obj["Key"].endswith("/"):
                yield obj["Key"], int(obj.get("Size", 0))


def download_s3(uri: str, dest: Path, weights: bool, client: Any = None) -> None:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if client is None:
        import boto3  # the worker image has it (docker/worker.Dockerfile)

        client = boto3.client("s3")
    try:
        found = 0
        for key, size in s3_objects(client, bucket, prefix + "/" if prefix else ""):
            rel = key[len(prefix):].lstrip("/") if prefix else key
            if not weights and is_weight(rel):
                continue
            found += 1
            target = dest / rel
            if target.is_file() and target.stat().st_size == size:
                continue  # there from an earlier (or another pod's) download
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
            client.download_file(bucket, key, str(tmp))
            tmp.replace(target)
        if not found:
            raise Permanent(f"{uri}: no objects under this prefix")
    except Permanent:
        raise
    except Exception as e:  # botocore's ClientError carries the service's error code in .response
        code = str((getattr(e, "response", None) or {}).get("Error", {}).get("Code", ""))
        text = f"{uri}: {code or type(e).__name__}: {_first_line(e)}"
        if code in S3_PERMANENT:
            raise Permanent(text + " (check spec.modelStorage.s3)") from e
        raise RuntimeError(text) from e


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


Downloader = Callable[[str, Path, bool], None]
DOWNLOADERS: dict[str, Downloader] = {"hf": download_hf, "s3": download_s3}


def fetch(job: Job, weights: bool, retries: int = RETRIES, backoff_s: float = BACKOFF_S,
          sleep: Callable[[float], None] = time.sleep) -> str:
    """Download one source (retrying transient failures); returns what happened."""
    if _done(job.dest, weights):
        return f"{job.uri}: already in {job.dest}"
    job.dest.mkdir(parents=True, exist_ok=True)
    download = DOWNLOADERS[job.uri.split("://", 1)[0]]
    for attempt in range(retries + 1):
        try:
            download(job.uri, job.dest, weights)
            _mark(job.dest, weights)
            return f"{job.uri}: downloaded to {job.dest}"
        except Permanent:
            raise
        except Exception as e:
            if attempt == retries:
                raise RuntimeError(f"{_first_line(e)} (after {retries + 1} attempts)") from e
            delay = backoff_s * 2 ** attempt
            log.warning("%s: attempt %d failed (%s); retrying in %.0fs", job.uri, attempt + 1, _first_line(e), delay)
            sleep(delay)
    raise AssertionError("unreachable")


def _report(message: str, termination_log: str) -> None:
    print(f"model download failed: {message}", file=sys.stderr)
    try:
        with open(termination_log, "w") as f:
            f.write(message[:4000])
    except OSError:
        pass  # not in a pod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedserve.model_download", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="+", metavar="SOURCE=DEST")
    p.add_argument("--no-weights", action="store_true", help="configuration and tokenizer files only (the head)")
    p.add_argument("--retries", type=int, default=RETRIES)
    p.add_argument("--backoff", type=float, default=BACKOFF_S, help="seconds before the first retry (doubling)")
    p.add_argument("--termination-log", default=TERMINATION_LOG)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        jobs = [parse_job(a) for a in args.jobs]
    except ValueError as e:
        _report(str(e), args.termination_log)
        return 2
    for job in jobs:
        try:
            log.info("%s", fetch(job, not args.no_weights, args.retries, args.backoff))
        except Exception as e:  # noqa: BLE001 (reported as one line, the kubelet retries)
            _report(str(e), args.termination_log)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
