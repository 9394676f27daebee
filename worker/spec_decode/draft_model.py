"""The EAGLE3 draft of an engine: its model, its own paged KV cache and executor, and its aux layers.

The draft cache has as many blocks as the target's and is addressed through the same block
tables, so the scheduler's reservations cover both. Layout per sequence (n = tokens of the
sequence whose K/V the target holds, i.e. the position of the last known token):

- slot b (b < n) holds the draft's step-0 entry for base b: token b + 1 read with the target's
  aux state at b, at RoPE position b + 1 (``bench/train_tiny_pair.py`` trains it so);
- slots n + (j - 1) * width + r hold the r-th node fed at draft step j >= 1 (RoPE n + j), scratch
  that the next step's extend overwrites.

Every draft forward's new rows are the last slots of its context, as in the target's forwards;
tree steps pass a mask over the scratch slots (each node sees the bases, its ancestors and itself).

CUDA graphs (``draft_shapes``): the first pass (at most ``num_steps + 1`` bases per sequence,
padded in front, the last row's logits) and the draft steps (``width`` nodes per sequence; a
tree's step j with its mask over the ``j * width`` scratch slots) at every captured batch size;
and (``chain_shapes``) its steps after the first pass chained in one replay (a chain's, greedy or
sampled, also with the first pass in the same replay; or a tree's grown on the device), at the batch
sizes whose attention reads device metadata only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...models.eagle3 import Eagle3Draft, aux_layers, load_eagle3_draft
from ...models.forward_batch import KVCache
from ...models.layers.attention_layout import flashinfer_supports
from ...models.layers.kernels import Kernels
from ...models.layers.paged_attention_torch import paged_attention_torch
from ...models.loader import CheckpointError, checkpoint_files, iter_checkpoint, load_config
from ..executor.executor import StepExecutor
from ..executor.step_shape import StepShape
from .config import SpeculativeConfig

EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


def checkpoint_tensor(model_dir: str | Path, names: tuple[str, ...], read: bool = True) -> torch.Tensor | None:
    """The first of ``names`` found in a checkpoint, read in full (an empty tensor when not
    ``read``: only its presence is asked); None if absent."""
    for source in iter_checkpoint(checkpoint_files(model_dir)):
        if source.name in names:
            return source.full() if read else torch.empty(0)
    return None


def draft_aux_layers(spec: SpeculativeConfig, target_config: Any) -> tuple[int, ...]:
    """The target layers whose complete input residual feeds this draft (its config may name them)."""
    return tuple(aux_layers(int(target_config.num_hidden_layers), load_config(spec.draft_model)))


def build_draft(draft_dir: str | Path, target_dir: str | Path, target_config: Any, num_blocks: int, block_size: int,
                dtype: torch.dtype, device: torch.device, graph_ready: bool = False,
                reserved_blocks: int = 0, kernels: Kernels | None = None) -> tuple[Eagle3Draft, StepExecutor]:
    """The draft (its embedding from the target checkpoint when it has none) and its executor.
    ``num_blocks``: the target cache's, its ``reserved_blocks`` padding block included; ``graph_ready``:
    graph-safe attention (the engine captures the draft's steps); ``kernels``: the target's set: the draft runs its
    norms, RoPE, activation and matmul, and its attention (and planner) when the draft's heads fit, else the
    graph-safe torch attention."""
    embedding = None
    if checkpoint_tensor(draft_dir, EMBEDDING_NAMES, read=False) is None:
        embedding = checkpoint_tensor(target_dir, EMBEDDING_NAMES)
        if embedding is None:
            raise CheckpointError(f"{draft_dir}: the draft has no embed_tokens and {target_dir} has none to share")
    draft_config = load_config(draft_dir)
    head_dim = int(getattr(draft_config, "head_dim", None) or draft_config.hidden_size // draft_config.num_attention_heads)
    fast = kernels is not None and kernels.planner is not None and flashinfer_supports(head_dim, dtype)
    attention = kernels.attention if fast and kernels is not None else (paged_attention_torch if graph_ready else None)
    model = load_eagle3_draft(str(draft_dir), int(target_config.hidden_size), embedding, dtype, device, attention,
                              kernels)
    model.eval()
    mapped = model.to_target_ids(torch.arange(model.draft_vocab, device=device))
    if int(mapped.min()) < 0 or int(mapped.max()) >= int(target_config.vocab_size):
        raise CheckpointError(f"{draft_dir}: d2t maps draft ids outside the target vocabulary "
                              f"[0, {target_config.vocab_size})")
    cache = KVCache.allocate(model.kv_shapes(), num_blocks, block_size, dtype, device)  # type: ignore[arg-type]
    planner = None
    if fast and kernels is not None and kernels.planner is not None:
        dims = model.attention_dims()
        planner = kernels.planner(dims.num_qo_heads, dims.num_kv_heads, dims.head_dim, dims.scale, cache)
    return model, StepExecutor(model, cache, device, reserved_blocks=reserved_blocks, graph_ready=graph_ready,
                               attention=planner)


def chain_shapes(model: Eagle3Draft, batch_sizes: list[int], num_steps: int, width: int = 1) -> list[StepShape]:
    """Steps 1 .. num_steps - 1 as one chained replay per batch size (none for one step): a chain's, greedy
    and sampled (its drafts drawn at each request's temperature), alone and after the first pass (the
    first pass's rows, as ``draft_shapes``), or (``width`` > 1) a tree's, ``width`` leaves per step with a
    mask over the last (num_steps - 1) * width slots, alone and after the first pass."""
    h = int(model.config.hidden_size)
    chain = num_steps - 1
    if not chain:
        return []
    aux = int(model.fc.in_features)
    if width > 1:  # alone (after a first pass replayed on its own), and after the first pass (a round in flight)
        return [shape for b in batch_sizes
                for shape in (StepShape(b, width, chain * width, hidden=h, chain=chain),
                              StepShape(b, num_steps + 1, chain * width, last_only=True, hidden=aux, chain=chain))]
    return [shape for b in batch_sizes for s in (False, True)
            for shape in (StepShape(b, 1, hidden=h, chain=chain, sampled=s),
                          StepShape(b, num_steps + 1, last_only=True, hidden=aux, chain=chain, sampled=s))]


def draft_shapes(model: Eagle3Draft, batch_sizes: list[int], num_steps: int, width: int) -> list[StepShape]:
    """The draft's captured shapes: the first pass, and the steps of ``num_steps`` x ``width`` drafting."""
    h = int(model.config.hidden_size)
    aux = int(model.fc.in_features)
    first_pass_rows = num_steps + 1  # the root and at most num_steps accepted drafts
    tails = [0] if width == 1 else [j * width for j in range(1, num_steps)]
    shapes = [StepShape(b, first_pass_rows, last_only=True, hidden=aux) for b in batch_sizes]
    if num_steps > 1:
        shapes += [StepShape(b, width, tail, hidden=h) for b in batch_sizes for tail in tails]
    return shapes
