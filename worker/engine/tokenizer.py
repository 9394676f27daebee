"""The checkpoint's tokenizer and chat template (``tokenizer.json`` + ``tokenizer_config.json``,
the template in ``chat_template.jinja`` where transformers 5 writes it, else in ``tokenizer_config.json``).

A thin wrapper over transformers' fast tokenizer, loaded from the checkpoint directory only
(never the network). It knows the end-of-sequence ids of the checkpoint: the tokenizer's EOS
token plus every ``eos_token_id`` in ``generation_config.json`` (a list in Llama-3 style
checkpoints, where the chat turn ends with a token that is not the tokenizer's EOS).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(RuntimeError):
    """The checkpoint's tokenizer is missing or cannot be loaded; the message says what to do."""


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def generation_eos_ids(model_dir: str | Path) -> frozenset[int]:
    """``eos_token_id`` of ``generation_config.json`` (an int or a list); empty if none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return frozenset()
    try:
        return frozenset(_ids(json.loads(path.read_text()).get("eos_token_id")))
    except (json.JSONDecodeError, AttributeError) as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from e


# Text that transformers' clean-up of tokenization spaces would change (" ." -> ".", " n't" -> "n't", ...): where a
# fast tokenizer's own decode gives back what transformers' decode gives for it, no clean-up runs after it.
CLEANUP_PROBE = "a . b , c ? d ! e ' f n't g 'm h 's i 've j 're k"


class Tokenizer:
    def __init__(self, hf: Any, extra_eos_ids: frozenset[int] = frozenset()) -> None:
        self.hf = hf
        eos = _ids(hf.eos_token_id) | set(extra_eos_ids)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.special_ids: frozenset[int] = frozenset(hf.all_special_ids)
        self._decode: Callable[..., str] = _direct_decode(hf) or hf.decode

    @staticmethod
    def from_dir(model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir)
        if not path.is_dir():
            raise TokenizerError(f"{path}: not a directory")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise TokenizerError(
                f"{path}: the checkpoint has no tokenizer (expected {' or '.join(TOKENIZER_FILES)}, "
                "with tokenizer_config.json); copy the tokenizer files into the checkpoint directory, "
                "or send token ids and run the engine with skip_tokenizer")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as auto_error:  # transformers raises many kinds here
            if not (path / "tokenizer.json").is_file():
                raise TokenizerError(f"{path}: cannot load the tokenizer: {auto_error}") from auto_error
            log.warning("%s: AutoTokenizer failed (%s); loading tokenizer.json directly", path, auto_error)
            try:
                hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **_special_tokens(path))
            except Exception as e:
                raise TokenizerError(f"{path}/tokenizer.json: cannot load: {e}") from e
        return Tokenizer(hf, generation_eos_ids(path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        """transformers' decode of ``ids``; through the fast tokenizer's own decode where that gives the same
        text (``_direct_decode``): the streaming text decodes twice per pushed token, on the step's host path."""
        return str(self._decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation (OpenAI-style ``{"role", "content"}`` messages)."""
        if not self.has_chat_template:
            raise TokenizerError(f"the checkpoint has no chat_template (neither {CHAT_TEMPLATE_FILE} nor "
                                 "tokenizer_config.json holds one)")
        try:
            return str(self.hf.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt, **kwargs))
        except Exception as e:  # jinja2 errors, missing roles, raise_exception() in templates
            raise TokenizerError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of a conversation. The template writes BOS itself, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _direct_decode(hf: Any) -> Callable[..., str] | None:
    """The fast tokenizer's own ``decode`` (the Rust call transformers' decode makes, without its Python around
    it: ~1 against ~3 us a call), where transformers adds nothing after it: no clean-up of tokenization spaces
    (which transformers applies or skips by tokenizer kind and version), shown on ``CLEANUP_PROBE``, whose
    decoded text any clean-up would change. None where there is no fast tokenizer or a clean-up runs."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    try:
        ids = list(hf.encode(CLEANUP_PROBE, add_special_tokens=False))
        same = all(backend.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
                   for skip in (True, False))
    except Exception:  # a tokenizer that cannot encode or decode the probe: keep transformers' path
        return None
    return backend.decode if same else None


def _special_tokens(model_dir: Path) -> dict[str, Any]:
    """The fallback's keyword arguments: special tokens from ``tokenizer_config.json``, the chat
    template from ``chat_template.jinja`` (transformers 5) or else from ``tokenizer_config.json``."""
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    keys = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")
    out = {k: config[k] for k in keys if isinstance(config.get(k), str)}
    template = model_dir / CHAT_TEMPLATE_FILE
    if template.is_file():
        out["chat_template"] = template.read_text()
    return out
