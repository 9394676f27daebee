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

CUDA graphs (``ModelRunner.load(graphs=True)``: graph-safe kernels and one cache block kept back
for padding rows; ``capture_graphs`` once at start-up): a step whose sequences all feed the same
number of tokens and ask logits for all of them (decode, a speculative verify) runs as a replay
at the next captured batch size (``step_graphs.py``), a tree verify with its mask as a device
tensor; any other step (prefill, mixed, too large) runs eagerly.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.forward_batch import ForwardBatch, KVCache
from ..models.layers.kernels import Kernels
from ..models.layers.mamba_state import MambaStateCache, MambaStateShape
from ..models.loader import load_model
from ..models.parallel.collectives import Collectives
from ..models.parallel.groups import ParallelGroups
from .draft_tree import tree_attention_mask
from .scheduler import ScheduledBatch, ScheduledSeq
from .step_graphs import StepGraphs, StepRows, StepShape

log = logging.getLogger(__name__)


def ancestor_mask(parents: tuple[int, ...] | list[int]) -> list[bool]:
    """A draft tree's mask over its own nodes, row-major [nodes, nodes]: each node's ancestors
    and itself (the last ``nodes`` columns of ``tree_attention_mask``)."""
    n = len(parents)
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(rows[p]) if p >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    return [x for r in rows for x in r]


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
                 num_state_slots: int = 0, reserved_blocks: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # Blocks at the end of the cache no sequence gets (the padding rows' slot of CUDA graphs).
        self.reserved_blocks = reserved_blocks
        self.graphs: StepGraphs | None = None
        self._forward = self._eager
        self.state_cache: MambaStateCache | None = None
        shapes = state_shapes_of(model)
        if shapes and num_state_slots > 0:
            dtype = next(model.parameters()).dtype
            self.state_cache = MambaStateCache.allocate(shapes, num_state_slots, dtype, device)

    @staticmethod
    def load(model_dir: str | Path, block_size: int, num_blocks: int | None, memory_fraction: float,
             num_state_slots: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", groups: ParallelGroups | None = None,
             collectives: Collectives | None = None, fusion: bool = False, graphs: bool = False) -> ModelRunner:
        """Load a checkpoint on one rank and allocate its KV cache (``num_blocks`` or a memory share).
        ``groups``/``collectives``/``fusion``: this rank's share of a parallel engine (default: one rank).
        ``graphs``: ready for ``capture_graphs`` (graph-safe kernels, one more block for padding)."""
        dev = torch.device(device)
        model = load_model(model_dir, groups or ParallelGroups.single_rank(), collectives or Collectives("gloo"),
                           fusion=fusion, dtype=dtype, device=dev,
                           kernels=Kernels.torch_native() if graphs else None)
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
        reserved = 1 if graphs else 0
        cache = KVCache.allocate(shapes, num_blocks + reserved, block_size, dtype, dev)
        return ModelRunner(model, cache, dev, num_state_slots, reserved)

    @property
    def num_blocks(self) -> int:
        """Cache blocks the scheduler may hand out."""
        return self.kv_cache.num_blocks - self.reserved_blocks

    def capture_graphs(self, shapes: list[StepShape], max_blocks: int) -> None:
        """Capture the forward at these shapes (once, at start-up, after every aux capture is set);
        from now on matching steps replay. Needs ``load(graphs=True)``."""
        if self.reserved_blocks < 1:
            raise ValueError("CUDA graphs need a reserved cache block for padding rows (load(graphs=True))")
        model: Any = self.model
        comm = model.comm

        def step(batch: ForwardBatch, _hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            logits: torch.Tensor = model(batch)
            return (logits, *comm.captured)

        dtype = next(model.parameters()).dtype
        self.graphs = StepGraphs(step, self.kv_cache, shapes, max_blocks, dtype, comm.collectives)
        self._forward = self._graphed

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
        return self._forward(batch, attn_masks)

    def _eager(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None) -> torch.Tensor:
        logits: torch.Tensor = self.model(self.prepare(batch, attn_masks))
        return logits

    def _graphed(self, batch: ScheduledBatch, attn_masks: list[torch.Tensor | None] | None) -> torch.Tensor:
        """A replay when a captured shape fits the step, else the eager forward."""
        graphs = self.graphs
        assert graphs is not None
        shape = None if attn_masks is not None else self._shape_of(graphs, batch.seqs)
        if shape is None:
            return self._eager(batch, attn_masks)
        bs = self.kv_cache.block_size
        rows = [StepRows(s.block_table, s.token_ids, s.rope_positions,
                         [s.block_table[p // bs] * bs + p % bs for p in range(s.start, s.context_len)],
                         s.context_len, None if s.tree_parents is None else ancestor_mask(s.tree_parents))
                for s in batch.seqs]
        logits, *aux = graphs.run(shape, rows)
        self.model.comm.captured = aux  # type: ignore[union-attr]
        return logits

    @staticmethod
    def _shape_of(graphs: StepGraphs, seqs: list[ScheduledSeq]) -> StepShape | None:
        """Every sequence feeds q tokens, all with logits, all causal or all a tree: (n, q[, tail q])."""
        q = seqs[0].num_tokens
        tree = seqs[0].tree_parents is not None
        if any(s.num_tokens != q or s.num_logits != q or (s.tree_parents is not None) != tree for s in seqs):
            return None
        return graphs.shape_for(len(seqs), q, tail=q if tree else 0)

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
