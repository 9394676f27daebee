"""``KVCache.move`` in one Triton launch per group of same-shaped layers (a GPU's K/V relocation).

A tree round moves its accepted nodes' K/V to the slots after the root (``tree_verify_program.apply_moves``, the
host's ``StepExecutor.copy_kv``) with torch's ``index_select`` and ``index_copy_``: two launches, but the copy into
a cache group past 2**31 elements (SmolLM2's 30 layers of K and V in a fifth of an H100: [60, ~690k slots, 3, 64])
cannot index in 32 bits, so its TensorIterator splits it into several kernels. On an H100 a tree round in flight
left the GPU ~100 us idle between its verify and the next draft, where the move runs, against ~7 us in a chain
round, which moves nothing (bench/results/2026-12-07-tree-in-flight-smollm2-h100.json; bench/kv_move_probe.py
times both moves).

Here each program owns one layer tensor's columns ``[c0, c0 + BLOCK)`` of the slot rows and moves every slot in
them: it loads all the sources, waits at a barrier for every thread of the program to hold its values, then writes
the destinations; programs share no address, so every source is read before any destination is written, as
``KVCache.move`` promises (a node's verify slot may be another node's destination). Offsets are 64-bit.

    move_kv_triton(cache, src, dst)   # src, dst: int64 slot indices on the cache's device, same length
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...models.forward_batch import KVCache

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # moved as raw bits of the element size


@triton.jit(do_not_specialize=["moves"])  # a batch's move count changes call to call
def _kv_move_kernel(cache_ptr, src_ptr, dst_ptr, moves, tensor_stride, slot_stride, row,
                    M_PAD: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tl.arange(0, M_PAD)
    live = m < moves
    src = tl.load(src_ptr + m, mask=live, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + m, mask=live, other=0).to(tl.int64)
    keep = live[:, None] & (c < row)[None, :]
    base = cache_ptr + t * tensor_stride + c[None, :]
    x = tl.load(base + src[:, None] * slot_stride, mask=keep)
    tl.debug_barrier()  # every source of this program read before any destination is written
    tl.store(base + dst[:, None] * slot_stride, x, mask=keep)


def move_kv_triton(cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``KVCache.move`` (the K/V of slots ``src`` to slots ``dst`` in every layer, every source read first): one
    launch per group (``KVCache.grouped``) whose slot rows are contiguous, else that group through torch."""
    if src.shape != dst.shape:
        raise ValueError(f"{src.numel()} source slots for {dst.numel()} destinations")
    moves = src.numel()
    if not moves:
        return
    src, dst = src.reshape(-1).contiguous(), dst.reshape(-1).contiguous()
    for group in cache.grouped():
        row = group[0, 0].numel()
        if not group[0, 0].is_contiguous() or group.stride(1) < row or group.element_size() not in _AS_INT:
            KVCache.move_group(group, src, dst)
            continue
        bits = group.view(_AS_INT[group.element_size()])
        block = min(triton.next_power_of_2(row), max(16, 4096 // triton.next_power_of_2(moves)))
        _kv_move_kernel[(group.shape[0], triton.cdiv(row, block))](
            bits, src, dst, moves, group.stride(0), group.stride(1), row,
            M_PAD=triton.next_power_of_2(moves), BLOCK=block)
