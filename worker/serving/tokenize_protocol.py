"""vLLM's ``/tokenize`` and ``/detokenize`` bodies.

``POST /tokenize`` ``{"model", "prompt", "add_special_tokens": true, "return_token_strs": false}``
or ``{"model", "messages", "add_generation_prompt": true, "return_token_strs": false}`` ->
``{"count", "max_model_len", "tokens", "token_strs"}``; ``POST /detokenize`` ``{"model", "tokens"}``
-> ``{"prompt"}``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .openai_protocol import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages or [])]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(default_factory=list)
