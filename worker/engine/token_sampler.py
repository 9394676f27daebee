"""Tokens (and the log-probabilities asked for) from a step's logits: the one path the plain engine
step and the speculative verifier share.

A row's distribution is ``Sampler.probs(adjust_logits(logits, rows))``: the request's adjustments
(``logits_processor.py``) with its history at that row and the grammar's mask there, then
temperature, min-p, top-k and top-p. Plain steps sample one row per sequence (``sample``); a
verify asks for the distributions (``distributions``) or adjusted argmaxes of every draft
position, each with the drafts before it as history (``continuations``).

Rows of a sequence that asked for ``prompt_logprobs`` score the prompt tokens they predict
(``score_prompt``); logprobs are of the raw logits (``logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .logits_processor import LogitsRow, adjust_logits
from .logprobs import TokenLogprob, token_logprobs
from .request_state import RequestState
from .sampler import Sampler
from .scheduler import ScheduledSeq
from .sequence import Sequence


@dataclass(frozen=True)
class Pick:
    """One sequence's result of a step: new tokens, their logprobs (when asked), prompt logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]


class TokenSampler:
    def __init__(self, sampler: Sampler, eos_ids: frozenset[int]) -> None:
        self.sampler = sampler
        self.eos_ids = eos_ids

    def rows(self, seq: Sequence, state: RequestState, continuations: Seq[Seq[int]]) -> list[LogitsRow]:
        """One row per continuation: the sequence's outputs followed by those tokens (a draft path)."""
        masks = (state.grammar.allowed_after(continuations) if state.grammar is not None
                 else [None] * len(continuations))
        # used at once (adjust_logits), so a row with no continuation may share the sequence's list
        return [LogitsRow(seq.params, seq.prompt_ids, [*seq.output_ids, *c] if c else seq.output_ids, self.eos_ids, m)
                for c, m in zip(continuations, masks)]

    @staticmethod
    def adjusts(seq: Sequence, state: RequestState) -> bool:
        """Whether ``adjusted`` may change any of the sequence's rows (its parameters or its grammar); if not,
        the raw logits' argmax is the greedy choice."""
        return state.grammar is not None or seq.params.adjusts_logits

    def adjusted(self, logits: torch.Tensor, seq: Sequence, state: RequestState,
                 continuations: Seq[Seq[int]]) -> torch.Tensor:
        """logits: [k, vocab] raw, row i after ``continuations[i]`` -> [k, vocab] float32 adjusted"""
        return adjust_logits(logits, self.rows(seq, state, continuations))

    def distributions(self, logits: torch.Tensor, seq: Sequence, state: RequestState,
                      continuations: Seq[Seq[int]]) -> torch.Tensor:
        """What each row samples from. logits: [k, vocab] raw -> [k, vocab] float32"""
        return self.sampler.probs(self.adjusted(logits, seq, state, continuations), [seq.params] * len(continuations))

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence], states: Seq[RequestState]) -> list[int]:
        """One token per sequence, after its outputs. logits: [n, vocab] raw -> n token ids"""
        return [int(t) for t in self.draw(logits, seqs, states).tolist()]

    def draw(self, logits: torch.Tensor, seqs: Seq[Sequence], states: Seq[RequestState]) -> torch.Tensor:
        """``sample`` left on the device: [n] int64 (requests whose params ``samples_on_device``)."""
        rows = [r for s, st in zip(seqs, states) for r in self.rows(s, st, [()])]
        adjusted = adjust_logits(logits, rows) if any(r.needs_adjusting for r in rows) else logits
        return self.sampler.draw(adjusted, [s.params for s in seqs], [st.generator for st in states])

    def pick(self, logits: torch.Tensor, entries: Seq[tuple[ScheduledSeq, Sequence, RequestState]],
             first_rows: Seq[int]) -> list[Pick]:
        """Plain (not verified) entries: each entry's logits rows start at ``first_rows[i]`` of ``logits``;
        an entry whose chunk reaches its last known token samples its last row; every row may score
        the prompt token it predicts. logits: [rows, vocab] raw -> one Pick per entry"""
        sampling = [i for i, (e, s, _) in enumerate(entries) if e.num_logits and e.context_len == s.num_tokens]
        last = [first_rows[i] + entries[i][0].num_logits - 1 for i in sampling]
        last_rows = logits if last == list(range(logits.shape[0])) else logits[last]  # a decode step: every row
        tokens = self.sample(last_rows, [entries[i][1] for i in sampling], [entries[i][2] for i in sampling])
        sampled = dict(zip(sampling, tokens))
        picks = []
        for i, (e, seq, state) in enumerate(entries):
            rows = logits[first_rows[i]: first_rows[i] + e.num_logits]
            prompt = self.score_prompt(rows, e.context_len - e.num_logits + 1, seq, state) if e.num_logits else []
            new = [sampled[i]] if i in sampled else []
            picks.append(Pick(new, self.logprobs(rows[-1:], seq, new) if new else [], prompt))
        return picks

    @staticmethod
    def logprobs(logits: torch.Tensor, seq: Sequence, tokens: list[int]) -> list[TokenLogprob]:
        """The chosen tokens' logprobs when the request asked (else []). logits: [len(tokens), vocab] raw"""
        n = seq.params.logprobs
        return [] if n is None else token_logprobs(logits, tokens, n)

    @staticmethod
    def score_prompt(logits: torch.Tensor, first: int, seq: Sequence, state: RequestState) -> list[TokenLogprob]:
        """Prompt logprobs of the rows that predict prompt tokens not yet scored. logits: [k, vocab], row r
        predicting token ``first + r`` of the sequence."""
        n = seq.params.prompt_logprobs
        if n is None:
            return []
        lo, hi = max(first, state.prompt_scored), min(first + logits.shape[0], seq.num_prompt_tokens)
        if lo >= hi:
            return []
        state.prompt_scored = hi
        return token_logprobs(logits[lo - first: hi - first], list(seq.prompt_ids[lo:hi]), n)
