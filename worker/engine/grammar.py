"""Structured output through xgrammar (the grammar library of vLLM and sglang).

``GrammarCompiler`` is built once per engine from the checkpoint's tokenizer; each request with a
``GrammarSpec`` gets its schema compiled once (xgrammar caches compiled schemas) and its own
``GrammarState``: a matcher at the request's committed tokens. ``allowed_after`` gives the token
masks after each of several continuations (a verify's draft paths), advancing the matcher over a
path and rolling it back, so the matcher itself only ever moves by ``accept`` of committed tokens.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    state = compiler.matcher(GrammarSpec("json_schema", '{"type": "object"}'))
    [mask] = state.allowed_after([()])  # [vocab] bool
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence as Seq
from typing import Any

import torch

from .sequence import GrammarSpec, InvalidRequest
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)
OBJECT_SCHEMA = '{"type": "object"}'


class InvalidGrammar(InvalidRequest):
    """A schema xgrammar cannot compile; the message says why."""


def check_schema(schema: str) -> None:
    """Raise InvalidGrammar if xgrammar cannot turn this JSON schema into a grammar (no tokenizer needed)."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except Exception as e:
        raise InvalidGrammar(f"the JSON schema cannot be used for structured output: {e}") from e


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [words] -> [vocab] bool (bit j of word i = token 32 i + j)."""
    return ((bitmask[:, None] >> _BITS) & 1).bool().flatten()[:vocab]


class GrammarState:
    """One request's matcher; the tokens it has accepted are the request's committed outputs."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab = vocab
        self._bitmask = xgr.allocate_token_bitmask(1, vocab)

    def _mask(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return _unpack(self._bitmask[0], self.vocab)

    def allowed_after(self, continuations: Seq[Seq[int]]) -> list[torch.Tensor | None]:
        """The allowed tokens after each continuation of the committed tokens ([vocab] bool); None for
        a continuation the grammar refuses (no row after it can be reached by an accepted token)."""
        out: list[torch.Tensor | None] = []
        for tokens in continuations:
            accepted = 0
            for t in tokens:
                if not self.matcher.accept_token(int(t)):
                    break
                accepted += 1
            out.append(self._mask() if accepted == len(tokens) else None)
            if accepted:
                self.matcher.rollback(accepted)
        return out

    def accept(self, tokens: Seq[int]) -> None:
        """Advance over committed tokens (each one was drawn under this matcher's mask)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                log.warning("grammar refused committed token %d (a token drawn outside its mask)", t)
                return


class GrammarCompiler:
    """``tokenizer`` None (an engine on token ids only): structured output is refused."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._compiler: Any = None

    def _get(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.hf, vocab_size=self.vocab_size,  # type: ignore[union-attr]
                                                      stop_token_ids=sorted(self.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one request (the schema compiled once; InvalidGrammar if it cannot be)."""
        import xgrammar as xgr

        if self.tokenizer is None:
            raise InvalidGrammar("structured output needs a tokenizer (the engine runs with skip_tokenizer)")
        compiler = self._get()
        try:
            # json_object: OpenAI's "a valid JSON object"; compact JSON (no free whitespace, which a weak model
            # could otherwise repeat until max_tokens)
            schema = OBJECT_SCHEMA if spec.kind == "json_object" else spec.schema or ""
            json.loads(schema)
            compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:
            raise InvalidGrammar(f"the JSON schema cannot be used for structured output: {e}") from e
        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size)
