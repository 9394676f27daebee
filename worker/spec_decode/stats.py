"""Speculative-decoding acceptance counters, vLLM's convention (``SpecDecodingStats``).

Per verify step of one sequence: ``drafts`` += 1, ``draft_tokens`` += the drafts it proposed
(tree nodes other than the root), ``accepted_tokens`` += the drafts the target accepted (the
bonus token not counted), ``accepted_per_position[i]`` += 1 when at least i + 1 were accepted,
and ``accepted_per_step[k]`` += 1 for a step that accepted k (a histogram's counts).

Mean acceptance length = 1 + accepted_tokens / drafts (tokens gained per verify, bonus
included: sglang's ``spec_accept_length``); acceptance rate = accepted_tokens / draft_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [max draft depth]
    accepted_per_step: tuple[int, ...]  # [max draft depth + 1]: verify steps that accepted k drafts

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "accepted_per_step": list(self.accepted_per_step),
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
        }


class SpecDecodeCounters:
    """Running totals since the engine started; ``snapshot`` reads them."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.per_position = [0] * max_depth
        self.per_step = [0] * (max_depth + 1)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verify step."""
        if not 0 <= num_accepted <= min(num_draft_tokens, self.max_depth):
            raise ValueError(f"{num_accepted} accepted of {num_draft_tokens} drafts (max depth {self.max_depth})")
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.per_position[i] += 1
        self.per_step[num_accepted] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.drafts, self.draft_tokens, self.accepted_tokens, tuple(self.per_position),
                               tuple(self.per_step))
