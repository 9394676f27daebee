"""The all-reduce + add + RMSNorm fusion is decided once per rank, from what is asked and the hardware
(``models/parallel/fusion/selection.py``), and carried as one value: the kernel in ``Collectives``,
whose presence alone makes a model's plan fuse."""

from __future__ import annotations

import pytest

from fusedserve.models.parallel.collectives import Collectives
from fusedserve.models.parallel.fusion.reference import ReferenceFusedAllReduceNorm
from fusedserve.models.parallel.fusion.selection import (
    FusionMode,
    FusionUnavailable,
    fused_kernel,
    fusion_mode,
    mode_of,
)
from fusedserve.models.parallel.groups import ParallelGroups

H200, B200, A100 = (9, 0), (10, 0), (8, 0)


@pytest.mark.parametrize(("requested", "tp", "dp", "capability", "importable", "mode"), [
    ("off", 2, False, H200, True, FusionMode.OFF),
    ("on", 2, False, None, False, FusionMode.REFERENCE),  # CPU
    ("on", 2, False, H200, True, FusionMode.FLASHINFER),
    ("on", 2, False, H200, False, FusionMode.REFERENCE),  # FlashInfer not installed
    ("auto", 2, False, H200, True, FusionMode.FLASHINFER),
    ("auto", 2, False, B200, True, FusionMode.FLASHINFER),
    ("auto", 2, False, A100, True, FusionMode.OFF),
    ("auto", 2, False, None, False, FusionMode.OFF),
    ("on", 1, False, H200, True, FusionMode.OFF),  # nothing to all-reduce
    ("on", 4, True, H200, True, FusionMode.OFF),  # gated off under DP attention, as sglang does
    ("reference", 2, False, None, False, FusionMode.REFERENCE),
    ("reference", 1, False, None, False, FusionMode.OFF),
    ("flashinfer", 2, False, H200, True, FusionMode.FLASHINFER),
])
def test_fusion_mode_from_the_request_and_the_hardware(requested: str, tp: int, dp: bool,
                                                      capability: tuple[int, int] | None, importable: bool,
                                                      mode: FusionMode) -> None:
    assert fusion_mode(requested, tp, dp, capability, importable) is mode


def test_flashinfer_where_it_cannot_run_and_an_unknown_request_are_refused() -> None:
    with pytest.raises(FusionUnavailable, match="no CUDA GPU"):
        fusion_mode("flashinfer", 2, False, None, False)
    with pytest.raises(FusionUnavailable, match="SM80"):
        fusion_mode("flashinfer", 2, False, A100, True)
    with pytest.raises(ValueError, match="fusion must be one of"):
        fusion_mode("always", 2, False, None, False)


def test_the_kernel_is_the_one_value_the_plan_follows() -> None:
    import torch

    one = ParallelGroups.single_rank()
    assert fused_kernel(FusionMode.OFF, one, 64, torch.float32) is None
    ref = fused_kernel(FusionMode.REFERENCE, one, 64, torch.float32)
    assert isinstance(ref, ReferenceFusedAllReduceNorm)
    assert mode_of(ref) is FusionMode.REFERENCE and mode_of(None) is FusionMode.OFF
    assert Collectives("gloo").fused is None
