"""Decode-sized matmuls y = x W^T as Triton kernels streaming W once (GPU).

Plain reference: ``torch.nn.functional.linear`` (cuBLAS), which also takes every case a kernel here
does not fit.

The fast set's matmul is ``decode_linear``: a batch-1 decode step's one row of x through ``_gemv_kernel``
(no tensor cores: a program per 4 outputs, [4, 2048] weight tiles double-buffered in registers, fp32
sums), launched with programmatic dependent launch where the GPU has it (``pdl.py``: the first weight
tile is read while the kernel before still runs). On an H200, 32 layers of Llama-3-8B GEMVs with the
small kernels between them took 3.76 ms this way against 4.09 with cuBLAS, 3.50 with PDL
(bench/pdl_gemv_probe.py, bench/results/2026-12-03-pdl-gemv-probe-h200.json; o_proj 10.5 vs 13.3 us,
qkv 15.1 vs 16.5). 2..64 rows (decode batches, speculative verifies) go through ``_decode_gemm_kernel``
(tensor cores, operands swapped so the weight's rows fill the MMA, PDL where on): in the same emulated
step at 16 / 64 rows 3.93 / 4.24 ms against cuBLAS's 4.26 / 4.47 (2026-12-03-pdl-gemv-probe-pre-h200.json).
More rows (prefill, mixed batches) stay cuBLAS.

Other kernels (the same reference; benchmarks and the tuner): ``linear_triton`` (<= 16 rows, one program
per 16 outputs, ``tl.dot`` on x padded to 16 rows, [16, 256] tiles pipelined 4 deep: ~3.1 TB/s against
cuBLAS's ~3.7 on an H200, bench/results/2026-11-30-decode-roofline-h200.json), ``linear_triton_config``
(other tiles), ``splitk_triton`` (K split over 2-4 programs per output tile, fp32 partials, a reduce
launch), ``gemv_triton`` (the GEMV at <= 4 rows, any tile; at 2-4 rows 1.5-3x slower than cuBLAS on an
H200, bench/results/2026-12-03-pdl-gemv-probe-rows-h200.json, so the fast set gives it one row only). ``TunedDecodeMatmul.tune`` times them and
cuBLAS per (weight shape, rows) under CUDA graphs with the weights rotated past the L2 and dispatches each
call to the fastest; tuning every rank at construction was tried and taken out (2026-12-02, bench/results/
2026-12-02-decode-engine-tuned-matmuls-h200.json: 4.536 against 4.540 ms per 8B batch-1 step, 8 s more
start-up; its GEMV candidates then were an older, single-buffered kernel).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .linear import MatmulFn
from .pdl import pdl_launch, pdl_release, pdl_wait

MAX_ROWS = 16
GEMV_ROWS = 4
BLOCK_N = 16
BLOCK_K = 256
STAGES = 4
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter mis-multiplies bf16 matrices


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    rows = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(K // BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rows)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [m, K]; weight: [N, K] -> [m, N]. The kernel for m <= 16 without bias; F.linear otherwise."""
    m, k = x.shape
    n = weight.shape[0]
    if (bias is not None or m > MAX_ROWS or m == 0 or k % BLOCK_K or n % BLOCK_N or x.stride(-1) != 1
            or weight.stride(-1) != 1 or x.dtype != weight.dtype):
        return F.linear(x, weight, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(n // BLOCK_N,)](x, weight, y, m, k, x.stride(0), weight.stride(0), y.stride(0),
                                           BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=_DOT_FP32,
                                           num_warps=4, num_stages=STAGES)
    return y


# --- variants for the decode matmuls that cuBLAS serves poorly (few output tiles, e.g. o_proj) ---------

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym, M_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr):
    """No tensor cores: a program per BLOCK_N outputs multiplies its [BLOCK_N, BLOCK_K] tiles of W with
    every row of x (M <= M_PAD <= 4) in fp32 registers, the next tile loaded while one is multiplied
    (EVEN_K: BLOCK_K divides K, else the last tile is masked). Under PDL (``pdl.py``) the first weight
    tile is loaded before waiting on the kernel before."""
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, M_PAD)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    last = (tl.cdiv(K, BLOCK_K) - 1) * BLOCK_K
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=rk[None, :] < K, other=0.0)
    pdl_release(PDL)
    pdl_wait(PDL)
    if M_PAD == 1:
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
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))
    else:
        rows = rm[:, None] < M
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        acc2 = tl.zeros((M_PAD, BLOCK_N), tl.float32)
        for k in range(BLOCK_K, K, BLOCK_K):
            if EVEN_K:
                w_next = tl.load(w_ptrs + k)
            else:
                w_next = tl.load(w_ptrs + k, mask=rk[None, :] + k < K, other=0.0)
            x2 = tl.load(x_ptrs + (k - BLOCK_K), mask=rows, other=0.0).to(tl.float32)
            acc2 += tl.sum(x2[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            w = w_next
        x2 = tl.load(x_ptrs + last, mask=rows & (rk[None, :] + last < K), other=0.0).to(tl.float32)
        acc2 += tl.sum(x2[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if HAS_BIAS:
            acc2 += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc2.to(y_ptr.dtype.element_ty), mask=rows)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, part_ptr, M, K_SPLIT, stride_xm, stride_wn, N, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """The skinny kernel over one of SPLIT_K slices of K (program_id 1): fp32 partials [SPLIT_K, M, N]."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rk = split.to(tl.int64) * K_SPLIT + tl.arange(0, BLOCK_K)
    rows = rm[:, None] < M
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(K_SPLIT // BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(part_ptr + (split * M + rm[:, None]) * N + rn[None, :], acc, mask=rows)


@triton.jit
def _splitk_reduce_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + rn)
    tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty))


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, block_n: int,
          k_multiple: int) -> bool:
    m, k = x.shape
    return not (bias is not None or m > max_rows or m == 0 or k % k_multiple or weight.shape[0] % block_n
                or x.stride(-1) != 1 or weight.stride(-1) != 1 or x.dtype != weight.dtype)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 4,
                block_k: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """x: [m, K] (m <= 4); weight: [N, K] -> [m, N] with ``_gemv_kernel``; F.linear otherwise."""
    m, k = x.shape
    n = weight.shape[0]
    if (m == 0 or m > GEMV_ROWS or n % block_n or x.stride(-1) != 1 or weight.stride(-1) != 1
            or x.dtype != weight.dtype or (bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1))):
        return F.linear(x, weight, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(n // block_n,)](x, weight, bias if bias is not None else weight, y, m, k, x.stride(0),
                                  weight.stride(0), y.stride(0), M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n,
                                  BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None,
                                  num_warps=num_warps, **pdl_launch())
    return y


def gemv_tile(k: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) of the decode GEMV for an input width k. From a sweep of 8 tiles over
    the Llama-3-8B shapes on an H200 (bench/pdl_gemv_probe.py): 4 x 2048 with 8 warps within 2 % of each
    shape's best; 4 x 1024 with 4 warps where 2048 does not divide k; a narrower k (SmolLM2's 576) in
    one masked tile."""
    for block_k, warps in ((2048, 8), (1024, 4), (512, 4), (256, 4)):
        if k % block_k == 0:
            return 4, block_k, warps
    return 4, min(1024, triton.next_power_of_2(k)), 4


@triton.jit
def _decode_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT_FP32: tl.constexpr, PDL: tl.constexpr):
    """A decode batch's matmul on tensor cores with the operands swapped: y^T [BLOCK_N, BLOCK_M] = W_tile x^T,
    so BLOCK_N rows of W fill the MMA's wide side and the batch's M <= BLOCK_M rows of x its narrow side; a
    program per BLOCK_N outputs, K in BLOCK_K steps (Triton pipelines the loads), fp32 sums. Under PDL it
    waits before its first load (Triton's pipeline would otherwise reorder a first-tile-before-wait; the
    gain is the launch overlap)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]
    rows = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=rows)


GEMM_ROWS = 64


def decode_gemm_tile(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_stages, num_warps) of ``_decode_gemm_kernel`` for m rows of x, an [n, k]
    weight; None where it does not fit (more than GEMM_ROWS rows, n not a multiple of the block, k not of
    64). From a sweep of 8 tiles over the Llama-3-8B shapes at 16 and 64 rows on an H200
    (bench/pdl_gemv_probe.py, 2026-12-03-pdl-gemv-probe-pf-h200.json): 64 x 128, 6 stages, best or within
    1 % everywhere but gate_up (28672 outputs) above 16 rows, where 128 x 128 with 4 stages is (62.0 vs
    65.0 us)."""
    if not 1 <= m <= GEMM_ROWS:
        return None
    block_k = 128 if k % 128 == 0 else 64
    block_n = 128 if m > 16 and n >= 16384 else 64
    if k % block_k or n % block_n:
        return None
    return block_n, block_k, (4 if block_n == 128 else 6), 4


def gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [m, K] (m <= GEMM_ROWS); weight: [N, K] -> [m, N] with ``_decode_gemm_kernel`` at the tile
    ``decode_gemm_tile`` gives; F.linear where no tile fits or for strided rows / mixed or fp32 dtypes."""
    m, k = x.shape
    n = weight.shape[0]
    tile = decode_gemm_tile(m, n, k)
    if (tile is None or x.stride(-1) != 1 or weight.stride(-1) != 1 or x.dtype != weight.dtype
            or x.dtype not in (torch.bfloat16, torch.float16)
            or (bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1))):
        return F.linear(x, weight, bias)
    block_n, block_k, stages, warps = tile
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _decode_gemm_kernel[(n // block_n,)](x, weight, bias if bias is not None else weight, y, m, k, x.stride(0),
                                         weight.stride(0), y.stride(0), BLOCK_N=block_n,
                                         BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_K=block_k,
                                         HAS_BIAS=bias is not None, DOT_FP32=_DOT_FP32, num_stages=stages,
                                         num_warps=warps, **pdl_launch())
    return y


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


def splitk_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split_k: int = 2,
                  block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> torch.Tensor:
    """x: [m, K] (m <= 16); weight: [N, K] -> [m, N]: ``split_k`` programs per output tile, then a reduce."""
    if not _fits(x, weight, bias, MAX_ROWS, block_n, split_k * block_k):
        return F.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _splitk_kernel[(n // block_n, split_k)](x, weight, part, m, k // split_k, x.stride(0), weight.stride(0), n,
                                            BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=_DOT_FP32,
                                            num_warps=4, num_stages=STAGES)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 256 if n % 256 == 0 else block_n
    _splitk_reduce_kernel[(n // block, m)](part, y, m, n, y.stride(0), SPLIT_K=split_k, BLOCK=block, num_warps=4)
    return y


def linear_triton_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         block_n: int = BLOCK_N, block_k: int = BLOCK_K, stages: int = STAGES,
                         num_warps: int = 4) -> torch.Tensor:
    """``linear_triton`` with other tile sizes (benchmarks)."""
    if not _fits(x, weight, bias, MAX_ROWS, block_n, block_k):
        return F.linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(n // block_n,)](x, weight, y, m, k, x.stride(0), weight.stride(0), y.stride(0),
                                           BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=_DOT_FP32,
                                           num_warps=num_warps, num_stages=stages)
    return y


# --- a decode matmul chosen per weight shape and row count, by timing, once at construction ------------

def decode_matmul_candidates() -> dict[str, MatmulFn]:
    """Name -> matmul of every kernel the tuner tries (F.linear, cuBLAS, among them)."""
    c: dict[str, MatmulFn] = {"cublas": F.linear, "skinny_bn16_bk256": linear_triton}
    c["skinny_bn16_bk128_s6"] = partial(linear_triton_config, block_n=16, block_k=128, stages=6)
    c["skinny_bn32_bk128"] = partial(linear_triton_config, block_n=32, block_k=128, stages=4)
    for s in (2, 4):
        c[f"splitk{s}_bn16_bk256"] = partial(splitk_triton, split_k=s, block_n=16, block_k=256)
    for bn, bk in ((8, 256), (4, 512), (8, 512), (16, 512)):
        c[f"gemv_bn{bn}_bk{bk}"] = partial(gemv_triton, block_n=bn, block_k=bk)
    return c


def time_matmul(fn: MatmulFn, x: torch.Tensor, weights: list[torch.Tensor], calls: int = 16,
                reps: int = 10) -> float:
    """Median µs per call of ``fn`` cycling over ``weights`` (copies: more bytes than the L2 holds),
    ``calls`` calls captured in one CUDA graph, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, weights[i % len(weights)], None)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return sorted(times)[len(times) // 2]


class TunedDecodeMatmul:
    """``y = x W^T`` through the kernel measured fastest for (W's shape, rows of x), for at most
    ``max_rows`` rows; F.linear (cuBLAS) for every other case. Built once (``tune``) before CUDA-graph
    capture; ``table`` maps (out, in, rows) -> candidate name, ``timings`` keeps what was measured."""

    def __init__(self, table: dict[tuple[int, int, int], str], timings: dict[str, dict[str, float]],
                 max_rows: int) -> None:
        self.table = table
        self.timings = timings
        self.max_rows = max_rows
        self._fns = decode_matmul_candidates()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        name = self.table.get((weight.shape[0], weight.shape[1], x.shape[0])) if x.dim() == 2 else None
        if name is None or bias is not None:
            return F.linear(x, weight, bias)
        return self._fns[name](x, weight, None)

    @staticmethod
    def tune(shapes: list[tuple[int, int]], rows: list[int], dtype: torch.dtype, device: torch.device,
             l2_bytes: int = 256 << 20, log: Callable[[str], None] | None = None) -> TunedDecodeMatmul:
        """Time every candidate for every (out, in) weight shape and row count (<= 16) on this GPU."""
        cands = decode_matmul_candidates()
        table: dict[tuple[int, int, int], str] = {}
        timings: dict[str, dict[str, float]] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        for n, k in sorted(set(shapes)):
            copies = max(2, -(-l2_bytes // (n * k * torch.empty((), dtype=dtype).element_size())))
            weights = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02 for _ in range(copies)]
            for m in sorted({r for r in rows if r <= MAX_ROWS}):
                x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
                want = F.linear(x.float(), weights[0].float())
                res: dict[str, float] = {}
                for name, fn in cands.items():
                    got = fn(x, weights[0], None).float()
                    if not float((got - want).norm() / want.norm()) < 1e-2:  # never chosen (and said so)
                        if log is not None:
                            log(f"matmul candidate {name} is wrong at {(n, k, m)}: skipped")
                        continue
                    res[name] = time_matmul(fn, x, weights)
                best = min(res, key=lambda c: res[c])
                table[(n, k, m)] = best
                timings[f"{n}x{k} rows {m}"] = {c: round(t, 2) for c, t in res.items()}
                if log is not None:
                    log(f"matmul {n}x{k} rows {m}: best {best} {res[best]:.2f} us (cublas {res['cublas']:.2f} us, "
                        f"{n * k * 2 / res[best] / 1e6:.2f} TB/s)")
            del weights
        return TunedDecodeMatmul(table, timings, MAX_ROWS)
