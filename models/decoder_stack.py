"""What every decoder-only model here shares: the forward over its layers, and checkpoint renaming.

The model files only say which embedding, layers, final norm and head they have; the order of
work (begin the forward, run the layers, complete the last owed sum in the final boundary, keep
the rows whose logits are wanted, gather the vocabulary shards) lives here once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .forward_batch import ForwardBatch
from .parallel.communicator import Communicator
from .parallel.layouts import Unreduced

Stacked = tuple[tuple[str, str, object], ...]  # (our fused name part, HF name part, shard id)


def decoder_logits(batch: ForwardBatch, comm: Communicator, embed: Any, layers: Iterable[Any],
                   final_boundary: int, final_norm: Any, lm_head: Any, vocab_size: int) -> torch.Tensor:
    """Logits for ``batch.logits_indices`` rows (all rows if None): [n, vocab_size]."""
    comm.begin_forward(batch.num_tokens, batch.dp_num_tokens)
    x: Unreduced = embed(batch.input_ids)
    residual: torch.Tensor | None = None
    for layer in layers:
        x, residual = layer(x, residual, batch, comm)
    h, _ = comm.boundary(final_boundary, x, residual, final_norm)
    if batch.logits_indices is not None:
        h = h[batch.logits_indices]
    logits = comm.gather_vocab(lm_head.logits_shard(h))
    return logits[:, :vocab_size]


def stacked_name(name: str, stacked: Stacked) -> tuple[str, object | None]:
    """An HF tensor name -> our parameter name and shard id (None: loaded whole)."""
    for ours, theirs, shard in stacked:
        if theirs in name:
            return name.replace(theirs, ours), shard
    return name, None
