"""The fast kernel set's block-FP8 GEMM choice (fp8_block_gemm.prefers_scaled_mm) against the winners of the
recorded H200 GEMM tables: the rule must pick the faster kernel at every measured shape where the two
differ by more than 10 % (closer ones are noise between the two runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusedserve.models.layers import fp8_block_cublas
from fusedserve.models.layers.fp8_block import BlockFP8
from fusedserve.models.layers.fp8_block_gemm import prefers_scaled_mm

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
TABLES = sorted(RESULTS.glob("*-fp8-slice-h200.json"))


@pytest.mark.parametrize("record", TABLES, ids=lambda p: p.name)
def test_the_rule_picks_the_measured_winner(record: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_block_cublas, "supported", lambda fmt, n, k: fmt.block == (128, 128)
                        and n % 128 == 0 and k % 128 == 0)  # as on the GPU machine's torch
    fmt = BlockFP8(128, 128)
    rows = json.loads(record.read_text())["gemms"]
    checked = 0
    for r in rows:
        cublas, triton = r.get("fp8_cublas_scaled_mm_us"), r["fp8_triton_us"]
        if cublas is None:
            assert not prefers_scaled_mm(r["m"], r["n"], r["k"], fmt), r
            continue
        if max(cublas, triton) < 1.1 * min(cublas, triton):
            continue
        assert prefers_scaled_mm(r["m"], r["n"], r["k"], fmt) == (cublas < triton), r
        checked += 1
    assert checked >= 30


def test_tables_are_recorded() -> None:
    assert len(TABLES) >= 2
