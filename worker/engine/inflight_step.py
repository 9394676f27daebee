"""A step whose sampled tokens are still on the device: what lets the engine overlap its host work
with the GPU (vLLM's async scheduling, sglang's overlap scheduler).

A plain step whose sampling rows all ``samples_on_device`` is launched and left running: its tokens
are drawn on the device, copied into pinned host memory behind the forward (an event marks the
copy), and each sampling sequence gets a ``PLACEHOLDER`` output in their place. The engine then
schedules and launches the next step at once — its rows that feed a placeholder take the token from
this step's device tensor (``input_ids``) — and only then waits for this step's copy, writes the
real ids over the placeholders and applies stops and text (``Engine._resolve``). While the GPU runs
step N+1, the host turns step N's tokens into outputs and plans step N+2.

A sequence that stops at step N has also run in step N+1: that row's token is dropped, and the K/V
slot it wrote belongs to a block the sequence frees (the stream runs the next owner's writes after
it). A sequence at its ``max_tokens`` with a placeholder outstanding is not scheduled again.

    prev = InFlightStep.launch(batch, tokens, seqs)      # tokens: [n] on the device
    ids = prev.input_ids(next_batch, device)             # the next forward's token ids, on the device
    values = prev.values()                               # waits for the copy only
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..executor.host_copy import read_later, to_device
from .scheduler import ScheduledBatch
from .sequence import PLACEHOLDER, Sequence


@dataclass
class InFlightStep:
    batch: ScheduledBatch
    seqs: list[Sequence]  # the sequences that sampled, in token order
    at: list[int]  # the index in each one's output_ids of its placeholder
    tokens: torch.Tensor  # [len(seqs)] int64 on the device
    read: Callable[[], list[Any]]  # their copy to the host, queued behind the step (``read_later``)

    @staticmethod
    def launch(batch: ScheduledBatch, tokens: torch.Tensor, seqs: list[Sequence]) -> InFlightStep:
        """Start the copy of ``tokens`` behind the work queued so far and give each sequence its placeholder."""
        read = read_later(tokens)
        at = []
        for seq in seqs:
            at.append(len(seq.output_ids))
            seq.output_ids.append(PLACEHOLDER)
        return InFlightStep(batch, seqs, at, tokens, read)

    def input_ids(self, batch: ScheduledBatch, device: torch.device) -> torch.Tensor | None:
        """The token ids of ``batch``'s forward (its rows in order) on the device, with this step's tokens
        where a row feeds a placeholder; None when no row does (the batch's own ids are all known)."""
        source = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        ids: list[int] = []
        rows: list[int] = []
        picks: list[int] = []
        for entry in batch.seqs:
            for token in entry.token_ids:
                if token == PLACEHOLDER:
                    rows.append(len(ids))
                    picks.append(source[entry.seq_id])
                ids.append(token)
        if not rows:
            return None
        if len(rows) == len(ids) and picks == list(range(len(self.seqs))):
            return self.tokens  # every row is one of these tokens, in order (steady decoding)
        out = to_device([max(t, 0) for t in ids], device)
        out.index_copy_(0, to_device(rows, device), self.tokens.index_select(0, to_device(picks, device)))
        return out

    def values(self) -> list[int]:
        """The sampled tokens, once their copy is done (waits for it, not for later steps)."""
        return [int(t) for t in self.read()]
