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


MAX_LOGPROBS = 20  # the most alternatives per token (OpenAI's top_logprobs limit)
# An output token sampled on the device and not yet read back (an overlapped step: ``inflight_step.py``);
# the engine writes the real id over it before anything reads the value.
PLACEHOLDER = -1


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: ``kind`` "json_object" (any JSON object) or "json_schema" (``schema``:
    the JSON schema as text). Compiled by the engine once per request (``grammar.py``)."""

    kind: str
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema"):
            raise InvalidSamplingParams(f"grammar kind must be json_object or json_schema, got {self.kind!r}")
        if self.kind == "json_schema" and not self.schema:
            raise InvalidSamplingParams("a json_schema grammar needs a schema")


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

    Logits adjustments (``logits_processor.py``, before temperature): ``min_tokens`` masks EOS and
    ``stop_token_ids`` until that many tokens were generated; ``logit_bias`` ((token id, bias)
    pairs) is added; ``repetition_penalty`` (> 0, 1 = off) divides positive and multiplies
    negative logits of every token in the prompt or the output; ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]) subtract count x penalty and penalty for output tokens;
    ``grammar`` (structured output) masks tokens the grammar does not allow. After temperature:
    ``min_p`` drops tokens whose probability is below min_p x the top token's.

    ``logprobs``: per generated token, its log-probability and the ``logprobs`` most likely tokens'
    (0 = the token's own only); ``prompt_logprobs`` the same for every prompt token after the
    first. Log-probabilities are of the model's raw distribution (``log_softmax`` of the logits
    before any adjustment), vLLM's default.
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
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a single stop string, store tuples (the value is frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if isinstance(self.grammar, (dict, list, tuple)):  # across a process boundary (asdict)
            g = self.grammar
            object.__setattr__(self, "grammar", GrammarSpec(**g) if isinstance(g, dict) else GrammarSpec(*g))
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature:
            raise InvalidSamplingParams(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 (all tokens) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise InvalidSamplingParams(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise InvalidSamplingParams(f"stop_token_ids must be non-negative integers, got {t!r}")
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens:
            raise InvalidSamplingParams(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                        f"({self.max_tokens})")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidSamplingParams(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidSamplingParams(f"logit_bias must map token ids >= 0 to biases in [-100, 100], "
                                            f"got {token}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidSamplingParams(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any adjustment before temperature applies (the grammar aside)."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def samples_on_device(self) -> bool:
        """Whether a step's token can be drawn without reading anything back: no logprobs, no grammar, no
        adjustment that reads the output history (``min_tokens`` reads only its length)."""
        return (self.logprobs is None and self.prompt_logprobs is None and self.grammar is None
                and not (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def temperature_only(self) -> bool:
        """Whether the distribution drawn from is the softmax at the temperature alone (no min-p, top-k, top-p)."""
        return self.min_p == 0.0 and self.top_k_or_none is None and self.top_p >= 1.0

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
                     max_model_len: int, num_before: int | None = None) -> tuple[list[int], FinishReason | None]:
    """The new tokens ``seq`` keeps, and why it finishes (None = it goes on). ``num_before``: the
    outputs before the new tokens (default: all of ``seq.output_ids``; an overlapped step's tokens
    are already in them, as placeholders).

    Token-level stops only (EOS unless ``ignore_eos``, stop token ids, ``max_tokens``, the model's
    maximum length); stop strings need text and are the detokenizer's. A stopping token is kept,
    as in vLLM; tokens after it (e.g. the rest of an accepted speculative run) are dropped.
    """
    params = seq.params
    before = seq.num_output_tokens if num_before is None else num_before
    total = seq.num_prompt_tokens + before
    kept: list[int] = []
    for token in new_tokens:
        kept.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return kept, FinishReason.STOP
        if before + len(kept) >= params.max_tokens:
            return kept, FinishReason.LENGTH
        if total + len(kept) >= max_model_len:
            return kept, FinishReason.LENGTH
    return kept, None
