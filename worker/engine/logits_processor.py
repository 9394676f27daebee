"""A request's logits adjustments before sampling, as one pure function of (logits, params, history).

The sampler (one row per sequence) and the speculative verifier (one row per draft position, the
history as it would be at that position) both call ``adjust_logits``; the sampler then applies
temperature, ``min_p``, top-k and top-p (``Sampler.probs``). Order, as vLLM's: ``min_tokens``
(EOS and stop token ids masked while fewer outputs than that), ``logit_bias`` (added),
repetition penalty (prompt and output tokens: a positive logit divided by it, a negative one
multiplied), frequency and presence penalties (output tokens: ``count x frequency + presence``
subtracted), the grammar's mask (tokens it forbids at -inf).

    rows = [LogitsRow(params, prompt_ids, output_ids, eos_ids, allowed=None)]
    adjusted = adjust_logits(logits, rows)  # logits: [1, vocab] -> [1, vocab] float32
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .sequence import SamplingParams


@dataclass(frozen=True)
class LogitsRow:
    """What one logits row is adjusted by: the request's parameters and its history at that row."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]  # generated before this row's token (a draft position: the drafts before it too)
    eos_ids: frozenset[int] = frozenset()
    allowed: torch.Tensor | None = None  # [vocab] bool: the grammar's tokens at this row (None = all)

    @property
    def needs_adjusting(self) -> bool:
        return self.allowed is not None or self.params.adjusts_logits


def stop_ids(params: SamplingParams, eos_ids: frozenset[int]) -> list[int]:
    """The tokens ``min_tokens`` holds back: EOS (unless ``ignore_eos``) and the stop token ids."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))


def adjust_row(logits: torch.Tensor, row: LogitsRow) -> torch.Tensor:
    """One row. logits: [vocab] float32 -> [vocab] float32 (a new tensor)"""
    out = logits.clone()
    p = row.params
    vocab = out.shape[0]
    device = out.device
    if p.min_tokens and len(row.output_ids) < p.min_tokens:
        held = [t for t in stop_ids(p, row.eos_ids) if t < vocab]
        if held:
            out[torch.tensor(held, device=device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
        out.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype, device=device))
    if p.repetition_penalty != 1.0 and (row.prompt_ids or row.output_ids):
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor([*row.prompt_ids, *row.output_ids], dtype=torch.long, device=device)] = True
        penalised = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
        out = torch.where(seen, penalised, out)
    if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
        counts = torch.zeros(vocab, dtype=out.dtype, device=device)
        counts.index_add_(0, torch.tensor(list(row.output_ids), dtype=torch.long, device=device),
                          torch.ones(len(row.output_ids), dtype=out.dtype, device=device))
        out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)
    if row.allowed is not None:
        out = out.masked_fill(~row.allowed.to(device), float("-inf"))
    return out


def adjust_logits(logits: torch.Tensor, rows: Seq[LogitsRow]) -> torch.Tensor:
    """logits: [n, vocab] -> [n, vocab] float32; rows without adjustments are passed through."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} rows of parameters")
    out = logits.float()
    todo = [i for i, r in enumerate(rows) if r.needs_adjusting]
    if not todo:
        return out
    out = out.clone()
    for i in todo:
        out[i] = adjust_row(out[i], rows[i])
    return out
