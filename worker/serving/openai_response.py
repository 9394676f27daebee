"""Response bodies and stream chunks of the completions and chat APIs (pure: choices and token texts
in, JSON values out). ``Choice`` accumulates one sequence's outputs; ``CompletionShape`` and
``ChatShape`` lay them out, with logprobs (``logprobs_format.py``) and, for completions,
``echo`` (the prompt's text, and its logprobs first, before the output's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.logprobs import TokenLogprob
from ..engine.outputs import RequestOutput
from .logprobs_format import chat_logprobs, completion_logprobs, prompt_logprobs, token_ids_of

Texts = Mapping[int, str]


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # a stream sent its first content chunk (echo goes in it)

    def apply(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.prompt_tokens = out.num_prompt_tokens
        self.completion_tokens = out.num_output_tokens
        self.logprobs += out.logprobs
        self.prompt_logprobs += out.prompt_logprobs
        if out.finished and out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value


def usage(choices: list[Choice], n: int) -> dict[str, int]:
    """Each prompt counts once (not once per choice); every choice's tokens count."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def ids_needing_text(logprobs: list[TokenLogprob], prompt: list[TokenLogprob], first: int | None) -> list[int]:
    return sorted(set(token_ids_of([*logprobs, *prompt])) | ({first} if first is not None else set()))


@dataclass(frozen=True)
class CompletionShape:
    rid: str
    created: int
    model: str
    n: int
    logprobs: int | None  # the request's top-n, None = no logprobs
    echo: bool
    prompt_texts: list[str]  # per prompt (echo)
    prompt_ids: list[list[int]]
    prompt_logprobs: bool  # vLLM's extension: the choice carries "prompt_logprobs"

    def first_token(self, index: int) -> int | None:
        return self.prompt_ids[index // self.n][0] if self.echo else None

    def needs(self, c: Choice, index: int) -> list[int]:
        return ids_needing_text(c.logprobs, c.prompt_logprobs, self.first_token(index))

    def _logprobs(self, index: int, prompt: list[TokenLogprob], out: list[TokenLogprob], texts: Texts,
                  echoed: bool) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if echoed:
            return completion_logprobs([*prompt, *out], texts, first_token=self.first_token(index))
        return completion_logprobs(out, texts)

    def _choice(self, index: int, text: str, logprobs: dict[str, Any] | None, reason: str | None,
                prompt: list[TokenLogprob], texts: Texts) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if self.prompt_logprobs and prompt:
            out["prompt_logprobs"] = prompt_logprobs(prompt, texts)
        return out

    def body(self, choices: list[Choice], texts: Texts) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [self._choice(i, (self.prompt_texts[i // self.n] if self.echo else "") + c.text,
                                         self._logprobs(i, c.prompt_logprobs, c.logprobs, texts, self.echo),
                                         c.finish_reason, c.prompt_logprobs, texts)
                            for i, c in enumerate(choices)],
                "usage": usage(choices, self.n)}

    def chunk(self, index: int, c: Choice, out: RequestOutput, reason: str | None, texts: Texts) -> dict[str, Any]:
        """The stream chunk of one output; the choice's first one carries the echo."""
        echoed = self.echo and not c.started
        text = (self.prompt_texts[index // self.n] if echoed else "") + out.text_delta
        prompt = c.prompt_logprobs if not c.started else []
        c.started = True
        choice = self._choice(index, text, self._logprobs(index, prompt, list(out.logprobs), texts, echoed),
                              reason, prompt, texts)
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def chunk_needs(self, index: int, c: Choice, out: RequestOutput) -> list[int]:
        first = self.first_token(index) if not c.started else None
        return ids_needing_text(list(out.logprobs), c.prompt_logprobs if not c.started else [], first)


@dataclass(frozen=True)
class ChatShape:
    rid: str
    created: int
    model: str
    n: int
    logprobs: bool
    prompt_logprobs: bool

    def needs(self, c: Choice, _index: int) -> list[int]:
        return ids_needing_text(c.logprobs if self.logprobs else [], c.prompt_logprobs, None)

    def body(self, choices: list[Choice], texts: Texts) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(c.logprobs, texts) if self.logprobs else None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": usage(choices, self.n)}
        if self.prompt_logprobs and choices:
            out["prompt_logprobs"] = prompt_logprobs(choices[0].prompt_logprobs, texts)
        return out

    def opening(self, index: int) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, c: Choice, out: RequestOutput, reason: str | None, texts: Texts) -> dict[str, Any]:
        c.started = True
        delta = {"content": out.text_delta} if out.text_delta else {}
        logprobs = chat_logprobs(list(out.logprobs), texts) if self.logprobs else None
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def chunk_needs(self, _index: int, _c: Choice, out: RequestOutput) -> list[int]:
        return ids_needing_text(list(out.logprobs) if self.logprobs else [], [], None)
