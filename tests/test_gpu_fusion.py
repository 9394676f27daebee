"""GPU (-m gpu): FlashInfer's fused all-reduce + add + RMSNorm equals the reference; verify at tp=2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs")


def _fused_vs_reference(rank: int, world: int, backend: str) -> list[float]:
    import torch.distributed as dist

    from fusedserve.models.parallel.fusion.flashinfer import FlashInferFusedAllReduceNorm
    from fusedserve.models.parallel.fusion.reference import add_rms_norm
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups

    groups = build_groups(ParallelConfig(world), rank, backend)
    fused = FlashInferFusedAllReduceNorm.create(groups, 4096, torch.bfloat16, max_tokens=2048)
    assert isinstance(fused, FlashInferFusedAllReduceNorm)
    errs = []
    for n in (1, 7, 64, 513, 2048):
        g = torch.Generator(device="cuda").manual_seed(rank * 100 + n)
        x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        full = x.float().clone()
        dist.all_reduce(full, group=groups.tp.device_group)
        ref_norm, ref_res = add_rms_norm(full, res.float(), w.float(), 1e-6)
        norm, resid = fused(x, res, w, 1e-6, groups.tp)
        errs.append(max(float((norm.float() - ref_norm).abs().max()), float((resid.float() - ref_res).abs().max())))
    return errs


@needs_two_gpus
def test_flashinfer_fused_equals_reference() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    for errs in run_on_ranks(_fused_vs_reference, 2, backend="nccl"):
        assert max(errs) < 0.1, errs  # bf16 outputs of O(1) values; a missing reduction is O(1) off


@needs_two_gpus
def test_verify_flashinfer_tp2_matches_tp1(tmp_path) -> None:
    from fusedserve.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=4)
    proc = subprocess.run([sys.executable, "-m", "fusedserve.cli", "verify", "--model", str(model), "--tp", "2",
                           "--fusion", "flashinfer", "--oracle", "tp1", "--dtype", "bfloat16", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["ok"] and report["collectives_ok"]
    assert any("flashinfer_fused" in k for k in report["paths"]), report["paths"]
