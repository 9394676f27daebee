"""One request as the engine tracks it: its tokens, how it samples, where it stands.

A ``Sequence`` is pure bookkeeping (no torch). Its tokens are the prompt followed by the
outputs; ``num_computed`` of them have their K/V in the cache. The last known token is never
computed before the step that feeds it, so a running sequence always has at least one token
to feed. Preemption by recompute sets ``num_computed`` back to 0: the prompt and everything
generated so far are prefilled again, and nothing already generated is sampled twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request that can never be served (empty or too long prompt, bad parameters)."""


class InvalidSamplingParams(InvalidRequest):
    """A request's sampling parameters are invalid; the message says which and why."""


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the OpenAI API's ``finish_reason`` values)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's maximum length
    ABORT = "abort"  # the client went away or the request was cancelled


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's meaning for each field).

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 keep every token.
    ``seed`` gives the request its own random stream, so its tokens do not depend on which other
    requests share its batches. Stop strings are never part of the returned text.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a single stop string, store tuples (the value is frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature:
            raise InvalidSamplingParams(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 (all tokens) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidSamplingParams(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise InvalidSamplingParams(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_none(self) -> int | None:
        """The number of tokens top-k keeps; None = all."""
        return self.top_k if self.top_k > 0 else None


@dataclass
class Sequence:
    """A request's state. ``seq_id`` increases with arrival: a lower id arrived earlier."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    state_slot: int | None = None  # recurrent-state slot (Mamba layers) while running
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequest(f"request {self.request_id}: the prompt has no tokens")

    @property
    def arrival(self) -> int:
        return self.seq_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens not yet in the cache (the whole prompt when fresh, 1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of prompt + outputs."""
        p = len(self.prompt_ids)
        return (self.prompt_ids[start:min(end, p)] if start < p else []) + \
            self.output_ids[max(start - p, 0):max(end - p, 0)]


def truncate_at_stop(seq: Sequence, new_tokens: list[int], eos_token_ids: frozenset[int],
                     max_model_len: int) -> tuple[list[int], FinishReason | None]:
    """The new tokens ``seq`` keeps, and why it finishes (None = it goes on).

    Token-level stops only (EOS unless ``ignore_eos``, stop token ids, ``max_tokens``, the model's
    maximum length); stop strings need text and are the detokenizer's. A stopping token is kept,
    as in vLLM; tokens after it (e.g. the rest of an accepted speculative run) are dropped.
    """
    params = seq.params
    kept: list[int] = []
    for token in new_tokens:
        kept.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return kept, FinishReason.STOP
        if seq.num_output_tokens + len(kept) >= params.max_tokens:
            return kept, FinishReason.LENGTH
        if seq.num_tokens + len(kept) >= max_model_len:
            return kept, FinishReason.LENGTH
    return kept, None
