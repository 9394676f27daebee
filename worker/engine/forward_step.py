"""A scheduled batch as the executor's forward ``Step`` (plain values: what a leader broadcasts)."""

from __future__ import annotations

from ..executor.step import SeqRows, Step, ancestor_mask
from .scheduler import ScheduledBatch, ScheduledSeq


def seq_rows(s: ScheduledSeq) -> SeqRows:
    """A scheduled sequence's rows; a verified draft tree (``tree_parents``) becomes its mask over
    the tree's own slots (each node sees the cached tokens, its ancestors and itself)."""
    return SeqRows(tuple(s.block_table), tuple(s.token_ids), tuple(s.rope_positions), s.context_len, s.num_logits,
                   None if s.tree_parents is None else ancestor_mask(s.tree_parents), s.state_slot)


def forward_step(batch: ScheduledBatch) -> Step:
    return Step(tuple(seq_rows(s) for s in batch.seqs))
