"""`fusedserve verify` end to end (subprocess) and its pure parts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusedserve.verify import (
    VerifyError,
    VerifyOptions,
    compare_collectives,
    default_prompts,
    load_prompts_file,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def fusedserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        check=False,
        args=[sys.executable, "-m", "fusedserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )


def test_verify_tp2_reference_fusion_against_hf(tiny_llama: Path) -> None:
    proc = fusedserve(
        "verify", "--model", str(tiny_llama), "--tp", "2", "--fusion", "reference", "--oracle", "hf", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["logits_ok"] is True and report["collectives_ok"] is True
    assert (report["tp"], report["fusion"], report["oracle"], report["dtype"]) == (
        2,
        "reference",
        "hf",
        "float32",
    )
    assert report["max_abs_diff"] <= report["tolerance"] == 1e-5  # the fp32 floor: HF's own noise is ~1e-7 here
    assert "HF eager vs sdpa" in report["tolerance_how"] and report["oracle_noise"] < 1e-6
    assert report["argmax_ok"] and report["topk_violations"] == 0 and report["continuation_ok"]
    assert report["decode_forwards_off_plan"] == 0
    # Executed == planned: per forward on every rank, and site by site (rank 0's view).
    assert report["planned_per_forward"] == 10 and report["executed_per_forward"] == [10, 10]
    assert report["mismatches"] == []
    assert {site: v["executed"] for site, v in report["per_site"].items()} == {
        site: v["planned"] for site, v in report["per_site"].items()
    }
    assert report["per_site"]["layers.1.attn.in"]["planned"] == ["fused_ar_add_rmsnorm(tp)"]
    assert report["per_site"]["final.in"]["planned"] == ["all_reduce(tp)"]
    # Calls by path over the run's 8 forwards (the prefill and 7 greedy decode steps).
    assert report["paths"] == {
        "all_gather/tp/gloo": 1 * 8,
        "all_reduce/tp/shm": 2 * 8,  # the sums through the host's shared memory, the gather over gloo
        "fused_ar_add_rmsnorm/attn_tp/reference_fused": 4 * 8,
        "fused_ar_add_rmsnorm/tp/reference_fused": 3 * 8,
    }
    # Per prompt: last-position argmax and top-5, ours and the oracle's, for an outside check.
    assert [p["length"] for p in report["prompts"]] == [1, 7, 19, 40]
    for p in report["prompts"]:
        assert p["argmax"] == p["oracle_argmax"] == p["top5"][0]
        assert p["top5"] == p["oracle_top5"] and len(p["top5"]) == 5
        assert p["max_abs_diff"] <= 1e-5
        assert len(p["continuation"]) == 8 and p["continuation"][0] == p["argmax"] and p["continuation_exact"]


def test_verify_fails_loudly_on_a_corrupted_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(tiny_llama, tmp_path / "bad"))
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32
    (bad / "model.safetensors").write_bytes(bytes(data))
    proc = fusedserve("verify", "--model", str(bad), "--tp", "2", "--fusion", "reference", "--json")
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "fusedserve verify: error:" in proc.stderr
    assert "not a readable safetensors file" in proc.stderr, proc.stderr


def test_verify_refuses_out_of_range_prompt_ids(tiny_llama: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3], [4, 250]]))  # vocab is 250
    proc = fusedserve("verify", "--model", str(tiny_llama), "--prompts", str(prompts))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "prompts must be non-empty lists of token ids in [0, 250)" in proc.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "fusedserve"
    assert script.is_file()
    proc = subprocess.run(
        check=False, args=[str(script), "verify", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for flag in ("--model", "--tp", "--dp", "--ep", "--fusion", "--oracle", "--dtype", "--prompts", "--json",
                 "--tolerance", "--continuation"):
        assert flag in proc.stdout


# --- pure parts --------------------------------------------------------------------------------


def test_compare_collectives_names_the_rank_that_differs() -> None:
    planned = [
        ("layers.0.attn.in", "all_reduce", "tp"),
        ("final.in", "all_reduce", "tp"),
        ("lm_head", "all_gather", "tp"),
    ]
    twice = planned[:2] + [("final.in", "all_reduce", "tp")] + planned[2:]
    ok, sites, mismatches = compare_collectives(planned, [planned, twice])
    assert not ok
    assert mismatches == ["rank 1: executed 4 collectives, planned 3; first difference at #2"]
    assert sites["final.in"] == {
        "planned": ["all_reduce(tp)"],
        "executed": ["all_reduce(tp)"],
    }  # rank 0's view
    ok, _, mismatches = compare_collectives(planned, [planned, planned])
    assert ok and mismatches == []
    ok, sites, _ = compare_collectives(planned, [planned[:1], planned])
    assert not ok and sites["lm_head"] == {"planned": ["all_gather(tp)"], "executed": []}


def test_load_prompts_file(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text("[[1, 2], [3]]")
    assert load_prompts_file(str(good)) == ((1, 2), (3,))
    for text in ("[1, 2]", '{"a": [1]}', '[["x"]]', "[[1.5]]", "not json"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(VerifyError, match="--prompts"):
            load_prompts_file(str(bad))
    with pytest.raises(VerifyError, match="--prompts"):
        load_prompts_file(str(tmp_path / "missing.json"))


def test_verify_options_validate() -> None:
    with pytest.raises(VerifyError, match="--fusion must be one of off, reference, flashinfer"):
        VerifyOptions(model="m", fusion="on")
    with pytest.raises(VerifyError, match="--oracle must be one of hf, hf-dequantized, tp1"):
        VerifyOptions(model="m", oracle="vllm")
    with pytest.raises(VerifyError, match="--dtype must be one of float32, bfloat16, float16"):
        VerifyOptions(model="m", dtype="float64")
    with pytest.raises(VerifyError, match="--quantization must be one of auto, fp8, none"):
        VerifyOptions(model="m", quantization="int4")
    assert VerifyOptions(model="m").atol == 1e-5  # the floor of the calibrated tolerance
    assert VerifyOptions(model="m", dtype="bfloat16").atol == 1e-1
    assert VerifyOptions(model="m", dtype="float16").atol == 2e-2
    assert VerifyOptions(model="m", tolerance=1e-3).atol == 1e-3


def test_default_prompts_are_fixed_and_in_range() -> None:
    prompts = default_prompts(250)
    assert prompts == default_prompts(250)
    assert [len(p) for p in prompts] == [1, 7, 19, 40]
    assert all(0 <= t < 250 for p in prompts for t in p)


def test_verify_under_dp_attention_with_groups_of_unequal_prompts(tmp_path: Path) -> None:
    """DP group 0 gets prompts of 1 and 19 tokens, group 1 of 7 and 40: every rank's cache must hold the
    longer group's (the group keeps the smallest cache any rank asks for)."""
    from fusedserve.tiny import make_tiny_deepseek_v3
    from fusedserve.verify import VerifyOptions, run_verify

    model = make_tiny_deepseek_v3(tmp_path / "ds")
    report = run_verify(VerifyOptions(model=str(model), tp=2, dp=2, ep=1, oracle="tp1"))
    assert report.ok, report.to_text()
