"""bench/fp8_slice_bound.py: kernels fall in the right group, and the bound is the roofline plus the
format-independent kernels, over the measured bf16 step, on a hand-made record and on a recorded one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `bench.*` importable under a bare `pytest` too
    sys.path.append(str(ROOT))

from bench import fp8_slice_bound as fb

RECORD = ROOT / "bench" / "results" / "2026-12-06-fp8-slice-bound-h100.json"


@pytest.mark.parametrize("name, kind", [
    ("_group_quant_kernel", "extra"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int", "extra"),
    ("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", "stream"),
    ("_gate_up_kernel", "stream"),
    ("_gemm_kernel", "stream"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int", "stream"),
    ("_rms_norm_kernel", "shared"),
    ("_decode_kernel", "shared"),
    ("_combine_kernel", "shared"),
    ("Memcpy HtoD (Pinned -> Device)", "shared"),
])
def test_kernel_groups(name: str, kind: str) -> None:
    assert fb.group(name) == kind


def _record() -> dict:
    seq = [["_rms_norm_kernel", 2.0, 2.0], ["_group_quant_kernel", 1.0, 1.0], ["_gemm_kernel", 60.0, 50.0],
           ["_decode_kernel", 9.0, 8.0], ["nvjet_lm_head", 300.0, 300.0]]
    return {"fp8": {"decode": [{"batch": 1, "ms_per_step": 0.5, "roofline_ms": 0.34}],
                    "profile": {"1": {"sequence": seq}, "8": {"sequence": seq}}},
            "bf16": {"decode": [{"batch": 1, "ms_per_step": 0.6, "roofline_ms": 0.5}], "profile": {}}}


def test_bound_is_roofline_plus_shared_kernels_over_bf16() -> None:
    out = fb.bound(_record())
    assert list(out) == ["1"]  # batch 8 has no decode entry: left out
    b = out["1"]
    assert b["fp8_charged_us"] == {"stream": 350.0, "extra": 1.0, "shared": 10.0}
    assert b["bound_ms"] == pytest.approx(0.35)
    assert b["ratio_bound"] == pytest.approx(0.35 / 0.6, abs=1e-4)
    assert b["ratio_bound_fast_streams"] == pytest.approx((0.34 / fb.FAST_STREAMS + 0.01) / 0.6, abs=1e-4)
    assert b["shared_cut_for_goal_us"] == 0.0  # 0.35 <= 0.6 x 0.6
    tight = fb.bound(_record(), goal=0.5)["1"]
    assert tight["shared_cut_for_goal_us"] == pytest.approx((0.35 - 0.3) / 0.5 * 1000, abs=0.1)


def test_the_recorded_bound_follows_from_its_slice_records() -> None:
    rec = json.loads(RECORD.read_text())
    for run in rec["runs"]:
        batches = fb.bound(run["slice"])
        assert batches == run["bound"]
        for b in batches.values():
            assert b["bound_ms"] < b["fp8_ms"] and b["ratio_bound"] < b["ratio"]


def test_the_command_runs(tmp_path: Path) -> None:
    path = tmp_path / "slice.json"
    path.write_text(json.dumps(_record()))
    out = tmp_path / "bound.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_slice_bound.py"), str(path), "--out", str(out)],
                   check=True, capture_output=True, timeout=60)
    assert json.loads(out.read_text())[str(path)]["batches"]["1"]["ratio_bound"] == pytest.approx(0.5833, abs=1e-4)


def test_a_measured_read_bandwidth_replaces_the_assumed_fast_streams(tmp_path: Path) -> None:
    path = tmp_path / "slice.json"
    path.write_text(json.dumps(_record()))
    probe = tmp_path / "read.json"
    probe.write_text(json.dumps({"best_read": "triton/8192/4/8", "best_read_over_copy": 1.0}))
    out = tmp_path / "bound.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_slice_bound.py"), str(path), "--read-bandwidth",
                    str(probe), "--out", str(out)], check=True, capture_output=True, timeout=60)
    result = json.loads(out.read_text())[str(path)]
    assert result["fast_streams"] == 1.0
    for b in result["batches"].values():  # streams no faster than the copy: the two bounds are one
        assert b["ratio_bound_fast_streams"] == b["ratio_bound"]
    assert fb.bound(_record(), fast=1.0) == result["batches"]


def _depth_record() -> dict:
    def seq(layer_us: float) -> list:
        return [["Memcpy HtoD (Pinned -> Device)", 1.0, 1.0], ["_embedding_kernel", 1.0, 1.0],
                ["_rms_norm_kernel", 2.0, 2.0], ["_gemm_kernel", layer_us, layer_us], ["_sum_kernel", 3.0, 3.0],
                ["_rms_norm_kernel", 2.0, 2.0], ["_gemm_kernel", layer_us, layer_us], ["_sum_kernel", 3.0, 3.0],
                ["_rms_norm_kernel", 2.0, 2.0], ["nvjet_lm_head", 300.0, 300.0]]
    return {"fp8": {"decode": [], "profile": {"1": {"sequence": seq(45.0)}, "4": {"sequence": seq(50.0)}}},
            "bf16": {"decode": [], "profile": {"1": {"sequence": seq(95.0)}}}}


def test_depth_parts_the_bf16_head_from_the_layers() -> None:
    out = fb.depth(_depth_record(), layers=2)
    assert list(out) == ["1"]  # batch 4 has no bf16 profile: left out
    d = out["1"]
    assert d["fp8_head_us"] == d["bf16_head_us"] == 304.0  # memcpy + embedding + final norm + LM head
    assert d["fp8_layers_us"] == 2 * (2 + 45 + 3) and d["bf16_layers_us"] == 2 * (2 + 95 + 3)
    assert d["layers_ratio"] == 0.5
    assert d["slice_ratio_charged"] == pytest.approx(404 / 504, abs=1e-4)
    # 61 such layers under the same head: the head's weight shrinks, the ratio nears the layers'
    assert d["model_ratio"] == pytest.approx((304 + 61 * 50) / (304 + 61 * 100), abs=1e-4)
    assert d["layers_ratio"] < d["model_ratio"] < d["slice_ratio_charged"]


def test_depth_of_the_recorded_h100_runs() -> None:
    """The 2-layer H100 slice: its batch-1 step is ~half LM head in both builds, so the slice's ratio (0.79)
    is far above its layers' (0.64)."""
    run = json.loads(RECORD.read_text())["runs"][0]
    d = fb.depth(run["slice"], layers=2)["1"]
    assert d["fp8_head_us"] == pytest.approx(d["bf16_head_us"], rel=0.02)
    assert d["fp8_head_us"] > 0.45 * (d["fp8_head_us"] + d["fp8_layers_us"])
    assert d["layers_ratio"] < d["model_ratio"] < d["slice_ratio_charged"]


def test_from_top_reads_records_without_a_sequence(tmp_path: Path) -> None:
    """An older record's top list: durations stand for critical-path time, kernels launched once a step are the
    head, and a step whose summed kernels exceed it is flagged."""
    top = [{"name": "nvjet_lm_head", "calls_per_step": 1, "us_per_step": 300.0},
           {"name": "_gemm_kernel", "calls_per_step": 4, "us_per_step": 100.0},
           {"name": "_group_quant_kernel", "calls_per_step": 4, "us_per_step": 4.0},
           {"name": "_rms_norm_kernel", "calls_per_step": 5, "us_per_step": 10.0}]
    bf16_top = [dict(top[0]), {**top[1], "us_per_step": 200.0}, dict(top[3])]
    rec = {"model_shape": {"num_hidden_layers": 2},
           "fp8": {"decode": [{"batch": 1, "ms_per_step": 0.42, "roofline_ms": 0.35}],
                   "profile": {"1": {"top": top}}},
           "bf16": {"decode": [{"batch": 1, "ms_per_step": 0.52, "roofline_ms": 0.5}],
                    "profile": {"1": {"top": bf16_top}}}}
    approx = fb.with_sequences_from_top(rec)
    b = fb.bound(approx)["1"]
    assert b["fp8_charged_us"] == {"stream": 400.0, "extra": 4.0, "shared": 10.0}
    assert b["bound_ms"] == pytest.approx(0.36)
    d = fb.depth(approx, layers=2)["1"]
    assert (d["fp8_head_us"], d["fp8_layers_us"], d["bf16_layers_us"]) == (300.0, 114.0, 210.0)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": {"new": rec}}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_slice_bound.py"), str(path), "--from-top",
                          "--runs", "new"], check=True, capture_output=True, text=True, timeout=60).stdout
    result = json.loads(out)[str(path)]
    assert result["from"] == "top" and result["layers"] == 2
    assert result["batches"]["1"]["summed_over_step"] == pytest.approx(414 / 420, abs=1e-3)


def test_depth_skips_a_step_without_its_head_markers() -> None:
    rec = _depth_record()
    rec["bf16"]["profile"]["1"]["sequence"] = [k for k in rec["bf16"]["profile"]["1"]["sequence"]
                                               if k[0] != "_embedding_kernel"]
    assert fb.depth(rec, layers=2) == {}
