"""What the engine keeps per request beside its ``Sequence``: text, randomness, grammar, prompt scoring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarState


@dataclass
class RequestState:
    seq_id: int
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None  # the request's own random stream (seeded requests)
    grammar: GrammarState | None = None  # structured output: the matcher at the committed tokens
    prompt_scored: int = 1  # prompt tokens [1, prompt_scored) had their logprobs sent (prompt_logprobs)
