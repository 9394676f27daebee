"""What one request may ask for, checked before it reaches an engine (pure: a value or ``ApiError`` 400).

As vLLM does: a prompt must leave room for one generated token, an explicit ``max_tokens`` must
fit in what the prompt leaves of the context, and without one a request generates at most to the
end of the context. On top: a request runs at most ``max_sequences_per_request`` sequences
(prompts x n), and a text longer than any tokenization of ``max_model_len`` tokens could be is
refused without being tokenised.
"""

from __future__ import annotations

from .api_error import ApiError

# A normalizer (NFC, NFKC) may shorten a text before it is tokenised; this much slack keeps the
# bound a bound (no real prompt within the context comes near it).
NORMALIZER_SLACK = 4


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    total = num_prompts * n
    if total > limit:
        raise ApiError(400, f"{num_prompts} prompt(s) x n={n} = {total} sequences; this server runs at most {limit} "
                            "per request (spec.serving.maxSequencesPerRequest)",
                       param="n" if num_prompts == 1 else "prompt", code="too_many_sequences")


def context_exceeded(max_model_len: int, detail: str, param: str) -> ApiError:
    return ApiError(400, f"this model's maximum context length (max_model_len) is {max_model_len} tokens; {detail}",
                    param=param, code="context_length_exceeded")


def check_text_length(chars: int, max_model_len: int | None, longest_token_chars: int | None, param: str) -> None:
    """Refuse a text that has more than ``max_model_len`` tokens whatever the tokenizer does: no token
    covers more than ``longest_token_chars`` characters."""
    if max_model_len is None or not longest_token_chars:
        return
    bound = max_model_len * longest_token_chars * NORMALIZER_SLACK
    if chars > bound:
        raise context_exceeded(max_model_len, f"a prompt of {chars} characters is longer than that "
                                              f"(refused above {bound} characters without tokenising)", param)


def check_prompt_tokens(num_tokens: int, max_model_len: int | None, param: str) -> None:
    if max_model_len is not None and num_tokens >= max_model_len:
        raise context_exceeded(max_model_len, f"the prompt has {num_tokens} tokens, which leaves no room to "
                                              "generate; shorten the prompt", param)


def max_tokens_for(prompt_tokens: int, requested: int | None, default: int | None, max_model_len: int | None,
                   param: str = "max_tokens", unlimited: int = 2**31 - 1) -> int:
    """The tokens one sequence may generate: ``requested`` if it fits (400 otherwise), else ``default``,
    capped by what the prompt leaves of the context."""
    if max_model_len is None:  # no engine to ask: it refuses what does not fit
        return requested if requested is not None else default if default is not None else unlimited
    room = max_model_len - prompt_tokens
    if requested is not None:
        if requested > room:
            raise context_exceeded(max_model_len, f"{param}={requested} is too large for a prompt of {prompt_tokens} "
                                                  f"tokens: at most {room} ({max_model_len} - {prompt_tokens})", param)
        return requested
    return room if default is None else min(default, room)
