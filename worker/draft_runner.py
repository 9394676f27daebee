"""Runs the EAGLE3 draft on the leader: the draft model, its own paged KV cache, its forward batches.

The draft cache has as many blocks as the target's and is addressed through the same block
tables, so the scheduler's reservations cover both. Layout per sequence (n = tokens of the
sequence whose K/V the target holds, i.e. the position of the last known token):

- slot b (b < n) holds the draft's step-0 entry for base b: token b + 1 read with the target's
  aux state at b, at RoPE position b + 1 (``bench/train_tiny_pair.py`` trains it so);
- slots n + (j - 1) * width + r hold the r-th node fed at draft step j >= 1 (RoPE n + j), scratch
  that the next step's extend overwrites.

Every draft forward's new rows are the last slots of its context, as in the target's batches;
tree steps pass an explicit mask (each node sees the bases, its ancestors and itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.eagle3 import Eagle3Draft, load_eagle3_draft
from ..models.forward_batch import ForwardBatch, KVCache
from ..models.loader import CheckpointError, checkpoint_files, iter_checkpoint

EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class DraftInput:
    """One sequence's rows of a draft forward: ``token_ids`` fill the last slots of ``context_len``."""

    block_table: list[int]
    token_ids: list[int]
    positions: list[int]  # RoPE positions
    context_len: int
    mask: torch.Tensor | None = None  # [len(token_ids), context_len] bool; None = causal
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

    @staticmethod
    def load(draft_dir: str | Path, target_dir: str | Path, target_config: Any, num_blocks: int, block_size: int,
             dtype: torch.dtype, device: torch.device) -> DraftRunner:
        """Load the draft (embedding from the target checkpoint when it has none) and its KV cache."""
        embedding = None
        if checkpoint_tensor(draft_dir, EMBEDDING_NAMES, read=False) is None:
            embedding = checkpoint_tensor(target_dir, EMBEDDING_NAMES)
            if embedding is None:
                raise CheckpointError(f"{draft_dir}: the draft has no embed_tokens and {target_dir} has none to share")
        model = load_eagle3_draft(str(draft_dir), int(target_config.hidden_size), embedding, dtype, device)
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
        masks = [None if d.mask is None else d.mask.to(dev) for d in inputs]
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
        logits, out = self.model(self.prepare(inputs), hidden.to(self.device))
        return logits.float(), out
