"""A block-FP8 checkpoint written back dequantized: the same tensors in a float dtype, no scales, and
config.json without its ``quantization_config`` (HF transformers, or any loader, reads it as a plain
checkpoint). The oracle of ``fusedserve verify --oracle hf-dequantized`` where transformers cannot
dequantize the checkpoint on CPU itself (it needs every weight to be whole blocks).

Reads through the loader's ``iter_checkpoint`` pairing, so its maths is ``DequantizedSource``'s; the
tests check that against transformers' own dequantization on a checkpoint it can read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .loader import CheckpointError, checkpoint_files, checkpoint_quantization, iter_checkpoint, load_config


def write_dequantized(model_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model_dir`` dequantized to ``dtype`` into ``out_dir`` (one safetensors file); returns out_dir."""
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    fmt = checkpoint_quantization(load_config(src))
    if fmt is None:
        raise CheckpointError(f"{src}: config.json has no block-FP8 quantization_config: nothing to dequantize")
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for source in iter_checkpoint(checkpoint_files(src), fmt):
        t = source.full()
        tensors[source.name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in src.iterdir():  # tokenizer, generation config, remote code
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json",
                                                                                      "model.safetensors.index.json"):
            shutil.copy2(extra, out / extra.name)
    return out
