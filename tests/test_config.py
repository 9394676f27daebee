"""The manifest and the runtime's frozen config: invalid specs name their field; decisions made once."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from fusedserve.worker.spec import (
    SHUTDOWN_MARGIN_S,
    RuntimeConfig,
    ServingLimits,
    SpecError,
    load_manifest,
    parse_manifest,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "apiVersion": "fusedserve.io/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {
        "model": {"path": "ckpt", "dtype": "float32"},
        "replicas": 2,
        "parallelism": {"tensor": 4, "data": 2, "dataParallelAttention": True, "expert": 2},
        "serving": {"port": 9000},
    },
}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()

# (change, the field the message must name, a phrase of the reason)
INVALID = [
    ("spec.model.path", _DELETE, "spec.model.path", "required"),
    ("spec.model.dtype", "float8", "spec.model.dtype", "float32"),
    ("spec.replicas", -1, "spec.replicas", "greater than or equal"),
    ("spec.parallelism.tensor", 0, "spec.parallelism.tensor", "greater than or equal"),
    ("spec.parallelism.data", 3, "spec.parallelism", "data=3 must divide tensor=4"),
    ("spec.parallelism.expert", 3, "spec.parallelism", "expert=3 must divide tensor=4"),
    ("spec.parallelism.dataParallelAttention", False, "spec.parallelism", "set dataParallelAttention"),
    ("spec.parallelism.tensr", 2, "spec.parallelism.tensr", "Extra inputs"),
    ("spec.communication", {"allReduceFusion": "always"}, "spec.communication.allReduceFusion", "auto"),
    # The reduce-scatter of DP attention is the plan, not a knob (it was validated and never read).
    ("spec.communication", {"reduceScatter": "auto"}, "spec.communication.reduceScatter", "Extra inputs"),
    ("spec.speculative", {"method": "medusa", "draftModel": "d"}, "spec.speculative.method", "eagle3"),
    ("spec.speculative", {"numSteps": 3}, "spec.speculative.draftModel", "required"),
    ("spec.speculative", {"draftModel": "d", "numSteps": 4, "numDraftTokens": 3}, "spec.speculative",
     "numDraftTokens=3 must be >= numSteps + 1"),
    ("spec.serving.port", 80, "spec.serving.port", "greater than or equal to 1024"),
    ("spec.serving.kvCacheFraction", 1.5, "spec.serving.kvCacheFraction", "less than or equal"),
    ("spec.resources", {"gpusPerRank": 2}, "spec.resources.gpusPerRank", "less than or equal"),
    ("metadata.name", "Bad_Name", "metadata.name", "pattern"),
    ("kind", "Deployment", "kind", "InferenceDeployment"),
    ("apiVersion", "fusedserve.io/v2", "apiVersion", "v1alpha1"),
]


@pytest.mark.parametrize(("path", "value", "field", "reason"), INVALID, ids=[f"{p}={'<deleted>' if v is _DELETE else v}" for p, v, *_ in INVALID])
def test_invalid_manifest_names_the_field(path: str, value: Any, field: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_manifest(_with(path, value))
    message = str(info.value)
    assert field in message and reason in message, message


def test_not_a_mapping_and_files_with_no_or_two_deployments(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="must be a mapping"):
        parse_manifest(["not", "a", "mapping"])  # type: ignore[arg-type]
    empty = tmp_path / "empty.yaml"
    empty.write_text("kind: ConfigMap\n")
    with pytest.raises(SpecError, match="expected exactly one InferenceDeployment, found 0"):
        load_manifest(str(empty))
    with pytest.raises(SpecError, match="missing.yaml"):
        load_manifest(str(tmp_path / "missing.yaml"))


def test_speculation_with_dp_attention_is_refused_by_the_runtime() -> None:
    doc = _with("spec.speculative", {"draftModel": "d"})
    with pytest.raises(SpecError, match="spec.speculative: EAGLE3 with parallelism.dataParallelAttention"):
        RuntimeConfig.from_manifest(parse_manifest(doc))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_gives_a_runtime_config(path: Path) -> None:
    rc = RuntimeConfig.from_manifest(load_manifest(str(path)))
    assert rc.ranks >= 1 and rc.tensor % rc.data == 0
    model = ROOT / Path(rc.model_path).expanduser()
    draft = ROOT / rc.speculative.draft_model if rc.speculative is not None else None
    if path.name == "04-smollm2-eagle3.yaml":  # the model is made by fetch-model (the draft is in git)
        assert rc.model_path == "~/.cache/fusedserve/models/smollm2-135m-instruct"  # fetch-model's default
    assert model.is_dir()
    if draft is not None:
        assert draft.is_dir()


def test_runtime_config_is_frozen_and_its_revision_ignores_replicas_and_ports() -> None:
    rc = RuntimeConfig.from_manifest(parse_manifest(BASE))
    assert (rc.name, rc.namespace, rc.model_name, rc.ranks, rc.attn_tp) == ("demo", "team-a", "demo", 4, 2)
    with pytest.raises(AttributeError):
        rc.replicas = 3  # type: ignore[misc]
    same = RuntimeConfig.from_manifest(parse_manifest(_with("spec.replicas", 5)))
    assert same.revision == rc.revision
    assert RuntimeConfig.from_manifest(parse_manifest(_with("spec.serving", {"port": 9001}))).revision == rc.revision
    other = RuntimeConfig.from_manifest(parse_manifest(_with("spec.serving", {"maxSequences": 8})))
    assert other.revision != rc.revision


def test_dtype_auto_is_bf16_on_gpus_and_fp32_on_cpu() -> None:
    rc = RuntimeConfig.from_manifest(parse_manifest(_with("spec.model.dtype", "auto")))
    assert rc.dtype_on(cuda=True) == "bfloat16" and rc.dtype_on(cuda=False) == "float32"


def test_quantization_and_float16_reach_each_rank_s_engine_config() -> None:
    """spec.model.quantization (auto by default) and dtype float16 reach the EngineConfig a rank is built
    from; a new quantization rolls the engine groups (another revision)."""
    from fusedserve.worker.engine.config import EngineConfig, EngineConfigError
    from fusedserve.worker.ray.rank_actor import engine_config

    rc = RuntimeConfig.from_manifest(parse_manifest(BASE))
    assert rc.quantization == "auto" and engine_config(rc, "cpu").quantization == "auto"
    doc = _with("spec.model", {"path": "ckpt", "dtype": "float16", "quantization": "none"})
    none = RuntimeConfig.from_manifest(parse_manifest(doc))
    config = engine_config(none, "cuda:0")
    assert (config.quantization, config.dtype) == ("none", "float16") and none.revision != rc.revision
    with pytest.raises(SpecError, match="spec.model.quantization"):
        parse_manifest(_with("spec.model.quantization", "int8"))
    with pytest.raises(EngineConfigError, match="quantization must be one of auto, fp8, none"):
        EngineConfig(quantization="fp4")


def test_prefix_caching_is_on_by_default_and_spec_serving_turns_it_off() -> None:
    from fusedserve.worker.ray.rank_actor import engine_config

    rc = RuntimeConfig.from_manifest(parse_manifest(BASE))
    assert rc.prefix_caching and engine_config(rc, "cpu").enable_prefix_caching
    off = RuntimeConfig.from_manifest(parse_manifest(_with("spec.serving.prefixCaching", False)))
    assert not off.prefix_caching and not engine_config(off, "cuda:0").enable_prefix_caching
    assert off.revision != rc.revision  # the groups are rebuilt with it off
    with pytest.raises(SpecError, match="spec.serving.prefixCaching"):
        parse_manifest(_with("spec.serving.prefixCaching", "sometimes"))


def test_fusedserve_run_refuses_an_invalid_manifest_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "examples/01-tiny-code.yaml").read_text().replace("{tensor: 1}", "{tensor: 2, data: 3}"))
    out = subprocess.run([sys.executable, "-m", "fusedserve.cli", "run", str(bad)], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "invalid manifest: spec.parallelism: data=3 must divide tensor=2" in out.stderr
    missing = tmp_path / "missing-model.yaml"
    missing.write_text((ROOT / "examples/01-tiny-code.yaml").read_text().replace("checkpoints/tiny-code\n",
                                                                                 "checkpoints/nowhere\n"))
    from fusedserve.worker.ray.launcher import load_runtime_config

    with pytest.raises(SpecError, match="spec.model.path: 'examples/checkpoints/nowhere' exists neither"):
        load_runtime_config(str(missing))


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 64,
                                     b"spec: [unclosed\nkind: }\n", b"[" * 5000],
                         ids=["binary", "elf", "not-yaml", "nested-too-deep"])
def test_bad_manifest_bytes_give_one_line_without_a_traceback(tmp_path: Path, content: bytes) -> None:
    """Issue 18: a binary manifest gave a traceback (UnicodeDecodeError escaped load_manifest)."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(SpecError) as info:
        load_manifest(str(bad))
    assert "\n" not in str(info.value) and str(bad) in str(info.value)
    out = subprocess.run([sys.executable, "-m", "fusedserve.cli", "run", str(bad)], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("fusedserve run: invalid manifest: ")


def test_serving_limits_come_from_the_spec_and_roll_no_group() -> None:
    rc = RuntimeConfig.from_manifest(parse_manifest(BASE))
    assert rc.limits == ServingLimits()  # the defaults of ServingSpec and ServingLimits agree
    doc = _with("spec.serving", {"port": 9000, "drainGracePeriodSeconds": 5, "maxRequestBytes": 4096,
                                 "maxSequencesPerRequest": 8, "headerTimeoutSeconds": 2.5, "bodyTimeoutSeconds": 3,
                                 "sendTimeoutSeconds": 4, "maxConnections": 16, "auth": {"metrics": "apiKey"}})
    manifest = parse_manifest(doc)
    limited = RuntimeConfig.from_manifest(manifest)
    assert limited.limits == ServingLimits(5.0, 4096, 8, 2.5, 3.0, 4.0, 16, health_needs_key=False,
                                           metrics_needs_key=True)
    assert limited.revision == rc.revision
    assert manifest.spec.serving.termination_grace_period_seconds == 5 + SHUTDOWN_MARGIN_S
    for field, value in (("maxRequestBytes", 10), ("drainGracePeriodSeconds", -1), ("auth", {"health": "open"}),
                         ("bodyTimeoutSeconds", 0)):
        with pytest.raises(SpecError, match=f"spec.serving.{field}"):
            parse_manifest(_with(f"spec.serving.{field}", value))


@pytest.mark.parametrize("address", [None, "10.0.0.1:6379"], ids=["embedded", "joined"])
def test_fusedserve_run_keeps_its_embedded_ray_on_loopback(address: str | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray swaps a 127.0.0.1 node address for one it probes and listens on every interface unless its multi-node
    switch is off (read when ``ray`` is imported): `fusedserve run` turns it off for its embedded Ray, before
    Ray loads, and leaves a cluster it joins as the environment has it. (The suite's private network namespace
    has loopback alone, so the Ray tests cannot see the difference; by hand on a host with an interface, Ray's
    servers listened on * without it.)"""
    from fusedserve.worker.ray import launcher

    seen: dict[str, str | None] = {}

    def serve(*args: object) -> int:
        seen["switch"] = launcher.os.environ.get(launcher.RAY_CLUSTER_ENV)
        return 0

    monkeypatch.delenv(launcher.RAY_CLUSTER_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file made for this test
    monkeypatch.setattr(launcher, "_serve", serve)
    monkeypatch.setattr(launcher.startup_gc, "pause", lambda: None)
    monkeypatch.setattr(launcher.startup_gc, "resume", lambda: None)
    assert launcher.run(str(ROOT / "examples/01-tiny-code.yaml"), ray_address=address) == 0
    assert seen["switch"] == (None if address else "0")
