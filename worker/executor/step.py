"""What one forward of an executor runs, as a plain value (no tensors): the step description a
leader broadcasts to its followers, and the input of every forward the engine runs.

A ``SeqRows`` is one sequence's new rows: they fill the last ``len(token_ids)`` cache slots of
``context_len`` (the K/V slots ``start .. context_len - 1`` through ``block_table``), at the RoPE
``positions``; the trailing ``num_logits`` rows get logits. Attention is causal, or — for a
speculative tree — ``tail_mask`` replaces the causal rule over the context's last ``tail`` slots
(row-major [rows, tail], True = may attend; every slot before them stays visible). Examples:

    SeqRows((3, 9), (17,), (21,), 22)                          decode: one token at position 21
    SeqRows((3, 9), (17, 5, 8, 2), (21, 22, 23, 24), 25, 4)    verify a chain of 3 drafts (causal)
    SeqRows((3, 9), (17, 5, 8), (21, 22, 22), 24, 3,
            tail_mask=(1,0,0, 1,1,0, 1,0,1))                   verify a tree: root + two children

A ``Step`` is one forward: its sequences and, under DP attention, every DP group's token count
(the same on every rank) and — when the DP leaders agreed to replay a CUDA graph — the captured
``graph_shape`` every group replays at (padding its own rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...models.layers.attention_layout import AttentionLayout
from ...models.parallel.dp_geometry import Padding
from .step_shape import StepShape


def cache_slots(block_table: tuple[int, ...] | list[int], start: int, end: int, block_size: int) -> list[int]:
    """The K/V cache slots of sequence positions ``start .. end - 1`` (the one slot formula)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def ancestor_mask(parents: tuple[int, ...] | list[int]) -> tuple[bool, ...]:
    """A draft tree's mask over its own nodes, row-major [nodes, nodes]: each node's ancestors
    and itself."""
    n = len(parents)
    rows = np.zeros((n, n), dtype=bool)  # a verify of 64 nodes: 4096 entries per step, built row by row
    for i, p in enumerate(parents):
        if p >= 0:
            rows[i] = rows[p]
        rows[i, i] = True
    return tuple(rows.ravel().tolist())


@dataclass(frozen=True)
class SeqRows:
    block_table: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]  # RoPE positions of the rows
    context_len: int  # tokens in the cache after this forward, the new rows included
    num_logits: int = 1  # trailing rows that get logits
    tail_mask: tuple[bool, ...] | None = None  # [rows, tail] row-major; None = causal
    state_slot: int | None = None  # recurrent-state slot (Mamba layers)

    def __post_init__(self) -> None:
        rows = len(self.token_ids)
        if len(self.positions) != rows:
            raise ValueError(f"{rows} tokens but {len(self.positions)} positions")
        if not 0 <= self.num_logits <= rows:
            raise ValueError(f"num_logits {self.num_logits} outside [0, {rows}]")
        if rows > self.context_len:
            raise ValueError(f"{rows} new rows do not fit a context of {self.context_len}")
        if self.tail_mask is not None and (rows == 0 or len(self.tail_mask) % rows):
            raise ValueError(f"a tail mask of {len(self.tail_mask)} entries for {rows} rows")

    @property
    def rows(self) -> int:
        return len(self.token_ids)

    @property
    def start(self) -> int:
        """Cache position of the first new row (tokens already cached)."""
        return self.context_len - len(self.token_ids)

    @property
    def tail(self) -> int:
        return 0 if self.tail_mask is None else len(self.tail_mask) // len(self.token_ids)

    @property
    def fresh(self) -> bool:
        """The sequence starts from an empty cache (and an empty recurrent state) this forward."""
        return self.start == 0

    def slots(self, block_size: int) -> list[int]:
        return cache_slots(self.block_table, self.start, self.context_len, block_size)


@dataclass(frozen=True)
class Step:
    seqs: tuple[SeqRows, ...]
    # DP attention: every DP group's tokens this forward (the same tuple on every rank); None without.
    dp_num_tokens: tuple[int, ...] | None = None
    # DP attention under CUDA graphs: the captured shape every DP group replays at, agreed by the DP
    # leaders (``parallel/dp_rounds.py``); None = this rank's executor chooses (eager under DP).
    graph_shape: StepShape | None = None
    # Tests, verify and benchmarks may pin the DP padding of an eager forward; None = sglang's choice.
    dp_padding: Padding | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.rows for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)

    def attention_layout(self) -> AttentionLayout:
        """The forward's attention layout, for a backend that plans before the forward runs."""
        masks = tuple(s.tail_mask for s in self.seqs)
        return AttentionLayout(tuple(s.rows for s in self.seqs), tuple(s.context_len for s in self.seqs),
                               tuple(s.block_table for s in self.seqs),
                               masks if any(m is not None for m in masks) else None)
