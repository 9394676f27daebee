"""The init container's model download (fusedserve/model_download.py): in place, resumable, marked complete,
the head's config-only download, transient failures retried with backoff, permanent ones reported at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fusedserve import model_download as md


class FakeS3:
    """The two boto3 S3 client calls the download uses."""

    def __init__(self, objects: dict[str, bytes], fail: Exception | None = None) -> None:
        self.objects, self.fail, self.downloads = objects, fail, 0

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        objects, fail = self.objects, self.fail

        class Paginator:
            def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:
                if fail is not None:
                    raise fail
                return [{"Contents": [{"Key": k, "Size": len(v)} for k, v in objects.items() if k.startswith(Prefix)]}]
        return Paginator()

    def download_file(self, bucket: str, key: str, path: str) -> None:
        self.downloads += 1
        Path(path).write_bytes(self.objects[key])


class ClientError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}}


FILES = {"m/llama/config.json": b"{}", "m/llama/tokenizer.json": b"tok", "m/llama/model.safetensors": b"w" * 10,
         "other/x": b"x"}


def test_s3_download_is_in_place_resumable_and_the_head_skips_weights(tmp_path: Path) -> None:
    s3 = FakeS3(FILES)
    md.DOWNLOADERS["s3"] = lambda uri, dest, weights: md.download_s3(uri, dest, weights, client=s3)
    try:
        head = md.Job("s3://bucket/m/llama", tmp_path / "llama")
        assert "downloaded" in md.fetch(head, weights=False)
        assert sorted(p.name for p in head.dest.iterdir()) == [md.MARKER, "config.json", "tokenizer.json"]
        assert "already" in md.fetch(head, weights=False)  # the head's second start
        assert "downloaded" in md.fetch(head, weights=True)  # a worker sharing the cache: only the weights
        assert s3.downloads == 3 and (head.dest / "model.safetensors").read_bytes() == b"w" * 10
        assert "already" in md.fetch(head, weights=True) and "already" in md.fetch(head, weights=False)
    finally:
        md.DOWNLOADERS["s3"] = md.download_s3


def test_transient_failures_are_retried_with_backoff_and_permanent_ones_are_not(tmp_path: Path) -> None:
    slept: list[float] = []
    calls = {"n": 0}

    def flaky(uri: str, dest: Path, weights: bool) -> None:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("connection reset by peer")
        (dest / "config.json").write_text("{}")

    md.DOWNLOADERS["s3"] = flaky
    try:
        assert "downloaded" in md.fetch(md.Job("s3://b/p", tmp_path / "a"), True, retries=4, backoff_s=2,
                                        sleep=slept.append)
        assert slept == [2, 4]
        calls["n"] = -10
        with pytest.raises(RuntimeError, match="after 3 attempts"):
            md.fetch(md.Job("s3://b/p", tmp_path / "b"), True, retries=2, backoff_s=1, sleep=slept.append)
    finally:
        md.DOWNLOADERS["s3"] = md.download_s3
    denied = FakeS3(FILES, fail=ClientError("AccessDenied"))
    with pytest.raises(md.Permanent, match="AccessDenied.*spec.modelStorage.s3"):
        md.download_s3("s3://bucket/m/llama", tmp_path / "c", True, client=denied)
    with pytest.raises(md.Permanent, match="no objects"):
        md.download_s3("s3://bucket/nothing", tmp_path / "d", True, client=FakeS3(FILES))


def test_hf_download_uses_the_hub_with_the_revision_and_skips_weights_on_the_head(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    seen: list[dict[str, Any]] = []

    def snapshot_download(**kw: Any) -> str:
        seen.append(kw)
        Path(kw["local_dir"], "config.json").write_text("{}")
        return str(kw["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    job = md.Job("hf://org/name@abc123", tmp_path / "hf")
    md.fetch(job, weights=False)
    assert seen[0]["repo_id"] == "org/name" and seen[0]["revision"] == "abc123"
    assert "*.safetensors" in seen[0]["ignore_patterns"]
    md.fetch(md.Job("hf://gpt2", tmp_path / "gpt2"), weights=True)
    assert seen[1]["revision"] is None and seen[1]["ignore_patterns"] is None


def test_a_failed_download_exits_1_with_one_line_in_the_termination_log(tmp_path: Path) -> None:
    """The real huggingface_hub, offline: the Hub cannot be reached; no retries here (--retries 0)."""
    log = tmp_path / "termination-log"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "fusedserve.model_download", f"hf://org/missing={tmp_path / 'x'}",
                          "--retries", "0", "--termination-log", str(log)], check=False, capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1, out.stderr
    message = log.read_text()
    assert message.startswith("hf://org/missing: ") and "\n" not in message.strip()
    bad = subprocess.run([sys.executable, "-m", "fusedserve.model_download", "pvc://x=/y", "--termination-log",
                          str(log)], check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "only hf:// and s3://" in log.read_text()
