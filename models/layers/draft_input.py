"""An EAGLE3 draft step's input row, and the draft's greedy choice as target ids (plain references).

``draft_input(ids, table, hidden, w_embed, w_hidden, eps)`` -> ``cat(rms_norm(table[ids]) * w_embed,
rms_norm(hidden) * w_hidden)`` [n, 2H]: the token's embedding and the hidden state, each RMS-normed, side by
side (``models/eagle3.py``'s step, before its attention). ``argmax_to(logits, table)`` -> ``table[argmax(row)]``
(first index of the largest value): the draft's greedy token mapped to the target's vocabulary. The fast
set's kernels (``draft_input_triton.py``, ``argmax_triton.argmax_to_triton``) do each in one launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.fusion.reference import rms_norm

# (ids [n], embedding table [vocab, H], hidden [n, H], embedding norm weight [H], hidden norm weight [H], eps)
DraftInputFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# (logits [n, vocab], table [vocab] int64) -> [n] int64
ArgmaxToFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def draft_input(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.cat([rms_norm(table[ids], w_embed, eps), rms_norm(hidden, w_hidden, eps)], dim=-1)


def argmax_to(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[logits.argmax(dim=-1)]
