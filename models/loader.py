"""HF checkpoint (config.json + *.safetensors, sharded index too) -> our model, sharded per rank.

Tensors are read lazily through safetensors slices: each parallel layer's ``weight_loader``
reads only this rank's shard, so no rank materialises the full weights. Every failure names
what is wrong: a missing file, a corrupt file, a missing tensor, a shape mismatch, an
unsupported architecture.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .interface import CausalLM
from .layers.kernels import Kernels
from .layers.linear import default_weight_loader
from .layers.weight_source import WeightShapeError
from .parallel.collectives import Collectives
from .parallel.groups import ParallelGroups
from .registry import model_class

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# config.json model types that ship remote code but are transformers configs under another name
# (transformers' Kimi-K2.5 config does the same for its kimi_k2 text config).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be loaded into the model; the message says why."""


class SafetensorsSource:
    """A lazily read tensor of an open safetensors file."""

    def __init__(self, name: str, handle: Any, file: Path) -> None:
        self.name = name
        self._slice = handle.get_slice(name)
        self._file = file

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._read(index)

    def full(self) -> torch.Tensor:
        return self._read((slice(None),) * len(self.shape) if self.shape else ())

    def _read(self, index: tuple[slice, ...]) -> torch.Tensor:
        try:
            return self._slice[index] if index else self._slice[:]
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{self._file.name}: cannot read tensor {self.name}: {e}") from e


def load_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (is this a HuggingFace checkpoint directory?)")
    try:
        data = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: not valid JSON: {e}") from e
    from transformers import AutoConfig

    alias = MODEL_TYPE_ALIASES.get(data.get("model_type", "")) if isinstance(data, dict) else None
    if alias is not None:  # a remote-code config that is a transformers config under another name
        fields = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
        return AutoConfig.for_model(alias, **fields)
    return AutoConfig.from_pretrained(str(path))


def architecture_of(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise CheckpointError("config.json names no architecture ('architectures' is empty)")
    return str(archs[0])


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: files named in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[SafetensorsSource]:
    from safetensors import safe_open

    for file in files:
        try:
            handle_cm = safe_open(str(file), framework="pt", device="cpu")
            handle = handle_cm.__enter__()
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
        try:
            for name in handle.keys():
                yield SafetensorsSource(name, handle, file)
        finally:
            handle_cm.__exit__(None, None, None)


def load_weights(model: nn.Module, sources: Iterator[Any]) -> None:
    """Load every tensor into its parameter; fail on any parameter left unloaded."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    # Buffers a checkpoint fills (e.g. EAGLE3's d2t map) load like parameters.
    params.update({n: b for n, b in model.named_buffers() if n in getattr(model, "checkpoint_buffers", ())})
    expected = _expected_loads(model, params) - {(n, None) for n in getattr(model, "optional_params", ())}
    loaded: set[tuple[str, object]] = set()
    for source in sources:
        target = model.checkpoint_name_to_param(source.name)  # type: ignore[operator]
        if target is None:
            continue
        pname, shard = target
        if pname not in params:
            raise CheckpointError(f"checkpoint tensor {source.name} has no place in the model (as {pname})")
        owner = model.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else model
        loader = getattr(owner, "weight_loader", default_weight_loader)
        try:
            # A loader may fill several shards from one tensor (e.g. fused experts): it
            # returns their ids; None means just ``shard``.
            filled = loader(params[pname], source, shard)
        except WeightShapeError as e:
            raise CheckpointError(str(e)) from e
        loaded.update((pname, s) for s in (filled if filled is not None else [shard]))
    missing = sorted(_checkpoint_name(model, p, s) for p, s in expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))


def _checkpoint_name(model: nn.Module, pname: str, shard: object) -> str:
    """Name one part of a parameter as the checkpoint does, for messages: ("layers.1.mlp.gate_up_proj.weight",
    1) -> "layers.1.mlp.up_proj.weight (part 1 of layers.1.mlp.gate_up_proj.weight)"."""
    for ours, theirs, sid in getattr(model, "stacked_params", ()):
        if sid == shard and ours in f".{pname}":
            theirs_name = f".{pname}".replace(ours, theirs)[1:]
            return f"{theirs_name} (part {shard!r} of {pname})"
    return pname if shard is None else f"{pname}[{shard!r}]"


def _expected_loads(model: nn.Module, params: dict[str, torch.Tensor]) -> set[tuple[str, object]]:
    shards: dict[str, list[object]] = {}
    for ours, _theirs, shard in getattr(model, "stacked_params", ()):
        shards.setdefault(ours, []).append(shard)
    tied = {name for name, p in params.items() if any(p is q for n, q in params.items() if n < name)}
    out: set[tuple[str, object]] = set()
    for name in params:
        if name in tied:
            continue
        stacked = next((ids for key, ids in shards.items() if key in f".{name}"), None)
        out |= {(name, s) for s in stacked} if stacked else {(name, None)}
    return out


def load_model(model_dir: str | Path, groups: ParallelGroups, collectives: Collectives,
               dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
               kernels: Kernels | None = None, **model_kwargs: Any) -> CausalLM:
    """This rank's shard of a checkpoint. ``collectives``: this rank's (its ``fused`` kernel, or
    None, decides whether the plan fuses); ``kernels``: the model's kernel set (default: the
    references); ``model_kwargs`` go to the model class (benchmarks only: ``dp_combine``)."""
    config = load_config(model_dir)
    cls = model_class(architecture_of(config))
    files = checkpoint_files(model_dir)
    module: nn.Module = cls(config, groups, collectives, dtype=dtype, device=device, kernels=kernels, **model_kwargs)
    load_weights(module, iter_checkpoint(files))
    model: CausalLM = module  # type: ignore[assignment]
    log.info("loaded %s from %s (%d files) on rank %d", type(model).__name__, model_dir, len(files),
             groups.coords.rank)
    return model
