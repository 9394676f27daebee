"""The OpenAI API's request bodies (pydantic) and what they mean for the engine.

Supported: ``model``, ``prompt`` (a string, token ids, or a batch of either) or ``messages``,
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``n``,
``stop`` (a string or a list), ``stream`` with ``stream_options.include_usage``, plus the
vLLM-style extensions ``top_k``, ``ignore_eos`` and ``stop_token_ids``. ``n > 1`` runs n
requests; with a seed, choice i uses ``seed + i`` (choice 0 equals the same request with n=1).

Refused with a 400 naming the parameter: ``echo``, ``logprobs`` / ``top_logprobs``,
``suffix``, ``best_of`` > 1, non-zero penalties, ``logit_bias``, tools, non-text
``response_format``, non-text message parts. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sequence import SamplingParams
from .api_error import ApiError

MAX_N = 64
SEED_MODULUS = 2**63


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def check(self) -> None:
        """Refuse what the server does not do (ApiError 400)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, f"a non-zero {name}")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
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
        )


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise unsupported("echo", "echo")
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs")
        if self.suffix:
            raise unsupported("suffix", "suffix")
        if self.best_of is not None and self.best_of > 1:
            raise unsupported("best_of", "best_of > 1")

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

    def text(self, index: int) -> str:
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


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs:
            raise unsupported("logprobs", "logprobs")
        if self.top_logprobs is not None:
            raise unsupported("top_logprobs", "top_logprobs")
        if self.tools:
            raise unsupported("tools", "tool calling")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", f"response_format {self.response_format.get('type')!r}")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
