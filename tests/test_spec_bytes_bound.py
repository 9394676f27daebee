"""bench/spec_bytes_bound.py: its byte counts equal what the checkpoints hold (read from their safetensors headers,
a format nobody here wrote), and the bound follows a round's structure."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench import spec_bytes_bound as sb  # noqa: E402

CHECKPOINTS = ROOT / "examples" / "checkpoints"


def _elements(path: Path) -> dict[str, int]:
    with path.open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    out = {}
    for name, meta in header.items():
        if name != "__metadata__":
            count = 1
            for d in meta["shape"]:
                count *= d
            out[name] = count
    return out


@pytest.mark.parametrize("name", ["tiny-code", "tiny-llama-random"])
def test_a_plain_step_reads_every_target_weight_but_the_embedding_beside_an_untied_head(name: str) -> None:
    ckpt = CHECKPOINTS / name
    cfg = json.loads((ckpt / "config.json").read_text())
    tensors = _elements(ckpt / "model.safetensors")
    read = sum(tensors.values())
    if not cfg.get("tie_word_embeddings", True):  # the head is read whole, the embedding only its row
        read -= tensors["model.embed_tokens.weight"]
    got = sb.target_bytes(cfg, context=0, dtype_bytes=2)
    assert got["weights"] == 2 * read and got["kv"] == 0
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    assert sb.target_bytes(cfg, 10, 2)["kv"] == cfg["num_hidden_layers"] * 10 * 2 * kv_heads * head_dim * 2


def test_a_draft_step_reads_its_layer_and_head_and_the_first_pass_its_fc_too() -> None:
    ckpt = CHECKPOINTS / "tiny-code-eagle3"
    cfg = json.loads((ckpt / "config.json").read_text())
    tensors = _elements(ckpt / "model.safetensors")
    # d2t / t2d map one token a step; the embedding is gathered a row at a time
    fc = tensors["fc.weight"]
    step = sum(v for k, v in tensors.items() if k not in ("d2t", "t2d", "embed_tokens.weight", "fc.weight"))
    got = sb.draft_bytes(cfg, context=0, dtype_bytes=2)
    assert got["step"] == 2 * step and got["fc"] == 2 * fc and got["first_pass"] == 2 * (step + fc)


def test_a_rounds_bytes_follow_its_configuration() -> None:
    assert sb.parse_config("chain-7") == (6, 1, 8)
    assert sb.parse_config("tree-s6-k4-t16") == (5, 4, 16)
    with pytest.raises(ValueError, match="chain-N or tree"):
        sb.parse_config("tree-6")
    target = {"weights": 1000, "kv": 0, "step": 1000}
    draft = {"step": 100, "fc": 10, "first_pass": 110}
    row = sb.bound(target, draft, "chain-7", 3.0)
    assert row["round_over_plain_bytes"] == pytest.approx((1000 + 110 + 6 * 100) / 1000)
    assert row["speedup_bound"] == pytest.approx(3.0 / 1.71, abs=1e-3)
    assert row["acceptance_for_goal"] == pytest.approx(2 * 1.71)


def test_the_script_writes_its_record_with_the_measured_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bound.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "spec_bytes_bound.py"),
                           "--target", str(CHECKPOINTS / "tiny-code"), "--draft", str(CHECKPOINTS / "tiny-code-eagle3"),
                           "--acceptance", "chain-3=2.0", "tree-s3-k2-t4=2.5", "--measured", "plain=0.5", "chain-3=0.8",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["configs"]["chain-3"]["measured_speedup"] == pytest.approx(2.0 / 1.6)
    assert "measured_speedup" not in record["configs"]["tree-s3-k2-t4"]
