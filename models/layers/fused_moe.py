"""Routed experts computed without a host sync (CUDA-graph capturable): blocks of rows per expert.

The plain path (``RoutedExperts.forward``) loops over the local experts in Python and reads
each expert's row count on the host. Here the (token, slot) pairs routed to this rank are
grouped by expert on the device into blocks of ``block_m`` rows (``moe_align``), every shape
is static for a given number of tokens, and one kernel launch per projection processes all
blocks (``fused_moe_triton.py`` on a GPU; ``fused_experts_torch`` below, its plain torch
twin, gathers each block's expert weights and is for tests and CPU only).

Example, block_m 2, 3 local experts, tokens 0 and 1 with top-2 local ids [[2, 0], [2, -1]]
(-1: routed to another rank's expert): pairs 0..3 = (t0 s0), (t0 s1), (t1 s0), (t1 s1);
expert 0 gets pair 1, expert 2 gets pairs 0 and 2::

    sorted_pairs = [1, P, 0, 2, P, P, ...]   # P = 4 pads; [max_blocks * block_m]
    block_expert = [0, 2, -1, -1, ...]       # [max_blocks]; -1 = unused block, skipped

``max_blocks = ceil(P / block_m) + min(P, E)`` bounds the blocks any routing needs.

Block-FP8 experts (``fp8_block.py``) take the same blocks with their scales: ``FusedFP8ExpertsFn``;
``fused_experts_fp8_torch`` (dequantize, then the torch path) is their plain twin and
``fused_moe_fp8_triton.py`` the GPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fp8_block import BlockFP8, dequantize_weight, quantize_activation

BLOCK_M = 16

# (x [n, in], local_ids [n, k] (-1 = not on this rank), weights [n, k] fp32,
#  gate_up [E, 2I, in], down [E, in, I]) -> this rank's partial sum [n, in] in x's dtype
FusedExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x, local_ids, weights, gate_up fp8 [E, 2I, in], its scales [E, 2I/bn, ceil(in/bk)], down fp8 [E, in, I],
#  its scales [E, ceil(in/bn), I/bk], format) -> this rank's partial sum [n, in] in x's dtype
FusedFP8ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, BlockFP8], torch.Tensor]


@dataclass(frozen=True)
class MoEBlocks:
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int64: pair id (token * k + slot), num_pairs = padding
    block_expert: torch.Tensor  # [max_blocks] int64: local expert of each block, -1 = unused
    num_pairs: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return -(-num_pairs // block_m) + min(num_pairs, num_experts)


def moe_align(local_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> MoEBlocks:
    """Group the routed pairs by local expert into blocks of ``block_m`` rows, on the device.

    local_ids: [n, k] int, -1 (or any id outside [0, num_experts)) = not on this rank.
    """
    n, k = local_ids.shape
    pairs = n * k
    dev = local_ids.device
    nb = max_blocks(pairs, num_experts, block_m)
    flat = local_ids.reshape(-1).long()
    here = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(here, flat, num_experts)  # the last bucket collects the pairs not on this rank
    # [E+1, P]: the scan runs along the inner dim (an outer-dim scan of [P, E+1] took ~100 us at P=512)
    onehot = (torch.arange(num_experts + 1, device=dev)[:, None] == bucket[None, :]).to(torch.int32)
    rank = (onehot.cumsum(1).gather(0, bucket[None, :])[0] - 1).long()  # position within its expert
    counts = onehot.sum(1)[:num_experts].long()
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    block_start = block_end - blocks
    dump = nb * block_m  # one extra slot takes every pair not on this rank
    dest = torch.where(here, block_start[bucket.clamp(max=num_experts - 1)] * block_m + rank,
                       torch.full_like(rank, dump))
    sorted_pairs = torch.full((dump + 1,), pairs, dtype=torch.long, device=dev)
    sorted_pairs.scatter_(0, dest, torch.arange(pairs, device=dev))
    block_expert = torch.searchsorted(block_end, torch.arange(nb, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return MoEBlocks(sorted_pairs[:dump], block_expert, pairs, block_m)


def fused_experts_torch(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor) -> torch.Tensor:
    """The block computation in torch ops (capturable; gathers a weight copy per block: tests/CPU only).

    x: [n, in]; local_ids, weights: [n, k]; gate_up: [E, 2I, in]; down: [E, in, I] -> [n, in]
    """
    n, k = local_ids.shape
    num_experts = gate_up.shape[0]
    blk = moe_align(local_ids, num_experts)
    valid_block = blk.block_expert >= 0
    experts = blk.block_expert.clamp(min=0)
    pair = blk.sorted_pairs.view(blk.max_blocks, blk.block_m)  # [B, M]
    valid = (pair < blk.num_pairs) & valid_block[:, None]
    safe = torch.where(valid, pair, 0)
    rows = x[safe // k] * valid[..., None].to(x.dtype)  # [B, M, in]
    h = torch.bmm(rows, gate_up[experts].transpose(1, 2))  # [B, M, 2I]
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate) * up
    y = torch.bmm(h, down[experts].transpose(1, 2)).float()  # [B, M, in]
    w = weights.reshape(-1).float()[safe] * valid
    out = torch.zeros(n * k + 1, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, torch.where(valid, pair, n * k).reshape(-1), (y * w[..., None]).reshape(-1, x.shape[1]))
    return out[: n * k].view(n, k, x.shape[1]).sum(1).to(x.dtype)


def fused_experts_fp8_torch(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                            gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                            fmt: BlockFP8) -> torch.Tensor:
    """Block-FP8 experts, plain twin: every local expert dequantized to x's dtype, then the block
    computation above (tests/CPU only). Shapes as ``FusedFP8ExpertsFn``."""
    return fused_experts_torch(x, local_ids, weights, dequantize_weight(gate_up, gate_up_scale, fmt, x.dtype),
                               dequantize_weight(down, down_scale, fmt, x.dtype))


def fused_experts_fp8_w8a8_reference(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
                                     gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                                     down_scale: torch.Tensor, fmt: BlockFP8) -> torch.Tensor:
    """What the FP8 expert kernels compute, in plain torch: x and the SwiGLU output quantized per token
    and 1 x bk group, fp32 products (a loop over the local experts; tests only). Shapes as ``FusedFP8ExpertsFn``."""
    n = local_ids.shape[0]

    def dq(t: torch.Tensor) -> torch.Tensor:
        q, s = quantize_activation(t, fmt.block_k)
        return q.float() * s.repeat_interleave(fmt.block_k, dim=-1)[:, : t.shape[1]]

    xq = dq(x)
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (xq[token] @ dequantize_weight(gate_up[e], gate_up_scale[e], fmt).t()).chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype)
        y = dq(h) @ dequantize_weight(down[e], down_scale[e], fmt).t()
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out.to(x.dtype)
