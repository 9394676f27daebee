"""GPU (-m gpu, SM89+): the block-FP8 kernels equal their w8a8 references on the device; a tiny FP8
DeepSeek-V3 built by ``build_rank`` with the Triton set and CUDA graphs stays within the stated
activation-quantization tolerance of the same checkpoint dequantized (``quantization: none``).

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_fp8.py -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA GPU with FP8 tensor cores (SM89+)")
# (N, K) of DeepSeek-V3's attention and shared-expert projections (kv_a_proj_with_mqa: 4.5 column blocks)
SHAPES = [(1536, 7168), (576, 7168), (32768, 512), (7168, 16384), (4096, 7168)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_block_fp8_gemms_equal_the_w8a8_reference(m: int) -> None:
    from fusedserve.models.layers import fp8_block_cublas
    from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_w8a8_reference, quantize_weight
    from fusedserve.models.layers.fp8_block_triton import block_fp8_linear_triton

    fmt, g = BlockFP8(128, 128), torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w, s = quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02, fmt)
        want = block_fp8_linear_w8a8_reference(x, w, s, None, fmt)
        assert _rel(block_fp8_linear_triton(x, w, s, None, fmt), want) < 1e-2, (m, n, k)
        if fp8_block_cublas.supported(fmt, n, k):
            assert _rel(fp8_block_cublas.block_fp8_linear_cublas(x, w, s, None, fmt), want) < 1e-2, (m, n, k)


@needs_fp8_gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_block_fp8_w8a16_equals_the_dequantized_reference(m: int) -> None:
    """The weight-only decode kernel on DeepSeek-V3's shapes: within bf16 output rounding of x @ dequantize(W)^T (it
    quantizes no activation, so it is closer to that than the w8a8 GEMMs), with a bias, split or not."""
    from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_reference, quantize_weight
    from fusedserve.models.layers.fp8_block_w8a16_triton import block_fp8_linear_w8a16_triton

    fmt, g = BlockFP8(128, 128), torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w, s = quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02, fmt)
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        want = block_fp8_linear_reference(x.float(), w, s, bias.float(), fmt)
        assert _rel(block_fp8_linear_w8a16_triton(x, w, s, bias, fmt), want) < 5e-3, (m, n, k)


@needs_fp8_gpu
def test_block_fp8_gemv_equals_the_dequantized_reference() -> None:
    """The one-row GEMV (e4m3 read as words of four, converted by inline PTX, no tensor cores) on DeepSeek-V3's shapes
    and the merged q_a + kv_a (2112 rows): within bf16 output rounding of x @ dequantize(W)^T, with a bias."""
    from fusedserve.models.layers.fp8_block import BlockFP8, block_fp8_linear_reference, quantize_weight
    from fusedserve.models.layers.fp8_block_gemv_triton import block_fp8_gemv_triton, supported

    fmt, g = BlockFP8(128, 128), torch.Generator(device="cuda").manual_seed(1)
    for n, k in SHAPES + [(2112, 7168), (24576, 1536)]:
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        w, s = quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02, fmt)
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        assert supported(x, w, s, bias, fmt), (n, k)
        want = block_fp8_linear_reference(x.float(), w, s, bias.float(), fmt)
        assert _rel(block_fp8_gemv_triton(x, w, s, bias, fmt), want) < 5e-3, (n, k)


def _fp8_experts_case(n: int) -> tuple[Any, ...]:
    """16 block-FP8 experts (hidden 1024, intermediate 256, 128 x 128 blocks) and n bf16 tokens routed top-8 at
    random, some slots on another rank (-1), seeded by n -> (x, ids, routing weights, gate_up, its scales, down,
    its scales, format)."""
    from fusedserve.models.layers.fp8_block import BlockFP8, quantize_weight

    fmt, g = BlockFP8(128, 128), torch.Generator(device="cuda").manual_seed(n)
    experts, hidden, inter, k = 16, 1024, 256, 8
    x = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    gate_up, gate_up_s = quantize_weight(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * .05, fmt)
    down, down_s = quantize_weight(torch.randn(experts, hidden, inter, device="cuda", generator=g) * .05, fmt)
    ids = torch.randint(-1, experts, (n, k), device="cuda", generator=g)
    w = torch.rand(n, k, device="cuda", generator=g)
    return x, ids, w, gate_up, gate_up_s, down, down_s, fmt


@needs_fp8_gpu
@pytest.mark.parametrize("n", [1, 16])
def test_fp8_fused_experts_w8a16_equal_the_dequantized_experts(n: int) -> None:
    """Up to ``W8A16_ROWS`` tokens (bf16 rows as they are, e4m3 weight tiles converted on the GPU): within the
    bf16 output's rounding of the dequantized experts."""
    import fusedserve.models.layers.fused_moe_fp8_triton as moe8
    from fusedserve.models.layers.fused_moe import fused_experts_fp8_torch

    x, ids, w, gate_up, gate_up_s, down, down_s, fmt = _fp8_experts_case(n)
    want = fused_experts_fp8_torch(x.float(), ids, w, gate_up, gate_up_s, down, down_s, fmt)
    before, moe8.W8A16_ROWS = moe8.W8A16_ROWS, 16
    try:
        got = moe8.fused_experts_fp8_triton(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    finally:
        moe8.W8A16_ROWS = before
    assert _rel(got, want) < 1e-2


@needs_fp8_gpu
@pytest.mark.parametrize("n", [1, 64, 512])
def test_fp8_fused_experts_equal_the_w8a8_reference(n: int) -> None:
    from fusedserve.models.layers.fused_moe import fused_experts_fp8_w8a8_reference
    from fusedserve.models.layers.fused_moe_fp8_triton import fused_experts_fp8_triton

    x, ids, w, gate_up, gate_up_s, down, down_s, fmt = _fp8_experts_case(n)
    want = fused_experts_fp8_w8a8_reference(x, ids, w, gate_up, gate_up_s, down, down_s, fmt)
    assert _rel(fused_experts_fp8_triton(x, ids, w, gate_up, gate_up_s, down, down_s, fmt), want) < 2e-2


@needs_fp8_gpu
def test_graphed_fp8_model_is_within_tolerance_of_the_dequantized_one(tmp_path: Path) -> None:
    from fusedserve.tiny import make_tiny_deepseek_v3_fp8
    from fusedserve.verify import _prefill_step
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.executor.step import SeqRows, Step
    from fusedserve.worker.executor.step_shape import StepShape
    from fusedserve.worker.parallel.rank import build_rank

    path = make_tiny_deepseek_v3_fp8(tmp_path / "fp8", block=(32, 32))  # Triton takes bk >= 32
    prompts = [[5, 9, 200, 3, 7, 11], [17, 4], [1, 2, 3]]
    decode = Step(tuple(SeqRows((i,), (t,), (len(p),), len(p) + 1) for i, (p, t) in enumerate(zip(prompts, [8, 9, 10]))))
    logits = {}
    for quant, graphs in (("fp8", True), ("fp8", False), ("none", False)):
        built = build_rank(path, EngineConfig(device="cuda", dtype="bfloat16", num_blocks=8, max_num_seqs=4,
                                              quantization=quant, cuda_graphs=graphs, kernels="triton"))
        if graphs:
            built.executor.capture([StepShape(4, 1)], 4)
        built.executor.run(_prefill_step(prompts))
        logits[quant, graphs] = built.executor.run(decode).logits.float()
        assert built.quantization.weights == ("fp8" if quant == "fp8" else "dequantized")
    assert _rel(logits["fp8", True], logits["fp8", False]) < 1e-2  # the replay is the eager forward
    assert _rel(logits["fp8", False], logits["none", False]) < 0.1  # e4m3 activations, bf16 elsewhere
