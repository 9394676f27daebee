"""What the engine hands back: per-step deltas for streaming, and whole completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .logprobs import TokenLogprob
from .sequence import FinishReason


class RequestTimes(NamedTuple):
    """A finished request's phases in seconds (vLLM's): waiting to be first scheduled, from then to the
    first token (prefill), from the first token to the last (decode)."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one engine step (a streaming chunk).

    ``text_delta`` is "" when the engine runs without a tokenizer, or while a character or a
    possible stop string is incomplete. A finished request's last output has ``finished`` set
    and a ``finish_reason`` ("stop", "length" or "abort"); an aborted request gets one such
    output with no new tokens.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, including new_token_ids
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (in order, over the first outputs)
    times: RequestTimes | None = None  # on a finished request's last output (not an abort's)
    # seconds between this request's consecutive steps that produced tokens, when outputs were merged before
    # they were delivered (a final-only request's one output): what a consumer would have seen as gaps
    gaps: tuple[float, ...] = ()


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (tokens and text in order; the last one's state)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return RequestOutput(last.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs),
                         last.finished, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                         tuple(lp for o in outs for lp in o.logprobs),
                         tuple(lp for o in outs for lp in o.prompt_logprobs), last.times,
                         tuple(g for o in outs for g in o.gaps))


@dataclass
class Completion:
    """A whole request's result (``Engine.generate``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asked for them
