"""The OpenAI API's request bodies (pydantic) and what they mean for the engine.

Every parameter of OpenAI's completions and chat completions APIs is either honoured or refused
with a 400 whose ``param`` names it (docs/serving.md has the table). Honoured: ``model``,
``prompt`` (a string, token ids, or a batch of either) / ``messages``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed`` (int64), ``n``, ``stop``,
``stream`` + ``stream_options.include_usage``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``logprobs`` (completions: top-n; chat: bool + ``top_logprobs``), ``echo``,
``response_format`` (text, json_object, json_schema), ``best_of`` = 1, ``tool_choice`` /
``function_call`` "none", ``store`` false, ``service_tier`` auto/default, ``modalities``
["text"], and the identifiers that change no output (``user``, ``metadata``,
``safety_identifier``, ``prompt_cache_key``, ``parallel_tool_calls``). vLLM's extensions:
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``return_tokens_as_token_ids``. Refused when set: ``suffix``, ``best_of`` > 1, tools
and functions, ``audio``, non-text ``modalities``, ``prediction``, ``reasoning_effort``,
``verbosity``, ``web_search_options``, ``store`` true, other service tiers, non-text message
parts. Fields unknown to the API are ignored with a logged warning, as vLLM does.

``n > 1`` runs n requests; with a seed, choice i uses ``seed + i`` (mod 2^64; choice 0 equals
the same request with n=1).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sequence import MAX_LOGPROBS, GrammarSpec, SamplingParams
from .api_error import ApiError
from .response_format import ResponseFormat

log = logging.getLogger(__name__)

MAX_N = 64
SEED_MODULUS = 2**64
INT64 = 2**63


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server ({param})", param=param,
                    code="unsupported_parameter")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"

    def check(self) -> None:
        """Refuse what the server does not do (ApiError 400); warn about fields unknown to the API."""
        if self.model_extra:
            log.warning("the request has fields unknown to the OpenAI API, ignored: %s", sorted(self.model_extra))
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        self.bias()

    def bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ApiError(400, f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {key}: {value}",
                               param="logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    def grammar(self) -> GrammarSpec | None:
        return None if self.response_format is None else self.response_format.grammar()

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def top_logprobs_n(self) -> int | None:
        """Alternatives per generated token (None = no logprobs)."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int, choice: int = 0, grammar: GrammarSpec | None = None
                        ) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (raises InvalidSamplingParams)."""
        seed = None if self.seed is None else (self.seed + choice) % SEED_MODULUS
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.bias(),
            logprobs=self.top_logprobs_n(),
            prompt_logprobs=self.prompt_logprobs_n(),
            grammar=grammar,
        )

    def prompt_logprobs_n(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if self.best_of is not None and self.best_of > 1:
            raise unsupported("best_of", "best_of > 1")

    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_n(self) -> int | None:
        """echo with logprobs scores the prompt with the same number of alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (a batch when ``prompt`` is a list of strings or of id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.tool_calls:
            raise unsupported(f"messages.{index}.tool_calls", "tool calling")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise unsupported(f"messages.{index}.content", f"content of type {part.type!r}")
            parts.append(part.text)
        return "".join(parts)


# Chat parameters refused whenever they are set to something other than "off" (None, [], False, ...).
_REFUSED_CHAT = {
    "tools": "tool calling", "functions": "function calling", "audio": "audio output",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning_effort (not a reasoning model)",
    "verbosity": "verbosity", "web_search_options": "web search",
}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check(self) -> None:
        super().check()
        for name, what in _REFUSED_CHAT.items():
            if getattr(self, name):
                raise unsupported(name, what)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name, f"{name} other than 'none'")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise unsupported("modalities", "output modalities other than text")
        if self.store:
            raise unsupported("store", "storing completions")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", f"service_tier {self.service_tier!r}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
