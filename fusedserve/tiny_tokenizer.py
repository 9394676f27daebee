"""A tiny byte-level BPE tokenizer with a chat template, trained offline in milliseconds.

For tests and demos: ``make_tiny_tokenizer(dir)`` writes ``tokenizer.json`` and
``tokenizer_config.json`` (with a chat template) into a checkpoint directory. Every byte is in
the vocabulary, so any text round-trips, and characters outside ASCII span several tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DEFAULT_CORPUS = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world!\n",
    "for i in range(10):\n    print(i, i * i)\n",
)


def make_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 300, corpus: tuple[str, ...] = DEFAULT_CORPUS,
                        chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens (>= 259) on ``corpus`` and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level vocabulary needs at least {256 + len(SPECIAL_TOKENS)} tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) * 8, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "unk_token": SPECIAL_TOKENS[2],
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
