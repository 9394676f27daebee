"""Tiny random HuggingFace checkpoints (fp32) for tests, demos and `fusedserve verify`.

Made with transformers' own classes and ``save_pretrained``, so the oracle is nobody's code
but HuggingFace's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=250,  # deliberately not a multiple of 64: exercises vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**LLAMA_DEFAULTS, **overrides})
    model = LlamaForCausalLM(config).to(torch.float32)
    # HF initialises norms to ones; random weights make a wrong norm visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
