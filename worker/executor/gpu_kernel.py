"""A Triton fast path looked up once, where the hardware runs it: the one place the spec-decode and sampling
code asks "CUDA, and does the kernel's module import?" (Triton absent: the caller keeps its torch reference).

    accept = gpu_kernel(device, "fusedserve.worker.spec_decode.chain_accept_triton", "accept_chains_triton")
    accept = accept or accept_chains_at_temperature
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


def gpu_kernel(device: torch.device | str, module: str, name: str) -> Any | None:
    """``module.name`` (a Triton kernel's wrapper) on a CUDA device where the module imports, else None."""
    if torch.device(device).type != "cuda":
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None
