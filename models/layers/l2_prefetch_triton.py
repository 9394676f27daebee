"""Pull a weight into the GPU's L2 cache ahead of the matmul that reads it (Hopper, SM90+).

A decode step streams every weight once, but between two matmuls run kernels that read almost
nothing from memory (norms, RoPE, attention over a short context, the activation): memory sits idle
for ~18 us a Llama-3-8B layer at batch 1. ``prefetch_l2(weight, max_bytes)`` asks the memory system
to bring the first ``max_bytes`` of a weight into L2 with Hopper's bulk prefetch
(``cp.async.bulk.prefetch.L2.global``: one instruction per ``SUB`` bytes, no registers, no data
returned), so that the next matmul finds that part in L2. The kernel only issues the requests and
ends; the copies run on in the background. It changes no value anywhere, so its plain reference is
doing nothing (``weight_prefetch.py``'s ``NO_PREFETCH``), which is also what every CPU path runs.

``prefetch_l2_lines``: the same by one ``prefetch.global.L2`` per 128-byte line (SM80+), for
comparison in ``bench/l2_prefetch_probe.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 16384  # bytes one bulk prefetch asks for
LANES = 32  # prefetches issued by one program (one warp)
LINE = 128
LINES = 1024


@triton.jit
def _bulk_prefetch_kernel(base_ptr, nbytes, dummy_ptr, SUB: tl.constexpr, LANES: tl.constexpr):
    lane = tl.arange(0, LANES)
    off = (tl.program_id(0).to(tl.int64) * LANES + lane) * SUB
    size = tl.minimum(nbytes - off, SUB).to(tl.int32)
    addr = base_ptr + tl.where(size > 0, off, 0)
    r = tl.inline_asm_elementwise(
        asm="{\n .reg .pred p;\n setp.gt.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
            " mov.u32 $0, 0;\n}",
        constraints="=r,l,r", args=[addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + lane, r.to(tl.uint8), mask=lane < 0)  # never stores: keeps the asm's result used


@triton.jit
def _bulk_prefetch_last_kernel(base_ptr, nbytes, dummy_ptr, SUB: tl.constexpr, LANES: tl.constexpr):
    """``_bulk_prefetch_kernel`` with an evict-last cache policy on the prefetched lines."""
    lane = tl.arange(0, LANES)
    off = (tl.program_id(0).to(tl.int64) * LANES + lane) * SUB
    size = tl.minimum(nbytes - off, SUB).to(tl.int32)
    addr = base_ptr + tl.where(size > 0, off, 0)
    r = tl.inline_asm_elementwise(
        asm="{\n .reg .pred p;\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
            " setp.gt.s32 p, $2, 0;\n @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;\n"
            " mov.u32 $0, 0;\n}",
        constraints="=r,l,r", args=[addr, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + lane, r.to(tl.uint8), mask=lane < 0)


@triton.jit
def _line_prefetch_kernel(base_ptr, nbytes, dummy_ptr, LINE: tl.constexpr, LINES: tl.constexpr):
    i = tl.arange(0, LINES)
    off = (tl.program_id(0).to(tl.int64) * LINES + i) * LINE
    addr = base_ptr + tl.where(off < nbytes, off, 0)
    r = tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n mov.u32 $0, 0;", constraints="=r,l",
                                  args=[addr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + i, r.to(tl.uint8), mask=i < 0)


def _bytes_of(weight: torch.Tensor, max_bytes: int) -> tuple[torch.Tensor, int]:
    if not weight.is_contiguous():
        raise ValueError("prefetch_l2: the weight must be contiguous")
    flat = weight.view(-1).view(torch.uint8)
    return flat, min(flat.numel(), max_bytes) // 16 * 16


def prefetch_l2(weight: torch.Tensor, max_bytes: int, sub: int = SUB, evict_last: bool = False) -> None:
    """Ask for the first ``max_bytes`` of ``weight`` (contiguous, on a SM90+ GPU) in L2, ``sub`` bytes
    per request."""
    flat, n = _bytes_of(weight, max_bytes)
    if n:
        kernel = _bulk_prefetch_last_kernel if evict_last else _bulk_prefetch_kernel
        kernel[(triton.cdiv(n, sub * LANES),)](flat, n, flat, SUB=sub, LANES=LANES, num_warps=1)


def prefetch_l2_lines(weight: torch.Tensor, max_bytes: int) -> None:
    """``prefetch_l2`` by one prefetch instruction per 128-byte line (SM80+)."""
    flat, n = _bytes_of(weight, max_bytes)
    if n:
        _line_prefetch_kernel[(triton.cdiv(n, LINE * LINES),)](flat, n, flat, LINE=LINE,
                                                                LINES=LINES, num_warps=4)
