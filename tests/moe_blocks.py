"""Test helper: comparing two groupings of routed pairs into expert blocks."""

from __future__ import annotations

from typing import Any

import torch


def same_blocks(got: Any, want: Any) -> bool:
    """Two groupings (``fused_moe.MoEBlocks``) hold the same experts in the same blocks, as many pairs in each
    block, and the same pairs per expert (the one-launch kernel's atomics may order an expert's pairs
    otherwise, across its blocks too)."""
    if not torch.equal(got.block_expert, want.block_expert):
        return False
    rows = [blk.sorted_pairs.view(-1, blk.block_m) for blk in (got, want)]
    if not torch.equal((rows[0] < got.num_pairs).sum(1), (rows[1] < want.num_pairs).sum(1)):
        return False
    keys = [(blk.block_expert[:, None] * (blk.num_pairs + 1) + r).reshape(-1).sort().values
            for blk, r in zip((got, want), rows)]
    return torch.equal(keys[0], keys[1])

