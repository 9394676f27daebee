"""One row of bf16 / fp16 activations times a block-FP8 weight without tensor cores (GPU; CUDA-graph capturable):
a batch-1 decode step's dense projections in one launch, no activation quantization.

Plain reference: ``fp8_block.block_fp8_linear_reference`` (the dequantized weight times x). e4m3 values are exact
in fp32, so each product here is the reference's; only the order of the fp32 sums differs.

Why: at one row the block-FP8 projections of DeepSeek-V3 ran far from their bytes on the H200 (#19; the slice's
batch-1 step, 2026-12-05-fp8-slice-shared-expert-pdl-ab-h200.json: q_a + kv_a and q_b_proj through the w8a8 GEMM
84 us for 50 of bytes a step, o_proj through ``scaled_mm`` 150 for 110, each behind an activation quantization
launch). The weight-only tensor-core GEMM (``fp8_block_w8a16_triton``) lost to the w8a8 path on an H100
(2026-12-06-w8a16-decode-kernels-slice-h100.json): its weight tiles go through the MMA's operand layout. A
GEMV needs no layout: as the bf16 GEMV (``linear_triton._gemv_kernel``) a program per ``BLOCK_N`` outputs
streams its weight in [BLOCK_N, BLOCK_K] steps, converted to fp32 in registers and multiplied with the row of x,
the next step loaded while one is multiplied. The block scale does not vary over a program's rows (``BLOCK_N``
divides the format's bn), so it scales x instead of the weights: x[k] * scale_inv[row block, k // bk], one
multiply per column, not per weight. Under PDL (``pdl.py``) the first step is read before waiting on the kernel
before.

The conversion decides the speed. Triton's own e4m3 -> fp32 cast unpacks every byte and repacks pairs before
``cvt.rn.f16x2.e4m3x2``, ~12 instructions a weight: a GEMV written with it streamed at most ~2.1 TB/s on an H100
and made the slice's batch-1 step slower (2026-12-07-fp8-one-row-gemv-slice-h100.json). Here the weight is read
as int32 words of four values and converted by one inline-PTX block a word (``e4m3x4_f32``: two
``cvt.rn.f16x2.e4m3x2``, four f16 -> f32), ~3 instructions a weight with the multiply-add, and each thread's
products stay summed per column until the end. On an H100 at one row (2026-12-07-fp8-gemv-words-slice-h100.json,
each call another copy of the weight): o_proj 44.3 us (87 % of the copy bandwidth) against 51.2 for the w8a8
GEMM and 56.8 for ``scaled_mm``, q_b_proj 15.2 against 17.9, q_a + kv_a 8.2 against 11.4 (each w8a8 figure with
its quantization launch); the 2-layer slice's batch-1 step 1.191 against 1.227 ms. At 2 and 4 rows the same
words converted once for every row lost to the w8a8 GEMMs twice: with x's rows reaching the weights' layout
through shared memory each step (same record), and with each row read as the one-row kernel reads its row and
one accumulator a row (2026-12-07-fp8-gemv-rows-h100.json: o_proj 76-147 us at 2 rows and 126-278 at 4 against
the w8a8 GEMM's 51-52; every added row's x loads and multiply-adds cost about what the first row's did, so
the kernel is bound by instructions, not bytes; the slice's FP8 step at batch 2 / 4 +20 / +32 %). So only one
row comes here.

``ROWS`` (1; 0: never): the fast set's ``block_fp8_matmul`` routes one-row calls here (``fp8_block_gemm``). The
A/B: ``--set models.layers.fp8_block_gemv_triton.ROWS=0``. Not yet timed on an H200.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_block import FP8_DTYPE, BlockFP8, block_fp8_linear_reference
from .pdl import pdl_launch, pdl_release, pdl_wait

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter runs no inline PTX
# Rows up to which the fast kernel set takes this kernel (only one row is taken); 0: never.
ROWS = 1
# Rows a program (K columns a step: ``block_k``; warps: ``warps``).
BLOCK_N = 8
# The weight blocks (rows, columns) of an EAGLE3 draft's LM head in block FP8 in the fast kernel sets
# (``Kernels.draft_head``, ``eagle3.py``): a chain step's head is one row, so it comes here; 8 x 64 blocks keep each
# scale to one program's rows and a narrow K span (SmolLM2's draft: hidden 576 = 9 x 64). On CPU the acceptance
# with the head so rounded (SmolLM2's draft, chain-7, 20 + 20 prompts) moved within its noise
# (2026-12-07-spec-acceptance-fp8-draft-head-smollm2-cpu.json). Alone on an H100 (bench/draft_head_probe.py,
# 2026-12-07-draft-head-probe-h100.json) SmolLM2's draft head took 7.75 us against 8.86 in bf16 (both bound by
# latency at 18.9 MB; ~1 % of a chain-7 round), a Llama-3-8B-sized one [32000, 4096] 50.5 against 84.0. None (the
# default until an engine A/B times it): the head stays in the checkpoint's dtype. The A/B: --set
# models.layers.fp8_block_gemv_triton.DRAFT_HEAD_BLOCK="(8, 64)".
DRAFT_HEAD_BLOCK: tuple[int, int] | None = None


def draft_head() -> BlockFP8 | None:
    """The draft head's format (``DRAFT_HEAD_BLOCK``), read when a kernel set is made."""
    return None if DRAFT_HEAD_BLOCK is None else BlockFP8(*DRAFT_HEAD_BLOCK)


def warps(block_n: int, block_k: int) -> int:
    """Warps a program: 32 bytes of e4m3 a thread each step (8 x 1024 on 8 warps). On an H100 q_b_proj's 8 x 512
    steps took 15.3 us on 4 warps and 43.0 on 8 (2026-12-07-fp8-gemv-words-slice-h100.json)."""
    return max(1, block_n * block_k // 1024)


@triton.jit
def e4m3x4_f32(v, NATIVE: tl.constexpr):
    """Four e4m3 values packed in each int32 of v (the first in the low byte) -> four fp32 tensors of v's shape
    (exact). NATIVE (a GPU): one asm block a word, two ``cvt.rn.f16x2.e4m3x2`` and four f16 -> f32 conversions;
    Triton's own cast of an e4m3 tile unpacks every byte and repacks pairs first, ~12 instructions a value, which
    bounded the GEMV at ~2.1 TB/s on an H100 (2026-12-07-fp8-one-row-gemv-slice-h100.json). Else (the CPU
    interpreter, which runs no PTX) each byte is cast."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            .reg .f16 h0, h1, h2, h3;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {h0, h1}, a;
            mov.b32 {h2, h3}, b;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }""",
            constraints="=r,=r,=r,=r,r", args=[v], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    else:
        f0 = (v & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((v >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((v >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((v >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return f0, f1, f2, f3


@triton.jit
def scaled_quads(x_ptr, s_ptr, k0, rq, K, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr):
    """x's columns k0 + 4 q + j (j = 0..3: four [BLOCK_K / 4] tensors) in fp32, times the weight scale of their K
    block (``s_ptr``: the program's scale row; a block of GROUP_K >= 4 columns holds each quad whole). Not EVEN_K:
    columns from K on read as 0."""
    cols = k0 + 4 * rq
    if EVEN_K:
        s = tl.load(s_ptr + cols // GROUP_K)
        x0 = tl.load(x_ptr + cols).to(tl.float32) * s
        x1 = tl.load(x_ptr + cols + 1).to(tl.float32) * s
        x2 = tl.load(x_ptr + cols + 2).to(tl.float32) * s
        x3 = tl.load(x_ptr + cols + 3).to(tl.float32) * s
    else:
        ok = cols < K
        s = tl.load(s_ptr + cols // GROUP_K, mask=ok, other=0.0)
        x0 = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32) * s
        x1 = tl.load(x_ptr + cols + 1, mask=ok, other=0.0).to(tl.float32) * s
        x2 = tl.load(x_ptr + cols + 2, mask=ok, other=0.0).to(tl.float32) * s
        x3 = tl.load(x_ptr + cols + 3, mask=ok, other=0.0).to(tl.float32) * s
    return x0, x1, x2, x3


@triton.jit
def add_quad_products(acc, v, x_ptr, s_ptr, k0, rq, K, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
                      NATIVE: tl.constexpr):
    """acc [rows, BLOCK_K / 4] plus, per quad of columns, the products of the packed weight words v with x's
    scaled columns k0 + 4 q + j (four fused multiply-adds a word)."""
    f0, f1, f2, f3 = e4m3x4_f32(v, NATIVE)
    x0, x1, x2, x3 = scaled_quads(x_ptr, s_ptr, k0, rq, K, GROUP_K, EVEN_K)
    acc += f0 * x0[None, :]
    acc += f1 * x1[None, :]
    acc += f2 * x2[None, :]
    acc += f3 * x3[None, :]
    return acc


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, K, stride_wn, stride_sn,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """Program n: outputs n * BLOCK_N.. of the one row, all of K in BLOCK_K steps (EVEN_K: BLOCK_K divides K, else
    the last step is masked). The weight is read as int32 words of four e4m3 values (``w_ptr`` an int32 view,
    ``stride_wn`` in words), the next step loaded while one is multiplied, the first before the PDL wait (two
    steps ahead was no faster: 2026-12-07-fp8-gemv-words-slice-h100.json); the products add up per quad of columns
    in registers and the row sums are taken once, at the end (a reduction over the program's threads each step
    cost shuffles and a barrier)."""
    QUADS: tl.constexpr = BLOCK_K // 4
    first = tl.program_id(0).to(tl.int64) * BLOCK_N
    rn = first + tl.arange(0, BLOCK_N)
    rq = tl.arange(0, QUADS)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rq[None, :]
    s_row = s_ptr + (first // GROUP_N) * stride_sn
    if EVEN_K:
        v = tl.load(w_ptrs)
    else:
        v = tl.load(w_ptrs, mask=4 * rq[None, :] < K, other=0)
    pdl_release(PDL)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, QUADS), tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            v_next = tl.load(w_ptrs + k // 4)
        else:
            v_next = tl.load(w_ptrs + k // 4, mask=4 * rq[None, :] + k < K, other=0)
        acc = add_quad_products(acc, v, x_ptr, s_row, k - BLOCK_K, rq, K, GROUP_K, EVEN_K, NATIVE)
        v = v_next
    acc = add_quad_products(acc, v, x_ptr, s_row, (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K, rq, K, GROUP_K, EVEN_K,
                            NATIVE)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))


def block_k(k: int) -> int:
    """K columns a step for an input width k: the largest of 1024, 512, 256 that divides k, else steps of 256, the
    last one masked (a width below 256: one masked step). At SmolLM2's draft head (K 576) on an H100 three 256-wide
    steps took 6.0 us against 7.7 for one masked step of 1024 (bench/draft_head_probe.py --sweep,
    2026-12-07-draft-head-sweep-h100.json); DeepSeek-V3's widths all divide 512 or 1024."""
    for bk in (1024, 512, 256):
        if k % bk == 0:
            return bk
    return 256 if k > 256 else triton.next_power_of_2(k)


def supported(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
              fmt: BlockFP8, block_n: int | None = None) -> bool:
    """What the kernel takes: one contiguous bf16 / fp16 row, a contiguous e4m3 weight whose rows split into
    programs inside one scale row each (``block_n`` divides bn and N), read as words of four (K and bk multiples of 4),
    fp32 scales, a bias of x's dtype."""
    bn = BLOCK_N if block_n is None else block_n
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and scale_inv.dtype == torch.float32
            and x.shape[1] == weight.shape[1] and weight.shape[0] % bn == 0 and fmt.block_n % bn == 0
            and weight.shape[1] % 4 == 0 and fmt.block_k % 4 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.stride(-1) == 1)))


def block_fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
                          fmt: BlockFP8, block_n: int | None = None, block_k_: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """x [1, K] (bf16 / fp16) @ (weight e4m3 [N, K] with scale_inv [ceil(N/bn), ceil(K/bk)])^T (+ bias) -> [1, N]
    in x's dtype; what it does not take goes to the dequantized reference. ``block_n`` / ``block_k_`` /
    ``num_warps``: another launch (bench/fp8_gemm_tiles_probe.py --gemv)."""
    bn = BLOCK_N if block_n is None else block_n
    if not supported(x, weight, scale_inv, bias, fmt, bn):
        return block_fp8_linear_reference(x, weight, scale_inv, bias, fmt)
    n, k = weight.shape
    bk = block_k(k) if block_k_ is None else block_k_
    scale_inv = scale_inv.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(n // bn,)](
        x, weight.view(torch.int32), scale_inv, bias if bias is not None else y, y, k, weight.stride(0) // 4,
        scale_inv.stride(0),
        GROUP_N=fmt.block_n, GROUP_K=fmt.block_k, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        HAS_BIAS=bias is not None, NATIVE=not _INTERPRET,
        num_warps=warps(bn, bk) if num_warps is None else num_warps, **pdl_launch())
    return y
