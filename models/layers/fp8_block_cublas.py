"""Block-scaled FP8 linear through torch's ``scaled_mm`` (cuBLASLt's DeepSeek recipe: 1 x 128 activation
scales x 128 x 128 weight scales; SM90, CUDA >= 12.9, torch >= 2.10): the library candidate beside
``fp8_block_triton.block_fp8_linear_triton``. Plain reference: ``fp8_block.block_fp8_linear_w8a8_reference``.

``bench/fp8_slice.py`` measures it against the Triton kernel per DeepSeek-V3 shape on the GPU (and
``tests/test_gpu_fp8.py`` checks it there); the fast kernel set takes it where those numbers say
(``fp8_block_gemm.py``).
cuBLASLt wants the activation scales M-major with M a multiple of 4 (x is zero-padded) and the weight's
K blocks padded to a multiple of 4 (as vLLM's and others' callers do); the activations are quantized
by the Triton group-quant kernel. ``supported`` says which shapes it takes (128 x 128 blocks, whole
blocks in N and K).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_block import FP8_DTYPE, BlockFP8


def supported(fmt: BlockFP8, n: int, k: int) -> bool:
    return fmt.block == (128, 128) and n % 128 == 0 and k % 128 == 0 and hasattr(F, "scaled_mm")


def block_fp8_linear_cublas(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            bias: torch.Tensor | None, fmt: BlockFP8) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ (weight e4m3 [N, K] with scale_inv [N/128, K/128])^T (+ bias) -> [M, N]."""
    from .fp8_block_triton import group_quant_triton

    n, k = weight.shape
    if not supported(fmt, n, k) or weight.dtype != FP8_DTYPE:
        raise ValueError(f"scaled_mm's blockwise recipe takes 128x128 blocks of whole N and K, not {n}x{k} in "
                         f"{fmt.block_n}x{fmt.block_k}")
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    q, s = group_quant_triton(xp.contiguous(), 128)
    kb = k // 128
    ws = F.pad(scale_inv, (0, -kb % 4)) if kb % 4 else scale_inv
    y = F.scaled_mm(q, weight.t(), s.t().contiguous().t(), F.ScalingType.BlockWise1x128, ws.t(),
                    F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
    return y + bias if bias is not None else y
