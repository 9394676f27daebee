"""Vocab-parallel embedding and LM head.

The vocabulary is padded (as vLLM does) to a multiple of ``lcm(64, size)`` so it splits
evenly; rank r holds rows [r*V/size, (r+1)*V/size) of the padded table. The embedding's
output is a sum owed to the group (each rank contributes only its own rows); the LM head's
output is a vocab shard, gathered by the communicator and trimmed to the real vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import Group
from ..parallel.layouts import Unreduced
from .weight_source import WeightSource, copy_checked, expect_dim

VOCAB_PADDING = 64
EmbeddingFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [n] -> [n, H]: each id's row of the shard ``weight`` (vocab rows from ``start``), zeros for ids
    outside it (another rank's rows). The plain reference of ``embedding_triton``."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def padded_vocab_size(vocab_size: int, group_size: int) -> int:
    multiple = math.lcm(VOCAB_PADDING, group_size)
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """``lookup``: the kernel of ``forward`` (``Kernels.embedding``; default the torch reference)."""

    def __init__(self, vocab_size: int, hidden: int, group: Group, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, lookup: EmbeddingFn = embedding_lookup) -> None:
        super().__init__()
        self.group = group
        self.lookup = lookup
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, group.size)
        self.rows = self.padded_vocab // group.size
        self.start = group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype, device=device), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: object = None) -> None:
        expect_dim(source, 0, self.vocab_size)
        real = max(0, min(self.rows, self.vocab_size - self.start))
        with torch.no_grad():
            param.zero_()
        if real:
            copy_checked(param.narrow(0, 0, real), source.narrow(0, self.start, real), source.name)

    def forward(self, ids: torch.Tensor) -> Unreduced:
        # ids: [n] -> owed [n, hidden]
        return Unreduced(self.lookup(ids, self.weight, self.start), self.group.name)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab rows. Shares the embedding's table when tied. Multiplies through
    ``self.matmul`` (see ``linear.use_matmul``)."""

    def __init__(self, vocab_size: int, hidden: int, group: Group, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(vocab_size, hidden, group, dtype, device)
        self.matmul = F.linear

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden] -> [n, padded_vocab/size]
        return self.matmul(hidden, self.weight, None)
