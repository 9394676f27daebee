"""What the engine keeps per request beside its ``Sequence``: text, randomness, grammar, prompt scoring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarState
from .outputs import RequestTimes


@dataclass
class RequestState:
    seq_id: int
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None  # the request's own random stream (seeded requests)
    grammar: GrammarState | None = None  # structured output: the matcher at the committed tokens
    prompt_scored: int = 1  # prompt tokens [1, prompt_scored) had their logprobs sent (prompt_logprobs)
    # monotonic seconds: queued, first scheduled, first token (vLLM's queue / prefill / decode phases)
    queued_at: float = 0.0
    scheduled_at: float | None = None
    first_token_at: float | None = None

    def times(self, now: float) -> RequestTimes:
        scheduled = self.scheduled_at if self.scheduled_at is not None else now
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestTimes(scheduled - self.queued_at, first - scheduled, now - first)
