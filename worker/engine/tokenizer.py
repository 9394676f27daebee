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


class Tokenizer:
    def __init__(self, hf: Any, extra_eos_ids: frozenset[int] = frozenset()) -> None:
        self.hf = hf
        eos = _ids(hf.eos_token_id) | set(extra_eos_ids)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.special_ids: frozenset[int] = frozenset(hf.all_special_ids)

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
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

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
