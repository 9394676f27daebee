"""``fused_moe.moe_align``'s blocks in one Triton launch (GPU; CUDA-graph capturable), for decode-sized batches.

The torch ``moe_align`` is about twenty-five kernels a layer (a one-hot, two scans, a scatter, a
searchsorted, ...), each a few microseconds of a decode step. Here one program of vectors over the
pairs and over the local experts does the same grouping, with per-expert counters in a scratch buffer:

1. every slot of ``sorted_pairs`` gets the padding id (the number of pairs), every ``block_expert`` -1,
   the counters 0;
2. each local pair takes its place in its expert by an atomic increment of the expert's counter;
3. blocks per expert = ceil(count / block_m), their running sum -> each expert's first block;
   ``block_expert`` of those blocks = the expert;
4. ``sorted_pairs[first block * block_m + place] = pair``.

Steps are separated by barriers (one program: its stores are seen by all of its threads after one).
The blocks are ``moe_align``'s: the same experts in the same blocks, used blocks first in expert order,
the same pairs in each expert's rows; only the order of the pairs inside an expert's rows is the order
the atomics happened in. No result depends on it: every row of a block is computed alone (the same
products in the same order wherever it sits) and stored at its own pair's row. ``moe_align_fast`` sends
groupings of more than ``MAX_PAIRS`` pairs (prefill) to the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_moe import MoEBlocks, max_blocks, moe_align

MAX_PAIRS = 2048  # above this (prefill), the torch moe_align
CHUNK = 1024


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one compile for every batch
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, counter_ptr, place_ptr, num_pairs, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    # 1. padding everywhere, counters 0
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        at = start + lanes
        tl.store(sorted_ptr + at, tl.full((CHUNK,), 0, tl.int64) + num_pairs, mask=at < num_blocks * BLOCK_M)
    for start in range(0, num_blocks, CHUNK):
        at = start + lanes
        tl.store(block_expert_ptr + at, tl.full((CHUNK,), -1, tl.int64), mask=at < num_blocks)
    tl.store(counter_ptr + experts, tl.zeros((E_PAD,), tl.int32))
    tl.debug_barrier()
    # 2. each local pair's place in its expert
    for start in range(0, num_pairs, CHUNK):
        p = start + lanes
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        here = (e >= 0) & (e < num_experts) & (p < num_pairs)
        place = tl.atomic_add(counter_ptr + e, tl.full((CHUNK,), 1, tl.int32), mask=here)
        tl.store(place_ptr + p, place, mask=here)
    tl.debug_barrier()
    # 3. each expert's first block, and the expert of its blocks
    counts = tl.load(counter_ptr + experts, mask=experts < num_experts, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first = tl.cumsum(blocks, 0) - blocks
    for j in range(0, tl.max(blocks, 0)):
        tl.store(block_expert_ptr + first + j, experts.to(tl.int64), mask=j < blocks)
    tl.debug_barrier()
    tl.store(counter_ptr + experts, first)  # the counters now hold each expert's first block
    tl.debug_barrier()
    # 4. every local pair to its slot
    for start in range(0, num_pairs, CHUNK):
        p = start + lanes
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        here = (e >= 0) & (e < num_experts) & (p < num_pairs)
        slot = tl.load(counter_ptr + e, mask=here, other=0) * BLOCK_M + tl.load(place_ptr + p, mask=here, other=0)
        tl.store(sorted_ptr + slot, p.to(tl.int64), mask=here)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def moe_align_triton(local_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEBlocks:
    """``moe_align``'s blocks (same arguments; the pairs of an expert in any order) in one launch."""
    n, k = local_ids.shape
    pairs = n * k
    nb = max_blocks(pairs, num_experts, block_m)
    dev = local_ids.device
    flat = local_ids.reshape(-1).contiguous()
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int64, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int64, device=dev)
    e_pad = _pow2(max(num_experts, 2))
    counters = torch.empty(e_pad, dtype=torch.int32, device=dev)
    places = torch.empty(max(pairs, 1), dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat, sorted_pairs, block_expert, counters, places, pairs, num_experts, nb,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=CHUNK, num_warps=4)
    return MoEBlocks(sorted_pairs, block_expert, pairs, block_m)


def moe_align_fast(local_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEBlocks:
    """The one-launch grouping where it is quick (at most ``MAX_PAIRS`` pairs, <= 1024 local experts),
    else the torch ``moe_align``."""
    if local_ids.numel() > MAX_PAIRS or num_experts > 1024 or local_ids.numel() == 0:
        return moe_align(local_ids, num_experts, block_m)
    return moe_align_triton(local_ids, num_experts, block_m)
