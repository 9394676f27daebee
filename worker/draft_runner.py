"""Runs the EAGLE3 draft on the leader: the draft model, its own paged KV cache, its forward batches.

The draft cache has as many blocks as the target's and is addressed through the same block
tables, so the scheduler's reservations cover both. Layout per sequence (n = tokens of the
sequence whose K/V the target holds, i.e. the position of the last known token):

- slot b (b < n) holds the draft's step-0 entry for base b: token b + 1 read with the target's
  aux state at b, at RoPE position b + 1 (``bench/train_tiny_pair.py`` trains it so);
- slots n + (j - 1) * width + r hold the r-th node fed at draft step j >= 1 (RoPE n + j), scratch
  that the next step's extend overwrites.

Every draft forward's new rows are the last slots of its context, as in the target's batches;
tree steps pass an explicit mask over the scratch slots (each node sees the bases, its ancestors
and itself).

CUDA graphs (``load(graphs=True)``, then ``capture_graphs`` once at start-up; ``step_graphs.py``):
the first pass (at most ``num_steps + 1`` bases per sequence, padded in front, the last row's
logits) and the draft steps (``width`` nodes per sequence; a tree's step j with its mask over the
``j * width`` scratch slots) replay at the next captured batch size; anything else (the first
pass after a prefill) runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.eagle3 import Eagle3Draft, load_eagle3_draft
from ..models.forward_batch import ForwardBatch, KVCache
from ..models.layers.paged_attention_torch import paged_attention_torch
from ..models.loader import CheckpointError, checkpoint_files, iter_checkpoint
from .step_graphs import StepGraphs, StepRows, StepShape

EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class DraftInput:
    """One sequence's rows of a draft forward: ``token_ids`` fill the last slots of ``context_len``."""

    block_table: list[int]
    token_ids: list[int]
    positions: list[int]  # RoPE positions
    context_len: int
    # [len(token_ids), L] bool over the context's last L slots (every slot before them visible);
    # None = causal
    mask: torch.Tensor | None = None
    num_logits: int = 1  # trailing rows that get logits


def checkpoint_tensor(model_dir: str | Path, names: tuple[str, ...], read: bool = True) -> torch.Tensor | None:
    """The first of ``names`` found in a checkpoint, read in full (an empty tensor when not
    ``read``: only its presence is asked); None if absent."""
    for source in iter_checkpoint(checkpoint_files(model_dir)):
        if source.name in names:
            return source.full() if read else torch.empty(0)
    return None


class DraftRunner:
    def __init__(self, model: Eagle3Draft, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs: StepGraphs | None = None
        self.first_pass_rows = 0  # the captured first pass's rows per sequence
        self._forward = self._eager

    @staticmethod
    def load(draft_dir: str | Path, target_dir: str | Path, target_config: Any, num_blocks: int, block_size: int,
             dtype: torch.dtype, device: torch.device, graphs: bool = False) -> DraftRunner:
        """Load the draft (embedding from the target checkpoint when it has none) and its KV cache.
        ``graphs``: graph-safe attention (``capture_graphs`` follows); ``num_blocks`` is the
        target cache's, its reserved padding block included."""
        embedding = None
        if checkpoint_tensor(draft_dir, EMBEDDING_NAMES, read=False) is None:
            embedding = checkpoint_tensor(target_dir, EMBEDDING_NAMES)
            if embedding is None:
                raise CheckpointError(f"{draft_dir}: the draft has no embed_tokens and {target_dir} has none to share")
        model = load_eagle3_draft(str(draft_dir), int(target_config.hidden_size), embedding, dtype, device,
                                  paged_attention_torch if graphs else None)
        model.eval()
        mapped = model.to_target_ids(torch.arange(model.draft_vocab, device=device))
        if int(mapped.min()) < 0 or int(mapped.max()) >= int(target_config.vocab_size):
            raise CheckpointError(f"{draft_dir}: d2t maps draft ids outside the target vocabulary "
                                  f"[0, {target_config.vocab_size})")
        cache = KVCache.allocate(model.kv_shapes(), num_blocks, block_size, dtype, device)  # type: ignore[arg-type]
        return DraftRunner(model, cache, device)

    @property
    def draft_vocab(self) -> int:
        return self.model.draft_vocab

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target_ids(draft_ids)

    def prepare(self, inputs: list[DraftInput]) -> ForwardBatch:
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for d in inputs:
            q = len(d.token_ids)
            first = len(ids)
            ids += d.token_ids
            positions += d.positions
            slots += [d.block_table[p // bs] * bs + p % bs for p in range(d.context_len - q, d.context_len)]
            logits_rows += range(first + q - d.num_logits, first + q)
        dev = self.device
        masks = [None if d.mask is None else _full_mask(d.mask, d.context_len).to(dev) for d in inputs]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_lens=[len(d.token_ids) for d in inputs],
            context_lens=[d.context_len for d in inputs],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=[d.block_table for d in inputs],
            kv_cache=self.kv_cache,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            attn_masks=masks if any(m is not None for m in masks) else None,
        )

    @torch.inference_mode()
    def forward(self, inputs: list[DraftInput], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over every input's rows.

        hidden: [rows, 3*H_target] (target aux states) or [rows, H] (the draft's own outputs)
        -> (draft-vocab logits [sum(num_logits), draft_vocab] fp32, next hidden [rows, H])
        """
        logits, out = self._forward(inputs, hidden.to(self.device))
        return logits.float(), out

    def _eager(self, inputs: list[DraftInput], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, out = self.model(self.prepare(inputs), hidden)
        return logits, out

    def capture_graphs(self, batch_sizes: list[int], num_steps: int, width: int, max_blocks: int) -> None:
        """Capture the first pass and the draft steps of ``num_steps`` x ``width`` drafting
        (once, at start-up); needs ``load(graphs=True)``."""
        h = int(self.model.config.hidden_size)
        aux = int(self.model.fc.in_features)
        self.first_pass_rows = num_steps + 1  # the root and at most num_steps accepted drafts
        tails = [0] if width == 1 else [j * width for j in range(1, num_steps)]
        shapes = [StepShape(b, self.first_pass_rows, last_only=True, hidden=aux) for b in batch_sizes]
        if num_steps > 1:
            shapes += [StepShape(b, width, tail, hidden=h) for b in batch_sizes for tail in tails]
        model = self.model

        def step(batch: ForwardBatch, hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            assert hidden is not None
            return model(batch, hidden)  # type: ignore[no-any-return]

        self.graphs = StepGraphs(step, self.kv_cache, shapes, max_blocks, model.fc.weight.dtype)
        self._forward = self._graphed

    def _graphed(self, inputs: list[DraftInput], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A replay when a captured shape fits, else the eager forward."""
        graphs = self.graphs
        assert graphs is not None
        shape = self._shape_of(graphs, inputs, int(hidden.shape[-1]))
        if shape is None:
            return self._eager(inputs, hidden)
        bs = self.kv_cache.block_size
        rows = [StepRows(d.block_table, d.token_ids, d.positions,
                         [d.block_table[p // bs] * bs + p % bs for p in range(d.context_len - len(d.token_ids),
                                                                               d.context_len)],
                         d.context_len, None if d.mask is None else d.mask.flatten().tolist())
                for d in inputs]
        logits, out = graphs.run(shape, rows, hidden)
        return logits, out

    def _shape_of(self, graphs: StepGraphs, inputs: list[DraftInput], hidden: int) -> StepShape | None:
        """A draft step (every input ``q`` rows with logits, causal or all with a mask of one
        width) or a first pass (at most ``first_pass_rows`` rows, the last with logits)."""
        q = len(inputs[0].token_ids)
        first = inputs[0].mask
        tail = 0 if first is None else int(first.shape[1])
        if all(len(d.token_ids) == q and d.num_logits == q and
               (0 if d.mask is None else int(d.mask.shape[1])) == tail and (d.mask is None) == (first is None)
               for d in inputs):
            shape = graphs.shape_for(len(inputs), q, tail, hidden=hidden)
            if shape is not None:
                return shape
        if all(d.num_logits == 1 and d.mask is None and len(d.token_ids) <= self.first_pass_rows for d in inputs):
            return graphs.shape_for(len(inputs), self.first_pass_rows, last_only=True, hidden=hidden)
        return None


def _full_mask(tail: torch.Tensor, context_len: int) -> torch.Tensor:
    """A mask over the last slots -> over the whole context: [rows, L] -> [rows, context_len]."""
    full = torch.ones((tail.shape[0], context_len), dtype=torch.bool)
    full[:, context_len - tail.shape[1]:] = tail
    return full
