"""Prompts to token ids in the HTTP process: off its event loop, off the engine thread, with a cap.

The engine thread only schedules and steps; a 20 MB prompt tokenised there once stalled every other
request for half a minute. Here texts are encoded (and chat templates rendered) on two threads,
each with its own tokenizer (a fast tokenizer must not be shared between threads): texts up to
``SHORT_CHARS`` characters on one, longer ones on the other, so a long prompt never delays a
short one. The tokenizer releases the GIL while it encodes, so the event loop keeps serving.
A text that has more than ``max_model_len`` tokens whatever the tokenizer does (longer than
``max_model_len`` x the longest token x slack, ``request_limits.check_text_length``) is refused
before it is tokenised; every other one is tokenised and its count checked.

    tokens = PromptTokenizer(client.load_tokenizer)
    ids = await tokens.prompt_ids("def fib(n):", max_model_len=4096)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..engine.tokenizer import Tokenizer, TokenizerError
from .api_error import ApiError
from .request_limits import check_prompt_tokens, check_text_length

T = TypeVar("T")

SHORT_CHARS = 1 << 16


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token can stand for (its vocabulary string is at least as long)."""
    return max((len(t) for t in tokenizer.hf.get_vocab()), default=1)


def no_tokenizer(param: str) -> ApiError:
    return ApiError(400, "this server takes token ids only (the engine runs without a tokenizer)", param=param,
                    code="invalid_prompt")


class PromptTokenizer:
    def __init__(self, load: Callable[[], Tokenizer | None]) -> None:
        self._load = load
        self._local = threading.local()
        self._short = ThreadPoolExecutor(1, thread_name_prefix="fusedserve-tokenize-short")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="fusedserve-tokenize-long")
        self.longest_token_chars: int | None = None  # known once a tokenizer is loaded
        for lane in (self._short, self._long):  # load both now, in the background
            lane.submit(self._tokenizer)

    def close(self) -> None:
        for lane in (self._short, self._long):
            lane.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self) -> Tokenizer | None:
        """This lane thread's own tokenizer."""
        if not hasattr(self._local, "tokenizer"):
            tokenizer = self._load()
            if tokenizer is not None and self.longest_token_chars is None:
                self.longest_token_chars = longest_token_chars(tokenizer)
            self._local.tokenizer = tokenizer
        tok: Tokenizer | None = self._local.tokenizer
        return tok

    async def _on_lane(self, chars: int, fn: Callable[[Tokenizer], T], param: str, max_model_len: int | None) -> T:
        check_text_length(chars, max_model_len, self.longest_token_chars, param)

        def work() -> T:
            tokenizer = self._tokenizer()
            if tokenizer is None:
                raise no_tokenizer(param)
            check_text_length(chars, max_model_len, self.longest_token_chars, param)
            return fn(tokenizer)

        lane = self._short if chars <= SHORT_CHARS else self._long
        return await asyncio.wrap_future(lane.submit(work))

    async def prompt_ids(self, prompt: str | list[int], max_model_len: int | None, param: str = "prompt"
                         ) -> list[int]:
        """Token ids of a completion prompt (text or ids); 400 when it does not fit the context."""
        if isinstance(prompt, str):
            ids = await self._on_lane(len(prompt), lambda t: t.encode(prompt), param, max_model_len)
        else:
            ids = list(prompt)
        if not ids:
            raise ApiError(400, "the prompt has no tokens", param=param, code="invalid_prompt")
        check_prompt_tokens(len(ids), max_model_len, param)
        return ids

    async def chat_ids(self, messages: list[dict[str, str]], max_model_len: int | None) -> list[int]:
        """Token ids of a conversation rendered with the checkpoint's chat template."""
        def render(t: Tokenizer) -> list[int]:
            try:
                text = t.apply_chat_template(messages)
            except TokenizerError as e:
                raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
            return t.encode(text)

        chars = sum(len(m.get("content") or "") for m in messages)
        ids = await self._on_lane(chars, render, "messages", max_model_len)
        check_prompt_tokens(len(ids), max_model_len, "messages")
        return ids

    async def on_lane(self, fn: Callable[[Tokenizer], T], param: str, chars: int = 0) -> T:
        """Run ``fn`` with this process's tokenizer (400 naming ``param`` when there is none)."""
        return await self._on_lane(chars, fn, param, None)

    async def token_texts(self, ids: list[int]) -> dict[int, str]:
        """Each token's own text (its decoding alone); ``token_id:<id>`` without a tokenizer."""
        if not ids:
            return {}
        try:
            return await self.on_lane(lambda t: {i: t.decode([i], skip_special_tokens=False) for i in ids}, "logprobs")
        except ApiError:
            return {i: f"token_id:{i}" for i in ids}

    async def decode(self, ids: list[int], skip_special_tokens: bool = True, param: str = "tokens") -> str:
        return await self.on_lane(lambda t: t.decode(ids, skip_special_tokens=skip_special_tokens), param)
