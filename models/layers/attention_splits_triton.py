"""Split-KV for the paged attention kernels in Triton (GPU): how many splits, and their combine.

When a step has few (query rows x KV heads) programs, e.g. a batch-1 decode or a speculative verify of a
few dozen tokens, each sequence's context is cut into ``splits`` ranges of whole key tiles, one program
each, and every program writes its rows' partial softmax state: the running max ``m`` (natural-log units),
the sum ``l`` of exp(score - m) and the unnormalised ``acc`` = sum exp(score - m) * V. ``_combine_kernel``
then reduces a row's splits: out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max m). A split
that saw no key of its row leaves m = -inf, l = 0, acc = 0 and weighs nothing. Partials are laid out
[T, heads, splits, V dim padded] (row = (token * heads + head) * splits + split), fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_open

TARGET_PROGRAMS = 512
MAX_SPLITS = 32


@triton.jit
def store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, row, m, l_sum, acc, ok, VDIM_PAD: tl.constexpr):
    """One split program's partial state of its rows in the layout above: ``row`` [R] the rows' indices, ``m``
    (natural-log units) and ``l_sum`` [R], ``acc`` [R, VDIM_PAD]; ``ok`` [R] the rows that exist."""
    do = tl.arange(0, VDIM_PAD)
    tl.store(part_m_ptr + row, m, mask=ok)
    tl.store(part_l_ptr + row, l_sum, mask=ok)
    tl.store(part_acc_ptr + row[:, None] * VDIM_PAD + do[None, :], acc, mask=ok[:, None])


def num_splits(programs: int, max_context: int, block_n: int, target: int = TARGET_PROGRAMS) -> int:
    """Splits of each sequence's context (a power of two): enough programs (``programs`` without
    splits: query tiles x KV heads x head blocks) to reach ``target`` (by default about four a
    multiprocessor of the GPU's ~132), at most ``MAX_SPLITS`` and never more than one ``block_n`` tile per
    split. Static for a captured batch (``max_context``: its block tables' width in tokens)."""
    tiles = -(-max_context // block_n)
    splits = 1
    while splits * 2 <= min(tiles, MAX_SPLITS) and programs * splits < target:
        splits *= 2
    return splits


def split_partials(tokens: int, heads: int, splits: int, vdim_pad: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(acc [T, heads, splits, vdim_pad], m [T, heads, splits], l [T, heads, splits]), fp32, unset."""
    acc = torch.empty((tokens, heads, splits, vdim_pad), dtype=torch.float32, device=device)
    m = torch.empty((tokens, heads, splits), dtype=torch.float32, device=device)
    return acc, m, torch.empty_like(m)


def combine_splits(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h, :V] = the row's splits combined (out: [T, heads, V], any float dtype). The split count is an
    argument, not a compile-time constant: a new count (a prompt of another length) compiles nothing."""
    tokens, heads, splits, vdim_pad = part_acc.shape
    _combine_kernel[(tokens, heads)](part_acc, part_m, part_l, out, out.stride(0), out.stride(1), splits,
                                     SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS), VDIM=out.shape[2],
                                     VDIM_PAD=vdim_pad, num_warps=4, **pdl_launch())


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ot, stride_oh, splits,
                    SPLITS_PAD: tl.constexpr, VDIM: tl.constexpr, VDIM_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_open(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    smask = s < splits
    rows = (b * tl.num_programs(1) + head) * splits + s
    m = tl.load(part_m_ptr + rows, mask=smask, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + rows, mask=smask, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    dv = tl.arange(0, VDIM_PAD)
    acc = tl.load(part_acc_ptr + rows[:, None] * VDIM_PAD + dv[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
    tl.store(out_ptr + b * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < VDIM)
