"""Architecture name (config.json "architectures") -> model class, imported on demand."""

from __future__ import annotations

import importlib
from typing import Any

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "fusedserve.models.llama:LlamaForCausalLM",
    "NemotronHForCausalLM": "fusedserve.models.nemotron_h:NemotronHForCausalLM",
    "DeepseekV3ForCausalLM": "fusedserve.models.deepseek_v3:DeepseekV3ForCausalLM",  # also Kimi-K2
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(architecture: str) -> Any:
    target = ARCHITECTURES.get(architecture)
    if target is None:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
