"""Impossible splits are refused before any rank starts: by ``check_split`` (the layers' own checks
on the meta device), in ``fusedserve verify`` and in ``fusedserve run``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusedserve.models.loader import load_config
from fusedserve.models.parallel.groups import ParallelConfig
from fusedserve.models.split_check import SplitError, check_split
from fusedserve.tiny import make_tiny_deepseek_v3, make_tiny_llama, make_tiny_nemotron_h

REPO_ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64) at a tiny width.
NINE_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8, "hidden_size": 72,
              "intermediate_size": 144}


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("nine") / "model", **NINE_HEADS)


def test_check_split_uses_the_layers_rules(nine_heads: Path, tmp_path: Path) -> None:
    config = load_config(nine_heads)
    for tp in (1, 3):
        check_split(config, ParallelConfig(tp))
    with pytest.raises(SplitError, match="num_attention_heads=9 does not split over 2 ranks"):
        check_split(config, ParallelConfig(2))
    check_split(config, ParallelConfig(6, 2, 1))  # DP attention: 9 heads over attn_tp = 3
    moe = load_config(make_tiny_deepseek_v3(tmp_path / "ds"))
    check_split(moe, ParallelConfig(4, 2, 2))
    with pytest.raises(SplitError, match="does not split over 3 ranks"):
        check_split(moe, ParallelConfig(3))
    hybrid = load_config(make_tiny_nemotron_h(tmp_path / "nh"))
    check_split(hybrid, ParallelConfig(4, 1, 2))
    with pytest.raises(SplitError, match="over 8"):
        check_split(hybrid, ParallelConfig(8))


def _cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fusedserve.cli", *args], check=False, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - t


def test_verify_refuses_an_impossible_split_before_spawning(nine_heads: Path) -> None:
    from fusedserve.verify import VerifyError, VerifyOptions, prepare, run_verify

    prepare(VerifyOptions(model=str(nine_heads), tp=3))  # imports done: what is timed is the check itself
    t = time.monotonic()
    with pytest.raises(VerifyError, match="num_attention_heads=9 does not split over 2 ranks"):
        run_verify(VerifyOptions(model=str(nine_heads), tp=2))
    assert time.monotonic() - t < 5  # no rank was started (spawning two takes longer than that)
    proc, seconds = _cli("verify", "--model", str(nine_heads), "--tp", "2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "num_attention_heads=9 does not split over 2 ranks" in proc.stderr
    assert "a rank failed" not in proc.stderr  # the check before spawning, not a rank's own
    assert seconds < 120, seconds  # the interpreter, torch and transformers imports (slow on a loaded machine)


def test_run_refuses_an_impossible_split_before_ray(nine_heads: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "nine.yaml"
    manifest.write_text(f"""apiVersion: fusedserve.io/v1alpha1
kind: InferenceDeployment
metadata: {{name: nine-heads}}
spec:
  model: {{path: {nine_heads}}}
  parallelism: {{tensor: 2}}
""")
    proc, seconds = _cli("run", str(manifest))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "fusedserve run: invalid manifest: spec.parallelism: tp=2 dp=1 ep=1 cannot split this LlamaForCausalLM: " \
           "num_attention_heads=9 does not split over 2 ranks" in proc.stderr
    assert "ready" not in proc.stdout  # refused before Ray, actors or ranks
    assert seconds < 120, seconds
