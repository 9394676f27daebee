"""Decode-sized matmuls y = x W^T as Triton kernels streaming W once (GPU): the fast set's ``matmul``.

Plain reference: ``torch.nn.functional.linear`` (cuBLAS), which also takes every case a kernel here
does not fit.

``decode_linear`` is the fast set's matmul. A batch-1 decode step's one row of x goes through
``_gemv_kernel`` (no tensor cores: a program per 4 outputs, [4, 2048] weight tiles double-buffered in
registers, fp32 sums), launched with programmatic dependent launch where the GPU has it (``pdl.py``: the
first weight tile is read while the kernel before still runs). On an H200, 32 layers of Llama-3-8B GEMVs
with the small kernels between them took 3.76 ms this way against 4.09 with cuBLAS, 3.50 with PDL
(bench/pdl_gemv_probe.py, bench/results/2026-12-03-pdl-gemv-probe-h200.json; o_proj 10.5 vs 13.3 us,
qkv 15.1 vs 16.5). 2..64 rows (decode batches, speculative verifies) go through ``_decode_gemm_kernel``
(tensor cores, operands swapped so the weight's rows fill the MMA, PDL where on): in the same emulated
step at 16 / 64 rows 3.90 / 4.22 ms against cuBLAS's 4.32 / 4.46
(2026-12-03-pdl-gemv-probe-tiles-h200.json), and through the engine 4.61 / 5.17 ms per 8B decode step at
batch 16 / 64 against 4.91 / 5.35 (2026-12-03-decode-rows-gemm-ab-h200.json). Where the output tiles alone
would leave half the GPU idle (o_proj and down_proj: 64 tiles of 64 on 132 SMs) K is split in two and the
tile's last program adds the halves: 5.02 against 5.19 ms per batch-64 step, 4.55 against 4.58 at batch 16
(2026-12-03-decode-rows-split-k-argmax-ab-h200.json). More rows (prefill, mixed batches) stay cuBLAS.

The same kernel finishes the op after two matmuls in its epilogue, on the fp32 sums: ``decode_qkv_rope`` (the
qkv projection's tiles hold rotate-half partners, RoPE applied) and ``decode_gate_up_silu`` (gate rows and their
up rows, silu(gate) * up stored), the fast set's ``Kernels.qkv_rope`` / ``gate_up_act``: 64 kernels fewer a
Llama-3-8B step, 0.5-1 % faster at 2..64 rows through the engine (2026-12-04-decode-gemm-epilogues-ab-h200.json).
Stream-K (the tiles' K steps shared evenly over every multiprocessor, for qkv's 96 tiles on 132) was slower
and is not here (2026-12-04-decode-gemm-streamk-h200.json). ``GEMV_EPILOGUES`` (on) has the one-row GEMV
finish them too.

A small model's matmuls (SmolLM2: 576 wide) are bound by latency, not by streaming: narrower blocks with more
K splits were slower (2026-12-05-decode-gemm-narrow-tiles-ab-smollm2-h100.json); for 1024 < K <= 2048 at up to
16 rows the GEMM takes all of K in one masked tile whose weights it reads before the PDL wait (``ONE_TILE``,
``decode_gemm_tile``).

``gemv_triton`` takes one row (the GEMV at 2-8 rows was 1.5-3x slower than cuBLAS at 2-4 rows of the 8B shapes on
an H200, 2026-12-03-pdl-gemv-probe-rows-h200.json, and 3.4-4.2x slower than the decode GEMM at SmolLM2's 8-row
verify, 2026-12-06-verify-kernel-marginals-smollm2-h100.json; taken out). An earlier [16-row, 16-output]
tensor-core kernel, a split-K variant and a per-shape tuner that timed them against cuBLAS at engine construction
were removed: the tuner gave 4.536 against 4.540 ms per 8B batch-1 step for 8 s more start-up
(2026-12-02-decode-engine-tuned-matmuls-h200.json), and the swapped-operand GEMM replaced the kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .arrival_counters import arrival_counters
from .pdl import pdl_launch, pdl_release, pdl_wait

# The GEMV takes one row. At 2-8 rows a row at a time against its tile in registers (c357932) was 3.4-4.2x slower
# than the decode GEMM at 8 rows on SmolLM2's shapes (8.3 / 8.2 / 10.5 / 16.1 against 2.5 / 2.3 / 3.4 / 3.9 us, H100:
# bench/results/2026-12-06-verify-kernel-marginals-smollm2-h100.json) and was taken out.
EPILOGUE_PLAIN, EPILOGUE_SILU, EPILOGUE_ROPE = 0, 1, 2
# One row (a batch-1 decode step, a draft's chain step) with RoPE / SiLU-and-mul in the GEMV's epilogue, as the
# decode GEMM finishes them for 2..64 rows: two kernels fewer a layer, the same tile. On the H200 SmolLM2's plain
# step took 506 / 500 us of GPU time with it against 537 / 538 without, the draft's chain 256 vs 261 us
# (bench/results/2026-12-05-spec-defaults-ab-smollm2-h200.json); on the 8B shape at batch 1 no difference beyond
# the spread (4.062 / 4.064 ms a step with it, 4.039 / 4.041 without: 2026-12-05-prefill-graphs-ab-smollm2-h200.json;
# the A/B: --set models.layers.linear_triton.GEMV_EPILOGUES=False). Off: one row runs the GEMV, then rope_triton /
# silu_and_mul_triton.
GEMV_EPILOGUES = True
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter mis-multiplies bf16 matrices


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, inv_ptr, K, INTER, ROPE_WIDTH, stride_wn, stride_ym,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    """No tensor cores: a program per BLOCK_N outputs multiplies its [BLOCK_N, BLOCK_K] tiles of W with
    the one row of x in fp32 registers, the next tile loaded while one is multiplied (EVEN_K: BLOCK_K
    divides K, else the last tile is masked). Under PDL (``pdl.py``) the first weight tile is loaded before
    waiting on the kernel before. It may finish the next op in its epilogue as the decode GEMM's does
    (``_tile_rows`` / ``_store_tile``: SwiGLU over gate and up rows, or RoPE over rotate-half partners)."""
    if EPILOGUE == 0:
        rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rn, is_rope, first = _tile_rows(tl.program_id(0), BLOCK_N // 2, BLOCK_N, EPILOGUE, INTER, ROPE_WIDTH,
                                        HEAD_DIM)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    last = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=rk[None, :] < K, other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w_next = tl.load(w_ptrs + k)
        else:
            w_next = tl.load(w_ptrs + k, mask=rk[None, :] + k < K, other=0.0)
        x = tl.load(x_ptr + (k - BLOCK_K) + rk).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        w = w_next
    if EVEN_K:
        x = tl.load(x_ptr + last + rk).to(tl.float32)
    else:
        x = tl.load(x_ptr + last + rk, mask=rk + last < K, other=0.0).to(tl.float32)
    acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if EPILOGUE == 0:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))
    else:
        _store_tile(tl.reshape(acc, (BLOCK_N, 1)), rn, is_rope, first, tl.arange(0, 1), 1, y_ptr, b_ptr, pos_ptr,
                    inv_ptr, stride_ym, BLOCK_N // 2, 1, HAS_BIAS, EPILOGUE, HEAD_DIM)


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int) -> bool:
    return not (x.shape[0] != 1 or weight.shape[0] % block_n or x.stride(-1) != 1 or weight.stride(-1) != 1
                or x.dtype != weight.dtype or (bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1)))


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, block_n: int,
                 block_k: int, num_warps: int, epilogue: int = EPILOGUE_PLAIN, inter: int = 0,
                 rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    k = x.shape[1]
    positions, inv_freq, rope_width = rope if rope is not None else (weight, weight, 0)
    if rope is not None:
        positions = positions.contiguous()  # read at unit stride (a no-op for the engine's buffers)
    _gemv_kernel[(weight.shape[0] // block_n,)](
        x, weight, bias if bias is not None else weight, y, positions, inv_freq, k, inter, rope_width,
        weight.stride(0), y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
        HEAD_DIM=2 * inv_freq.shape[0] if rope is not None else 2, num_warps=num_warps, **pdl_launch())
    return y


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 4,
                block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] -> [1, N] with ``_gemv_kernel``; F.linear otherwise (other row counts too)."""
    if not _gemv_fits(x, weight, bias, block_n):
        return F.linear(x, weight, bias)
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch_gemv(x, weight, bias, y, block_n, block_k, num_warps)


def gemv_tile(k: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) of the decode GEMV for an input width k. From a sweep of 8 tiles over
    the Llama-3-8B shapes on an H200 (bench/pdl_gemv_probe.py): 4 x 2048 with 8 warps within 2 % of each
    shape's best; 4 x 1024 with 4 warps where 2048 does not divide k; a narrower k (SmolLM2's 576) in
    one masked tile; a small model's longer widths (1024 < k < 2048: SmolLM2's down_proj 1536, an EAGLE3
    draft's qkv 1152 and fc 1728) in one masked tile too, ``GEMV_WIDE_TILE``."""
    if GEMV_WIDE_TILE is not None and 1024 < k < 2048:
        return GEMV_WIDE_TILE[0], triton.next_power_of_2(k), GEMV_WIDE_TILE[1]
    for block_k, warps in ((2048, 8), (1024, 4), (512, 4), (256, 4)):
        if k % block_k == 0:
            return 4, block_k, warps
    block_n, block_k, warps = GEMV_NARROW_TILE
    return block_n, min(block_k, triton.next_power_of_2(k)), warps


# (block_n, block_k at most, num_warps) of the GEMV where no power of two from 256 divides k (SmolLM2's 576): one
# masked tile. A 256-wide K loop, (4, 256, 4), the fastest one-row cut back to back in bench/decode_rows_probe.py, made
# SmolLM2's plain step 629.2 us of GPU time against 510.2 in a generate (2026-12-06-matmul-cuts-k576-kernels-smollm2-h100.json).
GEMV_NARROW_TILE = (4, 1024, 4)
# (block_n, num_warps) of the GEMV's one masked tile for 1024 < K < 2048. At one row on an H100 (32 layers' weights
# back to back, bench/decode_rows_probe.py --rows-gemv) all of SmolLM2's down_proj (1536) in one tile with 8 warps
# took 1.85-1.91 us against 2.90 with the table's three 512-wide steps, the draft's fc (1728) 1.62-2.22 against 2.29
# (2026-12-06-rows-gemv-probe-smollm2-h100.json). In a generate SmolLM2's plain step took 461-470 us of GPU time
# against 526, the draft's chain 201-205 against 213; through the engine plain decoding 2 049-2 053 / 2 032-2 035 tok/s
# (MT-bench / HumanEval) against 1 799-1 848 / 1 801-1 826, chain-7 3 222-3 224 / 3 558-3 559 against 3 175-3 187 /
# 3 498-3 512 (alternated twice in one H100 lease, 2026-12-06-gemv-wide-tile-smollm2-h100.json). None: the table
# below for every K (the A/B: --set models.layers.linear_triton.GEMV_WIDE_TILE=None).
GEMV_WIDE_TILE: tuple[int, int] | None = (4, 8)


@triton.jit
def _tile_rows(pid, HALF: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr, INTER, ROPE_WIDTH,
               HEAD_DIM: tl.constexpr):
    """The weight rows (= output features) of program ``pid``'s tile, as two halves of HALF: EPILOGUE_PLAIN
    BLOCK_N consecutive rows; EPILOGUE_SILU gate rows pid*HALF.. and their up rows INTER further on;
    EPILOGUE_ROPE, for tiles inside the first ROPE_WIDTH features (q and k heads of HEAD_DIM), rotate-half
    partners d and d + HEAD_DIM/2 of one head, past them (v) BLOCK_N consecutive rows.
    -> (rows, is_rope, the first row)"""
    r = tl.arange(0, BLOCK_N)
    if EPILOGUE == 1:
        base = pid * HALF
        offset = INTER
        rope = False
    elif EPILOGUE == 2:
        per_head = HEAD_DIM // 2 // HALF
        rope_tiles = ROPE_WIDTH // HEAD_DIM * per_head
        rope = pid < rope_tiles
        if rope:
            base = pid // per_head * HEAD_DIM + pid % per_head * HALF
            offset = HEAD_DIM // 2
        else:
            base = ROPE_WIDTH + (pid - rope_tiles) * BLOCK_N
            offset = HALF
    else:
        base = pid * BLOCK_N
        offset = HALF
        rope = False
    base = base.to(tl.int64)
    return base + (r // HALF) * offset + r % HALF, rope, base


@triton.jit
def _halves(acc, HALF: tl.constexpr, BLOCK_M: tl.constexpr):
    """[2*HALF, BLOCK_M] -> its first and second HALF rows."""
    return tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))


@triton.jit
def _store_rows(y_ptr, values, cols, rm, rows, stride_ym):
    """values [C, BLOCK_M] (fp32) into y's columns ``cols`` of the rows where ``rows``."""
    tl.store(y_ptr + rm[None, :] * stride_ym + cols[:, None], values.to(y_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _store_tile(total, rn, is_rope, first, rm, M, y_ptr, b_ptr, pos_ptr, inv_ptr, stride_ym, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store a tile's fp32 sums [BLOCK_N, BLOCK_M] (bias added) as y^T: as they are; EPILOGUE_SILU: silu(gate)
    * up into y's columns of the gate rows; EPILOGUE_ROPE (``is_rope``): each pair (d from ``first``, d +
    HEAD_DIM/2) rotated by its row's position (positions in ``pos``, frequencies in ``inv``: fp32 math, as
    ``rope_triton``), into the pair's columns."""
    rows = rm[None, :] < M
    if HAS_BIAS:
        total += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    if EPILOGUE == 1:
        gate, up = _halves(total, HALF, BLOCK_M)
        _store_rows(y_ptr, gate / (1.0 + tl.exp(-gate)) * up, first + tl.arange(0, HALF), rm, rows, stride_ym)
    elif EPILOGUE == 2:
        if is_rope:
            x1, x2 = _halves(total, HALF, BLOCK_M)
            lo = tl.arange(0, HALF)
            pos = tl.load(pos_ptr + rm, mask=rm < M, other=0).to(tl.float32)
            freqs = tl.load(inv_ptr + first % HEAD_DIM + lo)[:, None] * pos[None, :]
            c = tl.cos(freqs)
            s = tl.sin(freqs)
            _store_rows(y_ptr, x1 * c - x2 * s, first + lo, rm, rows, stride_ym)
            _store_rows(y_ptr, x2 * c + x1 * s, first + HEAD_DIM // 2 + lo, rm, rows, stride_ym)
        else:
            _store_rows(y_ptr, total, rn, rm, rows, stride_ym)
    else:
        _store_rows(y_ptr, total, rn, rm, rows, stride_ym)


@triton.jit
def _weight_slices(w_ptr, first, rn, stride_wn, K, S: tl.constexpr, SLICE_K: tl.constexpr):
    """S slices of SLICE_K columns of the weight rows ``rn`` from column ``first`` (past K: 0) -> [S, BLOCK_N, SLICE_K]."""
    cols = first + tl.arange(0, S)[:, None, None] * SLICE_K + tl.arange(0, SLICE_K)[None, None, :]
    return tl.load(w_ptr + rn[None, :, None] * stride_wn + cols, mask=cols < K, other=0.0)


@triton.jit
def _row_slices(x_ptr, first, rm, M, stride_xm, K, S: tl.constexpr, SLICE_K: tl.constexpr):
    """The same columns of x's rows ``rm`` (past M or K: 0), transposed -> [S, SLICE_K, BLOCK_M]."""
    cols = first + tl.arange(0, S)[:, None, None] * SLICE_K + tl.arange(0, SLICE_K)[None, :, None]
    rows = rm[None, None, :]
    return tl.load(x_ptr + rows * stride_xm + cols, mask=(cols < K) & (rows < M), other=0.0)


@triton.jit
def _sliced_tile_dot(x_ptr, w_ptr, rn, rm, M, K, stride_xm, stride_wn, SLICES: tl.constexpr,
                     TAIL_SLICES: tl.constexpr, SLICE_K: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    """The one-tile product W_tile x^T [BLOCK_N, BLOCK_M] over all of K, the weights read before the PDL wait as
    SLICES + TAIL_SLICES slices of SLICE_K columns, multiplied slice by slice in two batched dots and summed (its
    dependents released by the caller, after the dots: ``late_release``)."""
    w = _weight_slices(w_ptr, 0, rn, stride_wn, K, SLICES, SLICE_K)
    wt = _weight_slices(w_ptr, SLICES * SLICE_K, rn, stride_wn, K, TAIL_SLICES, SLICE_K)
    pdl_wait(PDL)
    x = _row_slices(x_ptr, 0, rm, M, stride_xm, K, SLICES, SLICE_K)
    xt = _row_slices(x_ptr, SLICES * SLICE_K, rm, M, stride_xm, K, TAIL_SLICES, SLICE_K)
    return tl.sum(_dot(w, x, DOT_FP32), axis=0) + tl.sum(_dot(wt, xt, DOT_FP32), axis=0)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b, fp32 sums (DOT_FP32: operands made fp32 first, for the CPU interpreter)."""
    if DOT_FP32:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        product = tl.dot(a, b)
    return product


@triton.jit(do_not_specialize=["M"])  # counts that change call to call: one compile for all
def _decode_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, pos_ptr, inv_ptr, M, N, K, INTER, ROPE_WIDTH,
                        stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT_FP32: tl.constexpr, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr, ONE_TILE: tl.constexpr,
                        PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
                        SLICES: tl.constexpr = 0, TAIL_SLICES: tl.constexpr = 1, SLICE_K: tl.constexpr = 64,
                        LATE_RELEASE: tl.constexpr = False):
    """A decode batch's matmul on tensor cores with the operands swapped: y^T [BLOCK_N, BLOCK_M] = W_tile x^T,
    so BLOCK_N rows of W fill the MMA's wide side and the batch's M <= BLOCK_M rows of x its narrow side; a
    program per BLOCK_N outputs, K in BLOCK_K steps (Triton pipelines the loads), fp32 sums. Under PDL it
    waits before its first load: what it gains is the launch overlap (its first weight tile held in
    registers before the wait, as the GEMV does, cost Triton's pipelining and was 2-3x slower; its first
    tiles prefetched into L2 before the wait gained nothing: 2026-12-03-pdl-gemv-probe-{pre,pf}-h200.json;
    its first K step's tile alone loaded before the wait, the loop pipelined after, 1 % slower at 16 rows and
    out of shared memory at 64: -peeled-).

    The tile's rows need not be consecutive (``_tile_rows``): the epilogue can then finish the next small op
    on the fp32 sums instead of a kernel after this one — SwiGLU's silu(gate) * up (EPILOGUE_SILU: a tile of
    gate rows and their up rows, y is [M, INTER]) or q / k's RoPE (EPILOGUE_ROPE: a tile of rotate-half
    partners; ``pos`` / ``inv``: the rows' positions and the rotary frequencies).

    ONE_TILE (K <= BLOCK_K, a small model's widths): the program's whole [BLOCK_N, K] weight tile (K masked to
    the power of two BLOCK_K) is loaded before the PDL wait, while the kernel before still runs, then x and
    one dot — no K loop to pipeline, so holding the tile costs no overlap (``decode_gemm_tile``).

    SLICES > 0 (with ONE_TILE; SLICE_K divides K): the tile is held as SLICES + TAIL_SLICES slices of SLICE_K
    columns (the tail's slices past K masked) and multiplied in two batched dots whose slices the warps share, the
    slices' sums added after: a warp's MMAs chain over SLICE_K columns of a few slices, not over all of K (576
    masked to 1024: 64 dependent steps of 16) — ``ONE_TILE_SLICES``.

    LATE_RELEASE: the next kernel may launch only once this one's sums are done, not before its wait (``late_release``).

    EVEN_K false (one split): BLOCK_K need not divide K; each step's columns past K are masked (its last).

    SPLIT_K > 1 (few output tiles: more programs than tiles keep more of the GPU streaming weights): program
    (n, s) sums the s-th of SPLIT_K equal K ranges and stores its fp32 sums in ``ws`` [SPLIT_K, N, BLOCK_M];
    the tile's last program to finish (a per-tile arrival count in ``cnt``, which it resets to 0) adds the
    SPLIT_K partials in split order — the same bits whichever finishes last — and stores y."""
    HALF: tl.constexpr = BLOCK_N // 2
    rn, is_rope, first = _tile_rows(tl.program_id(0), HALF, BLOCK_N, EPILOGUE, INTER, ROPE_WIDTH, HEAD_DIM)
    rm = tl.arange(0, BLOCK_M)
    rows = rm[None, :] < M
    if ONE_TILE and SLICES > 0:  # all of K as slices, two batched dots (the tail's slices past K masked)
        acc = _sliced_tile_dot(x_ptr, w_ptr, rn, rm, M, K, stride_xm, stride_wn, SLICES, TAIL_SLICES, SLICE_K,
                               DOT_FP32, PDL)
    elif ONE_TILE:  # all of K in one (masked) tile: the weights read before the wait, as the GEMV does
        rk = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=rk[None, :] < K, other=0.0)
        if not LATE_RELEASE:
            pdl_release(PDL)
        pdl_wait(PDL)
        x = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=rows & (rk[:, None] < K), other=0.0)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32))
        else:
            acc = tl.dot(w, x)
    else:
        if PREFETCH_LINES > 0:  # the program's weight slice asked of L2 (a hint: no load, nothing held)
            k0 = tl.program_id(1) * (K // SPLIT_K)
            li = tl.arange(0, PREFETCH_LINES) * LINE
            col = k0 + tl.where(li < K // SPLIT_K, li, 0)
            tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n mov.u32 $0, 0;", constraints="=r,l",
                                      args=[w_ptr + rn[:, None] * stride_wn + col[None, :]], dtype=tl.int32,
                                      is_pure=False, pack=1)
        if not LATE_RELEASE:
            pdl_release(PDL)
        pdl_wait(PDL)
        k_range = K // SPLIT_K
        rk = tl.program_id(1) * k_range + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k in range(0, k_range, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=rows, other=0.0)
            else:  # one split, its last step past K masked
                w = tl.load(w_ptrs, mask=rk[None, :] + k < K, other=0.0)
                x = tl.load(x_ptrs, mask=rows & (rk[:, None] + k < K), other=0.0)
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
            else:
                acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if LATE_RELEASE:
        pdl_release(PDL)
    if SPLIT_K == 1:
        _store_tile(acc, rn, is_rope, first, rm, M, y_ptr, b_ptr, pos_ptr, inv_ptr, stride_ym, HALF, BLOCK_M,
                    HAS_BIAS, EPILOGUE, HEAD_DIM)
    else:
        part = ws_ptr + rn[:, None] * BLOCK_M + rm[None, :]
        tl.store(part + tl.program_id(1) * N * BLOCK_M, acc)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(part + split * N * BLOCK_M, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
            _store_tile(total, rn, is_rope, first, rm, M, y_ptr, b_ptr, pos_ptr, inv_ptr, stride_ym, HALF, BLOCK_M,
                        HAS_BIAS, EPILOGUE, HEAD_DIM)


GEMM_ROWS = 64
# K in (ONE_TILE_K_MIN, ONE_TILE_K_MAX] (and at most 16 rows): one masked tile of all of K, its weights read
# before the PDL wait (``ONE_TILE``); ONE_TILE_K_MAX = 0: the K loop for every shape (the A/B: --set
# models.layers.linear_triton.ONE_TILE_K_MAX=0). Below ONE_TILE_K_MIN the loop's table was as fast or faster.
ONE_TILE_K_MIN = 1024
ONE_TILE_K_MAX = 2048
# A one-tile program's outputs. One tile at SmolLM2's K = 576 too (ONE_TILE_K_MIN = 512) made its chain-7 verify graph
# 768.8 us with 16 outputs, 685.8 with 32, against 670.8 with the K loop (a generate's graphs, alternated twice in one
# H100 lease: bench/results/2026-12-06-matmul-cuts-k576-kernels-smollm2-h100.json).
ONE_TILE_BLOCK_N = 16
# A decode GEMM of at most 16 rows over K <= L2_PREFETCH_K_MAX (a small model's widths: SmolLM2's 576 and 1536)
# asks L2 for its program's whole [BLOCK_N, K] weight slice before the PDL wait — one prefetch instruction a
# 128-byte line, nothing held in registers, so Triton's pipelined K loop stays as it is — and the loop after the
# wait reads L2 while the kernel before still runs. SmolLM2's 8-row chain verify took 747.9 us of GPU time with
# it against 789.8 without (alternated twice in one H100 lease; the one-row plain step 511.5 / 509.2, which it
# does not touch), the same tokens (2026-12-05-l2-prefetch-verify-probes-smollm2-h100.json). A larger model's
# K (4096 and up) streams its weights anyway and is left as it was. 0: off (the A/B: --set
# models.layers.linear_triton.L2_PREFETCH_K_MAX=0). Narrower or deeper K-loop tiles at <= 16 rows did not pay
# in the same lease ((32, 64, 6, 4) 887.7 us, (64, 64, 9, 4) 781.9 us) and are not here.
L2_PREFETCH_K_MAX = 2048
# A decode GEMM of up to GEMM_ROWS rows whose whole weight is at most this many bytes asks L2 for its program's
# weight slice before the PDL wait too, whatever K: Llama-3-8B's o_proj (33.5 MB) follows the decode attention,
# which at batch 64 and 163 tokens reads its 42 MB of K/V a layer at about half the copy bandwidth (~19 us a
# layer, latency-bound), so the o_proj programs launched beside it could fill L2 from the idle half, and their
# loop read L2 after the wait (the o_proj reached 66 % of the copy bandwidth at 64 rows:
# 2026-12-04-decode-rows-probe-gemm-h200.json). The bigger matmuls (qkv 50 MB, gate_up 235 MB, down 117 MB)
# would only evict each other. Through the engine on an H100 (alternated twice with the defaults in one lease,
# 2026-12-06-o-proj-l2-prefetch-late-release-8b-h100.json) it made batch 64 slower, 6.44 against 6.38 ms a step,
# and batch 16 faster, 5.64 against 5.68. 0: off (the A/B: --set
# models.layers.linear_triton.L2_PREFETCH_WEIGHT_BYTES=40000000); not timed on an H200.
L2_PREFETCH_WEIGHT_BYTES = 0
LINE_BYTES = 128
# A small model's K that 128 does not divide (SmolLM2's 576) at up to 16 rows: 128-wide K steps, the last masked (4.5
# for 576), 4 stages, instead of 64-wide whole steps. Alone at 8 rows on an H100 (32 layers' weights back to back,
# bench/decode_rows_probe.py): o 2.24 against 2.41 us, gate_up 3.14 against 3.40, qkv 2.69 against 2.54, within
# spreads of 5-25 % (2026-12-06-decode-gemm-masked-k-steps-smollm2-h100.json). In the graphs it lost: the chain-7
# verify 720.4 us against 710.5, chain-11's 785.7 against 756.0 (alternated twice in one H100 lease,
# 2026-12-06-masked-k-steps-graphs-longer-chains-smollm2-h100.json). Off; the A/B: --set
# models.layers.linear_triton.MASKED_K_STEPS=True.
MASKED_K_STEPS = False

# The one-tile GEMM's tile as slices of this many columns where they divide K, multiplied in two batched dots by
# this many warps (``_sliced_tile_dot``): SmolLM2's 1536 = 16 + 8 slices of 64 instead of one dot over 2048 masked
# columns, an EAGLE3 draft's qkv 1152 = 16 + 2, its fc 1728 = 16 + 16 (5 masked). Compiled for sm_90 with the GPU
# machine's Triton 3.6 (bench/hopper_ptx.py, 2026-12-06-hopper-ptx-one-tile-triton36-cpu.json) a warp chains 24 MMAs
# at 1536 with 8 warps, against the whole tile's 128 (no spills either way). Timed on an H100
# (2026-12-06-sliced-one-tile-late-release-smollm2-h100.json): alone at 8 rows down_proj 3.30 against 3.88 us
# (fc 4.95 against 4.05: slower); in the graphs, with the kernel's dependents launched after its dots, SmolLM2's
# chain-7 verify 629.8 us against 683.0 and a round 834.2 against 886.2 (the plain step the same, 464.9 / 465.2);
# through the engine a round 0.914 / 0.948 ms against 0.948 / 0.984 (MT-bench / HumanEval, T=0). 8 warps and the
# slices at K 576 too (ONE_TILE_K_MIN=512) were slower in the graphs (1160.2 / 737.9 us). None: one dot over the
# whole masked tile (the A/B: --set models.layers.linear_triton.ONE_TILE_SLICES=None).
ONE_TILE_SLICES: tuple[int, int] | None = (64, 4)
# Decode GEMMs of 2..LATE_RELEASE_ROWS rows let the next kernel launch only after their sums (``late_release``; the
# sliced one tile always does); 0: before their wait, as the GEMV and the other kernels here. Every kernel releasing
# late made SmolLM2's plain step slower (its GEMV's early weight read needs the early launch: critical path 416.1
# against 369.9 us) and its verify too (594.7 against 581.6), but in that run the verify's 8-row qkv and gate_up were
# faster (2.94 / 2.94 against 3.30 / 3.16 us; 2026-12-06-sliced-one-tile-late-release-smollm2-h100.json). Alone
# (H100, alternated twice in one lease) 16 made SmolLM2's chain-7 verify graph slower, 682.0 against 633.8 us
# (2026-12-06-late-release-rows-probe-smollm2-h100.json), and 64 left the 8B step at batch 16 / 64 as it was
# (2026-12-06-o-proj-l2-prefetch-late-release-8b-h100.json). The A/B: --set
# models.layers.linear_triton.LATE_RELEASE_ROWS=16.
LATE_RELEASE_ROWS = 0


# The sliced tile only where one wave of 16-output programs holds the whole matmul (at most 132 of them on an
# H100 / H200), as where it was timed (SmolLM2's and its draft's 576 and 960 outputs: latency-bound); wider ones keep
# the whole tile (DeepSeek-V3's q_b_proj, 24 576 outputs at K 1536, not timed sliced).
ONE_TILE_SLICES_MAX_N = 2048


def _slice_k(n: int, k: int) -> int:
    """The sliced one tile's slice width for an [n, k] weight (``ONE_TILE_SLICES``), 0 where it is off, the slice
    does not divide k or n is over ``ONE_TILE_SLICES_MAX_N``."""
    if ONE_TILE_SLICES is None or k % ONE_TILE_SLICES[0] or n > ONE_TILE_SLICES_MAX_N:
        return 0
    return ONE_TILE_SLICES[0]


def late_release(m: int, slices: int) -> bool:
    """Whether the decode GEMM of m rows lets its dependents launch only after its sums (``LATE_RELEASE_ROWS``).
    The sliced one tile always does: released before its wait, as the other kernels here are, it made SmolLM2's
    chain-7 verify graph slower than the whole tile (734.6 against 677.7 us; its 8-row down_proj alone 5.49 against
    6.71 us with PDL off, yet every matmul of the layer got slower on the critical path, not only down_proj);
    released after its dots, 629.8 (H100, alternated twice; 2026-12-06-sliced-one-tile-late-release-smollm2-h100.json)."""
    return slices > 0 or m <= LATE_RELEASE_ROWS


def prefetch_lines(m: int, n: int, k: int, splits: int, block_k: int, element_size: int) -> int:
    """128-byte lines a row of the decode GEMM's program asks of L2 before its PDL wait (a power of two covering
    its K range, the rest masked), 0 for none: a small model's K (at most 16 rows, K <= ``L2_PREFETCH_K_MAX``)
    or a weight that fits ``L2_PREFETCH_WEIGHT_BYTES`` (at most GEMM_ROWS rows); never for the one tile (its
    weights are loaded before the wait)."""
    if block_k >= k or m > GEMM_ROWS:
        return 0
    small_k = m <= 16 and k <= L2_PREFETCH_K_MAX
    fits_l2 = n * k * element_size <= L2_PREFETCH_WEIGHT_BYTES
    if not (small_k or fits_l2):
        return 0
    return triton.next_power_of_2(-(-(k // splits) * element_size // LINE_BYTES))


def one_tile_slices(k: int, slice_k: int) -> tuple[int, int]:
    """(slices, tail slices) of the sliced one-tile GEMM over k columns (slice_k divides k): the largest power of
    two of whole slices, then the rest rounded up to a power of two (masked past k; one empty slice if none)."""
    count = k // slice_k
    head = 1 << (count.bit_length() - 1)
    return head, triton.next_power_of_2(max(1, count - head))


def decode_gemm_tile(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_stages, num_warps) of ``_decode_gemm_kernel`` for m rows of x, an [n, k]
    weight; None where it does not fit (more than GEMM_ROWS rows, n not a multiple of the block, k outside
    the one-tile range not a multiple of 64). From a sweep of 8 tiles over the Llama-3-8B shapes at 16 and 64 rows on an H200
    (bench/pdl_gemv_probe.py, 2026-12-03-pdl-gemv-probe-pf-h200.json): 64 x 128, 6 stages, best or within
    1 % everywhere but gate_up (28672 outputs) above 16 rows, where 128 x 128 with 4 stages is (62.0 vs
    65.0 us). A sweep of 15 tiles (2026-12-03-pdl-gemv-probe-tiles-h200.json) found no better table under PDL,
    and its best tiles without PDL were slower through the engine (2026-12-03-decode-rows-gemm-tiles-ab-h200.json).

    A small model's longer matmuls (ONE_TILE_K_MIN < K <= ONE_TILE_K_MAX: SmolLM2's down_proj, 1536, an EAGLE3
    draft's fc, 1728, and qkv, 1152) at up to 16 rows take one K tile of 16 outputs: (16, next power of two of
    k, 1 stage, 4 warps). At 8 rows on an H100 (2026-12-05-decode-gemm-one-tile-smollm2-h100.json) that took
    3.92 / 3.97 us for down / fc against 4.16-4.31 / 5.18 with the loop (8 warps: 5.07 / 5.06), while at K 576
    the loop's (64, 64) stayed ahead (qkv 2.52 vs 2.76, o 2.35 vs 2.44, gate_up 3.59 vs 4.33). These widths
    are latency-bound, not streaming-bound: narrower blocks did not help and K splits took 1.5-2x as long
    (2026-12-05-decode-gemm-narrow-tiles-ab-smollm2-h100.json). Nor do 32-wide tiles above 16 rows fill the GPU
    better on the 8B shape: its qkv (96 programs of 64 outputs on 132 multiprocessors) took 34.0 us at 64 rows
    in 32-wide tiles against 21.3, the 64-row step 9.68 against 6.51 ms (H100,
    2026-12-07-decode-narrow-tile-heads-first-ab-8b-h100.json)."""
    if not 1 <= m <= GEMM_ROWS:
        return None
    if m <= 16 and ONE_TILE_K_MIN < k <= ONE_TILE_K_MAX and n % ONE_TILE_BLOCK_N == 0:
        warps = ONE_TILE_SLICES[1] if ONE_TILE_SLICES is not None and _slice_k(n, k) else 4
        return ONE_TILE_BLOCK_N, triton.next_power_of_2(k), 1, warps
    if MASKED_K_STEPS and m <= 16 and k % 128 and k <= L2_PREFETCH_K_MAX and n % 64 == 0:
        return 64, 128, 4, 4
    block_k = 128 if k % 128 == 0 else 64
    block_n = 128 if m > 16 and n >= 16384 else 64
    if k % block_k or n % block_n:
        return None
    return block_n, block_k, (4 if block_n == 128 else 6), 4


SPLIT_K_MAX = 2


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def decode_gemm_splits(n: int, k: int, tile: tuple[int, int, int, int], device: torch.device) -> int:
    """K splits of the decode GEMM: 2 where the output tiles alone would leave at least half the GPU's
    multiprocessors idle (Llama-3-8B's o_proj and down_proj: 64 tiles of 64 outputs on 132) and both
    halves of K are whole tiles; else 1."""
    block_n, block_k = tile[0], tile[1]
    tiles = n // block_n
    if SPLIT_K_MAX >= 2 and 2 * tiles <= _multiprocessors(device) and k % (2 * block_k) == 0:
        return 2
    return 1


def _gemm_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               tile: tuple[int, int, int, int] | None) -> bool:
    return not (tile is None or x.stride(-1) != 1 or weight.stride(-1) != 1 or x.dtype != weight.dtype
                or x.dtype not in (torch.bfloat16, torch.float16)
                or (bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1)))


def _launch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                 tile: tuple[int, int, int, int], splits: int | None, epilogue: int = EPILOGUE_PLAIN,
                 inter: int = 0, rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """``_decode_gemm_kernel`` over all of weight's rows into y; ``rope``: (positions, inv_freq, rope width)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, stages, warps = tile
    block_m = max(16, triton.next_power_of_2(m))
    splits = splits or decode_gemm_splits(n, k, tile, x.device)
    assert splits == 1 or k % (block_k * splits) == 0, "split K needs whole K steps"
    counters = arrival_counters(x.device, n // block_n) if splits > 1 else None
    if counters is None:
        splits, counters = 1, weight
    ws = torch.empty((splits, n, block_m), dtype=torch.float32, device=x.device) if splits > 1 else weight
    positions, inv_freq, rope_width = rope if rope is not None else (weight, weight, 0)
    if rope is not None:
        positions = positions.contiguous()  # read at unit stride (a no-op for the engine's buffers)
    line = LINE_BYTES // weight.element_size()  # elements a 128-byte line
    prefetch = 0 if _DOT_FP32 else prefetch_lines(m, n, k, splits, block_k, weight.element_size())
    slice_k = _slice_k(n, k) if block_k >= k else 0
    slices, tail = one_tile_slices(k, slice_k) if slice_k else (0, 1)
    _decode_gemm_kernel[(n // block_n, splits)](
        x, weight, bias if bias is not None else weight, y, ws, counters, positions, inv_freq, m, n, k, inter,
        rope_width, x.stride(0), weight.stride(0), y.stride(0), BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
        SPLIT_K=splits, EVEN_K=k % (block_k * splits) == 0, HAS_BIAS=bias is not None, DOT_FP32=_DOT_FP32, EPILOGUE=epilogue,
        HEAD_DIM=2 * inv_freq.shape[0] if rope is not None else 2, ONE_TILE=block_k >= k,
        PREFETCH_LINES=prefetch, LINE=line, SLICES=slices, TAIL_SLICES=tail, SLICE_K=slice_k or 64,
        LATE_RELEASE=late_release(m, slices), num_stages=stages, num_warps=warps, **pdl_launch())
    return y


def gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tile: tuple[int, int, int, int] | None = None, splits: int | None = None) -> torch.Tensor:
    """x: [m, K] (m <= GEMM_ROWS); weight: [N, K] -> [m, N] with ``_decode_gemm_kernel`` at the tile
    ``decode_gemm_tile`` gives, K split as ``decode_gemm_splits`` says (``tile`` / ``splits``: another cut,
    for benchmarks; its block must divide N, and with splits K); F.linear where no tile fits or for strided rows / mixed or fp32
    dtypes."""
    m, k = x.shape
    n = weight.shape[0]
    tile = tile or decode_gemm_tile(m, n, k)
    if not _gemm_fits(x, weight, bias, tile):
        return F.linear(x, weight, bias)
    assert tile is not None
    return _launch_gemm(x, weight, bias, torch.empty((m, n), dtype=x.dtype, device=x.device), tile, splits)


def _fused_tile(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int, int] | None:
    """The decode GEMM's tile where it takes x with an epilogue (2..GEMM_ROWS rows; one row is the GEMV's)."""
    if x.dim() != 2 or not 2 <= x.shape[0] <= GEMM_ROWS:
        return None
    tile = decode_gemm_tile(x.shape[0], weight.shape[0], x.shape[1])
    return tile if _gemm_fits(x, weight, bias, tile) else None


def decode_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's first half, silu(x W_gate^T) * (x W_up^T), for weight = [gate; up] ([2I, K]) -> [m, I]: for
    2..GEMM_ROWS rows one ``_decode_gemm_kernel`` whose epilogue applies the activation to its fp32 sums
    (no [m, 2I] intermediate, no kernel after it); otherwise ``decode_linear`` then ``silu_and_mul_triton``.
    Plain reference: ``mlp.silu_and_mul(F.linear(x, weight, bias))``."""
    from .silu_mul_triton import silu_and_mul_triton

    inter = weight.shape[0] // 2
    if GEMV_EPILOGUES and x.dim() == 2 and x.shape[0] == 1:
        block_n, block_k, warps = gemv_tile(x.shape[1])
        if _gemv_fits(x, weight, bias, block_n) and inter % (block_n // 2) == 0:
            y = torch.empty((1, inter), dtype=x.dtype, device=x.device)
            return _launch_gemv(x, weight, bias, y, block_n, block_k, warps, EPILOGUE_SILU, inter=inter)
    tile = _fused_tile(x, weight, bias)
    if tile is None:
        return silu_and_mul_triton(decode_linear(x, weight, bias))
    y = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    return _launch_gemm(x, weight, bias, y, tile, None, EPILOGUE_SILU, inter=inter)


def decode_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                    inv_freq: torch.Tensor, q_size: int, kv_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q / k / v projection with q and k rotated (rotate-half RoPE over whole heads of 2 * len(inv_freq)
    dims) -> q [m, q_size], k, v [m, kv_size]: for 2..GEMM_ROWS rows one ``_decode_gemm_kernel`` whose tiles
    of q and k hold rotate-half partners, rotated in its epilogue (no kernel after it); otherwise
    ``decode_linear`` then ``rope_triton``. Plain reference: ``F.linear`` then ``rotary.rope_reference``."""
    from .rope_triton import rope_triton

    head_dim = 2 * inv_freq.shape[0]
    rope_width = q_size + kv_size
    if GEMV_EPILOGUES and x.dim() == 2 and x.shape[0] == 1 and positions.shape[0] == 1:
        block_n, block_k, warps = gemv_tile(x.shape[1])
        if _gemv_fits(x, weight, bias, block_n) and head_dim % block_n == 0 and rope_width % head_dim == 0:
            y = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
            _launch_gemv(x, weight, bias, y, block_n, block_k, warps, EPILOGUE_ROPE, rope=(positions, inv_freq,
                                                                                             rope_width))
            q, k, v = y.split([q_size, kv_size, kv_size], dim=-1)
            return q, k, v
    tile = _fused_tile(x, weight, bias)
    if tile is not None and (head_dim % tile[0] or rope_width % head_dim or positions.shape[0] != x.shape[0]):
        tile = None  # a tile must hold rotate-half partners of one head
    if tile is None:
        q, k, v = decode_linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        n = x.shape[0]
        q_rot, k_rot = rope_triton(positions, q.view(n, -1, head_dim), k.view(n, -1, head_dim), inv_freq)
        return q_rot.view(n, q_size), k_rot.view(n, kv_size), v
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch_gemm(x, weight, bias, y, tile, None, EPILOGUE_ROPE, rope=(positions, inv_freq, rope_width))
    q, k, v = y.split([q_size, kv_size, kv_size], dim=-1)
    return q, k, v


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fast set's matmul: one row of x (a batch-1 decode step) through ``_gemv_kernel`` with the tile
    ``gemv_tile`` gives; 2..GEMM_ROWS rows (decode batches, speculative verifies) through
    ``_decode_gemm_kernel``; F.linear (cuBLAS) for more rows and for what the kernels do not take (an
    output count not a multiple of their block, strided rows, mixed dtypes)."""
    if x.dim() != 2 or x.shape[0] > GEMM_ROWS:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:
        return gemv_triton(x, weight, bias, *gemv_tile(x.shape[-1]))
    return gemm_triton(x, weight, bias)
