"""Test helpers: comparing two groupings of routed pairs into expert blocks; one model's weights into another whose
shared expert is folded into its routed experts."""

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



def copy_weights_folding_shared(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """src's parameters into dst, the same model where dst's MoE layers hold their shared expert as the last
    routed expert (``moe.py``'s fold; src keeps ``shared_experts``): ``experts.gate_up_proj[-1]`` takes
    ``shared_experts.gate_up_proj.weight``, ``experts.down_proj_scale_inv[-1]`` ``shared_experts.down_proj
    .weight_scale_inv``. Returns how many expert tensors took a shared expert."""
    ref = dict(src.named_parameters())
    folded = 0
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in ref and ref[name].shape == p.shape:
                p.copy_(ref[name])
                continue
            base, scale = (name[: -len("_scale_inv")], "_scale_inv") if name.endswith("_scale_inv") else (name, "")
            p[:-1].copy_(ref[name])
            p[-1].copy_(ref[base.replace(".experts.", ".shared_experts.") + ".weight" + scale])
            folded += 1
    return folded
