"""Runs the model on a scheduled batch: owns the model, its paged KV cache and recurrent state.

``prepare`` turns a ``ScheduledBatch`` (pure lists) into a ``models.forward_batch.ForwardBatch``:
tokens packed one sequence after another, their positions, the cache slot of every new token
(from the block tables), and ``logits_indices`` = the last ``num_logits`` rows of each sequence
(the last token when it samples, none for a prefill chunk, more for a speculative verify).
A sequence that verifies a speculative draft tree names its tree (``ScheduledSeq.tree_parents``)
and gets the tree's attention mask; other masks may come in beside the batch.

Recurrent state (Mamba layers): a model whose ``state_shapes()`` is not empty gets a
``MambaStateCache`` with one slot per schedulable sequence (``max_num_seqs``); every forward
carries the sequences' ``state_slots`` (also in ``extras["state_slots"]``) and, in
``extras["state_slot_fresh"]``, which of them start from an empty state this step (a new or a
preempted-and-recomputed sequence; the layers see it as ``context_len == query_len``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.forward_batch import ForwardBatch, KVCache
from ..models.layers.mamba_state import MambaStateCache, MambaStateShape
from ..models.loader import load_model
from ..models.parallel.collectives import Collectives
from ..models.parallel.groups import ParallelGroups
from .draft_tree import tree_attention_mask
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)


class KVCacheSizeError(ValueError):
    """The configured KV cache cannot be allocated or holds no block."""


def kv_bytes_per_block(kv_shapes: dict[int, tuple[int, ...]], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer (K and V). kv_shapes: layer -> (heads, dim) or (heads, k, v)."""
    per_token = 0
    for shape in kv_shapes.values():
        heads, k_dim, v_dim = (shape[0], shape[1], shape[1]) if len(shape) == 2 else shape
        per_token += heads * (k_dim + v_dim)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_memory(available_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Blocks that fit in ``fraction`` of ``available_bytes``."""
    if not 0.0 < fraction <= 1.0:
        raise KVCacheSizeError(f"KV memory fraction must be in (0, 1], got {fraction}")
    return int(available_bytes * fraction) // max(bytes_per_block, 1)


def state_bytes_per_slot(shapes: dict[int, MambaStateShape], dtype: torch.dtype,
                         ssm_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one sequence's recurrent state over every Mamba layer (conv in dtype, SSM in ssm_dtype)."""
    conv = sum(math.prod(s.conv) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    ssm = sum(math.prod(s.ssm) for s in shapes.values()) * torch.empty((), dtype=ssm_dtype).element_size()
    return conv + ssm


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: free GPU memory, or MemAvailable on a CPU host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise KVCacheSizeError("cannot measure free host memory; configure num_blocks explicitly")


def state_shapes_of(model: nn.Module) -> dict[int, MambaStateShape]:
    """The model's Mamba state shapes per layer; empty for a model without recurrent layers."""
    shapes = getattr(model, "state_shapes", None)
    return dict(shapes()) if callable(shapes) else {}


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache, device: torch.device,
                 num_state_slots: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.state_cache: MambaStateCache | None = None
        shapes = state_shapes_of(model)
        if shapes and num_state_slots > 0:
            dtype = next(model.parameters()).dtype
            self.state_cache = MambaStateCache.allocate(shapes, num_state_slots, dtype, device)

    @staticmethod
    def load(model_dir: str | Path, block_size: int, num_blocks: int | None, memory_fraction: float,
             num_state_slots: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", groups: ParallelGroups | None = None,
             collectives: Collectives | None = None, fusion: bool = False) -> ModelRunner:
        """Load a checkpoint on one rank and allocate its KV cache (``num_blocks`` or a memory share).
        ``groups``/``collectives``/``fusion``: this rank's share of a parallel engine (default: one rank)."""
        dev = torch.device(device)
        model = load_model(model_dir, groups or ParallelGroups.single_rank(), collectives or Collectives("gloo"),
                           fusion=fusion, dtype=dtype, device=dev)
        model.eval()
        shapes: dict[int, tuple[int, ...]] = model.kv_shapes()  # type: ignore[operator]
        if num_blocks is None:
            if not 0.0 < memory_fraction <= 1.0:
                raise KVCacheSizeError(f"KV memory fraction must be in (0, 1], got {memory_fraction}")
            per_block = kv_bytes_per_block(shapes, block_size, dtype)
            state = state_bytes_per_slot(state_shapes_of(model), dtype) * num_state_slots
            budget = int(available_memory(dev) * memory_fraction) - state
            num_blocks = num_blocks_for_memory(max(budget, 0), 1.0, per_block)
            log.info("KV cache: %d blocks of %d tokens (%.1f MiB) from %.0f%% of free memory (%.1f MiB of it "
                     "recurrent state)", num_blocks, block_size, num_blocks * per_block / 2**20,
                     memory_fraction * 100, state / 2**20)
        if num_blocks < 1:
            raise KVCacheSizeError(f"the KV cache holds no block of {block_size} tokens")
        cache = KVCache.allocate(shapes, num_blocks, block_size, dtype, dev)
        return ModelRunner(model, cache, dev, num_state_slots)

    @property
    def vocab_size(self) -> int:
        config: Any = self.model.config
        return int(config.vocab_size)

    def prepare(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None = None) -> ForwardBatch:
        """The forward batch of a scheduled step. attn_masks: per sequence [num_tokens, context_len] or None;
        when not given, a sequence with ``tree_parents`` gets its draft tree's mask."""
        if attn_masks is None and any(s.tree_parents is not None for s in batch.seqs):
            attn_masks = [None if s.tree_parents is None else
                          tree_attention_mask(s.tree_parents, s.start, self.device) for s in batch.seqs]
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for s in batch.seqs:
            table = s.block_table
            first_row = len(ids)
            ids += s.token_ids
            positions += s.rope_positions
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.context_len)]
            logits_rows += range(first_row + s.num_tokens - s.num_logits, first_row + s.num_tokens)
        dev = self.device
        state_slots = [s.state_slot if s.state_slot is not None else -1 for s in batch.seqs]
        fresh = [s.fresh for s in batch.seqs]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=[s.num_tokens for s in batch.seqs],
            context_lens=[s.context_len for s in batch.seqs],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=[s.block_table for s in batch.seqs],
            kv_cache=self.kv_cache,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            attn_masks=attn_masks,
            state_slots=state_slots if self.state_cache is not None else None,
            state_cache=self.state_cache,
            extras={"state_slots": state_slots, "state_slot_fresh": fresh},
        )

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Logits of every requested row, sequence by sequence: [sum(num_logits), vocab]."""
        logits: torch.Tensor = self.model(self.prepare(batch, attn_masks))
        return logits

    @torch.inference_mode()
    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots ``src`` to ``dst`` in every layer (all read before any is
        written), e.g. accepted draft-tree nodes to their sequence positions."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source slots for {len(dst)} destinations")
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for cache in (self.kv_cache.k, self.kv_cache.v):
            for layer in cache.values():
                layer[d] = layer[s]
