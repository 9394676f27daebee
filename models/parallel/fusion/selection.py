"""The one decision about all-reduce + add + RMSNorm fusion, made once per rank and carried as one value.

``fusion_mode`` (pure) turns what a spec or the CLI asks for into a ``FusionMode``;
``fused_kernel`` builds that mode's kernel on this rank (for FlashInfer: the workspaces, with every
rank's vote, all ranks falling back to the reference together) or returns None when fusion is off.
The kernel goes into ``Collectives(fused=...)``, and a model's plan fuses exactly when it is there.

============  ================================================================================
requested     mode
============  ================================================================================
auto          FLASHINFER where it can run (CUDA SM90 / SM100 and importable), else OFF
on            FLASHINFER where it can run, else REFERENCE (all-reduce, then add, then RMSNorm)
off           OFF
reference     REFERENCE (CPU tests, ``fusedserve verify``)
flashinfer    FLASHINFER; an error where it cannot run
============  ================================================================================

Whatever is asked, tp = 1 and DP attention give OFF (sglang's gate: no fused all-reduce there).
``can_run_flashinfer`` is the only hardware check.
"""

from __future__ import annotations

import enum

import torch

from ..comm_plan import FUSION_MAX_TOKENS
from ..groups import ParallelGroups
from .reference import FusedAllReduceNorm, ReferenceFusedAllReduceNorm

FLASHINFER_SM_MAJOR = (9, 10)  # FlashInfer's trtllm fused all-reduce: Hopper (SM90) and Blackwell (SM100)
REQUESTS = ("auto", "on", "off", "reference", "flashinfer")


class FusionMode(str, enum.Enum):
    OFF = "off"
    REFERENCE = "reference"
    FLASHINFER = "flashinfer"


class FusionUnavailable(RuntimeError):
    """``flashinfer`` was asked for where it cannot run; the message says why."""


def can_run_flashinfer(capability: tuple[int, int] | None, importable: bool) -> bool:
    """capability: the GPU's (major, minor), None on CPU."""
    return capability is not None and capability[0] in FLASHINFER_SM_MAJOR and importable


def fusion_mode(requested: str, tp: int, dp_attention: bool, capability: tuple[int, int] | None,
                flashinfer_importable: bool) -> FusionMode:
    """The fusion of one rank of a ``tp``-rank group (pure; see the table above)."""
    if requested not in REQUESTS:
        raise ValueError(f"fusion must be one of {', '.join(REQUESTS)}, not {requested!r}")
    fast = can_run_flashinfer(capability, flashinfer_importable)
    if requested == "flashinfer" and not fast:
        why = "no CUDA GPU" if capability is None else (
            f"SM{capability[0]}{capability[1]} (needs SM90/SM100)" if capability[0] not in FLASHINFER_SM_MAJOR
            else "flashinfer is not installed")
        raise FusionUnavailable(f"the FlashInfer fused all-reduce cannot run here: {why}; use reference")
    if requested == "off" or tp == 1 or dp_attention:
        return FusionMode.OFF
    if requested == "reference":
        return FusionMode.REFERENCE
    if fast:
        return FusionMode.FLASHINFER
    return FusionMode.REFERENCE if requested == "on" else FusionMode.OFF


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    dev = torch.device(device)
    return tuple(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None  # type: ignore[return-value]


def fused_kernel(mode: FusionMode, groups: ParallelGroups, hidden: int, dtype: torch.dtype,
                 max_tokens: int = FUSION_MAX_TOKENS) -> FusedAllReduceNorm | None:
    """This rank's kernel for ``mode`` (None when OFF). FLASHINFER creates its workspaces before any
    CUDA-graph capture; if any rank cannot, every rank gets the reference (``.path`` says which)."""
    if mode is FusionMode.OFF:
        return None
    if mode is FusionMode.REFERENCE:
        return ReferenceFusedAllReduceNorm()
    from .flashinfer import FlashInferFusedAllReduceNorm

    return FlashInferFusedAllReduceNorm.create(groups, hidden, dtype, max_tokens)


def mode_of(kernel: FusedAllReduceNorm | None) -> FusionMode:
    """The mode a built kernel really runs (FlashInfer may have fallen back to the reference)."""
    if kernel is None:
        return FusionMode.OFF
    return FusionMode.FLASHINFER if kernel.path == "flashinfer_fused" else FusionMode.REFERENCE
