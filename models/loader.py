"""HF checkpoint (config.json + *.safetensors, sharded index too) -> our model, sharded per rank.

Tensors are read lazily through safetensors slices: each parallel layer's ``weight_loader``
reads only this rank's shard, so no rank materialises the full weights. Every failure names
what is wrong: a missing file, a corrupt file, a missing tensor, a shape mismatch, an
unsupported architecture or quantization.

A block-FP8 checkpoint (``layers/fp8_block.py``, config.json's ``quantization_config``) loads as
``quantization.py`` decided: kept in FP8 (the model's layers load ``weight`` and ``weight_scale_inv``
shard by shard), or dequantized: ``iter_checkpoint`` then pairs each FP8 weight with its scales
(in whichever file they are) into one ``DequantizedSource`` and the model never sees a scale.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .interface import CausalLM
from .layers.fp8_block import BlockFP8, QuantizationConfigError
from .layers.kernels import Kernels
from .layers.linear import default_weight_loader
from .layers.weight_source import DequantizedSource, WeightShapeError, WeightSource, finish_loading
from .parallel.collectives import Collectives
from .parallel.fusion.selection import device_capability
from .parallel.groups import ParallelGroups
from .quantization import Quantization, choose_quantization
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


def _open(file: Path, stack: ExitStack) -> Any:
    from safetensors import safe_open

    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e


SCALE_SUFFIX = "_scale_inv"  # "<x>.weight" -> "<x>.weight_scale_inv"; fused experts "<x>" -> "<x>_scale_inv"


def iter_checkpoint(files: list[Path], dequantize: BlockFP8 | None = None) -> Iterator[WeightSource]:
    """Every tensor of the checkpoint, lazily; with ``dequantize`` each FP8 weight comes with its
    ``_scale_inv`` as one ``DequantizedSource`` and the scales are not yielded on their own."""
    if dequantize is None:
        for file in files:
            with ExitStack() as stack:
                handle = _open(file, stack)
                for name in handle.keys():
                    yield SafetensorsSource(name, handle, file)
        return
    with ExitStack() as stack:  # a weight's scales may sit in another file: every file open at once
        where = {name: (handle, file) for file in files for handle in [_open(file, stack)] for name in handle.keys()}  # noqa: SIM118
        for name, (handle, file) in where.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            source = SafetensorsSource(name, handle, file)
            if name + SCALE_SUFFIX not in where:
                yield source
                continue
            scale = SafetensorsSource(name + SCALE_SUFFIX, *where[name + SCALE_SUFFIX])
            try:
                yield DequantizedSource(source, scale, dequantize)
            except WeightShapeError as e:
                raise CheckpointError(str(e)) from e


def checkpoint_quantization(config: Any) -> BlockFP8 | None:
    """The checkpoint's block-FP8 format from its config (None = unquantized); CheckpointError if unsupported."""
    try:
        return BlockFP8.from_hf(config)
    except QuantizationConfigError as e:
        raise CheckpointError(str(e)) from e


def load_weights(model: nn.Module, sources: Iterator[Any]) -> None:
    """Load every tensor into its parameter; fail on any parameter left unloaded; then the tensors
    derived from weights (``finish_loading``)."""
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
    finish_loading(model)


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
               kernels: Kernels | None = None, quantization: Quantization | None = None,
               **model_kwargs: Any) -> CausalLM:
    """This rank's shard of a checkpoint. ``collectives``: this rank's (its ``fused`` kernel, or
    None, decides whether the plan fuses); ``kernels``: the model's kernel set (default: the
    references); ``quantization``: how to keep an FP8 checkpoint (default: ``auto`` on ``device``);
    ``model_kwargs`` go to the model class (benchmarks only: ``dp_combine``)."""
    config = load_config(model_dir)
    arch = architecture_of(config)
    cls = model_class(arch)
    files = checkpoint_files(model_dir)
    if quantization is None:
        quantization = choose_quantization("auto", checkpoint_quantization(config), arch,
                                           device_capability(device or "cpu"))
    if quantization.fp8 is not None:
        model_kwargs["fp8"] = quantization.fp8
    # A shape the split cannot take (e.g. an FP8 shard boundary inside a scale block) raises WeightShapeError here.
    module: nn.Module = cls(config, groups, collectives, dtype=dtype, device=device, kernels=kernels, **model_kwargs)
    load_weights(module, iter_checkpoint(files, quantization.checkpoint if quantization.dequantize else None))
    model: CausalLM = module  # type: ignore[assignment]
    log.info("loaded %s from %s (%d files) on rank %d, quantization: %s", type(model).__name__, model_dir, len(files),
             groups.coords.rank, quantization.weights)
    return model
