"""Programmatic dependent launch is decided once per process and never where it cannot run: off the GPU,
under Triton's interpreter, or when FUSEDSERVE_PDL=0 (models/layers/pdl.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _decision(env: dict[str, str]) -> str:
    code = ("from fusedserve.models.layers.pdl import pdl_enabled, pdl_launch; "
            "print(pdl_enabled(), sorted(pdl_launch().items()))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_pdl_is_off_without_a_hopper_gpu_and_when_asked() -> None:
    import torch

    off = "False [('PDL', False)]"
    assert _decision({"FUSEDSERVE_PDL": "0"}) == off
    assert _decision({"TRITON_INTERPRET": "1"}) == off
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9):
        assert _decision({}) == off
    else:
        assert _decision({}) == "True [('PDL', True), ('launch_pdl', True)]"
