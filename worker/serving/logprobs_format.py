"""Log-probabilities in the OpenAI API's shapes (pure: entries and token texts in, JSON values out).

Completions (``logprobs``: n): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
the prompt's tokens first with ``echo`` (its first token has ``None``: nothing predicts it).
Chat (``logprobs``: true, ``top_logprobs``: n): ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``. A token's text is the
tokenizer's decoding of that one token (vLLM's choice); without a tokenizer it is
``token_id:<id>``. ``prompt_logprobs`` (vLLM's extension) is vLLM's list: ``None`` for the first
prompt token, then ``{id: {"logprob", "rank", "decoded_token"}}`` (the token and the n best).

    texts = await tokens.token_texts(token_ids_of(entries))
    body["logprobs"] = completion_logprobs(entries, texts)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.logprobs import TokenLogprob

Entry = TokenLogprob | None


def token_ids_of(entries: Sequence[Entry]) -> list[int]:
    """Every token id whose text the entries need (chosen and alternatives)."""
    ids: set[int] = set()
    for e in entries:
        if e is not None:
            ids.add(e.token_id)
            ids.update(t for t, _ in e.top)
    return sorted(ids)


def _lp(value: float) -> float:
    return max(value, -9999.0) if not math.isnan(value) else -9999.0  # JSON has no -inf (OpenAI caps it too)


def completion_logprobs(entries: Sequence[Entry], texts: Mapping[int, str], first_offset: int = 0,
                        first_token: int | None = None) -> dict[str, Any]:
    """``first_token``: the id of a leading prompt token without an entry (echo: the prompt's first)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = first_offset
    if first_token is not None:
        tokens.append(texts[first_token])
        token_logprobs.append(None)
        top.append(None)
        offsets.append(offset)
        offset += len(tokens[-1])
    for e in entries:
        if e is None:
            continue
        text = texts[e.token_id]
        tokens.append(text)
        token_logprobs.append(_lp(e.logprob))
        alternatives = {texts[t]: _lp(v) for t, v in e.top}
        alternatives.setdefault(text, _lp(e.logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str]) -> dict[str, Any]:
    return {"content": [{**_chat_token(texts[e.token_id], e.logprob),
                         "top_logprobs": [_chat_token(texts[t], v) for t, v in e.top]} for e in entries],
            "refusal": None}


def prompt_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        ranked = {t: i + 1 for i, (t, _) in enumerate(e.top)}
        one = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": texts[e.token_id]}}
        for t, v in e.top:
            one.setdefault(str(t), {"logprob": _lp(v), "rank": ranked[t], "decoded_token": texts[t]})
        out.append(one)
    return out
