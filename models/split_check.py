"""Does a checkpoint split over (tp, dp, ep)? Answered before any rank starts, by the layers themselves.

Every parallel layer checks at construction that its dimension divides over its group (heads,
KV heads, intermediate size, experts, Mamba groups: ``WeightShapeError``). ``check_split`` builds
the model of every rank position of the grid on the ``meta`` device, with groups that have no
process group behind them: no memory, no weights, no ranks, about a second even for a large
config, and exactly the rules the ranks would apply — so ``verify`` and ``fusedserve run`` refuse
an impossible split (e.g. SmolLM2's 9 attention heads over tp=2) with the layer's own message
instead of 15 s later from a spawned rank.

    check_split(load_config("smollm2/"), ParallelConfig(tp=2))
    # SplitError: SmolLM2 ... tp=2 dp=1 ep=1 cannot split it: num_attention_heads=9 does not split over 2 ranks

``fp8``: the block-FP8 format the ranks will keep (``Quantization.fp8``), so a TP shard that cuts a
scale block is refused here too, with the layer's message.
"""

from __future__ import annotations

from typing import Any

import torch

from .layers.fp8_block import BlockFP8
from .layers.weight_source import WeightShapeError
from .parallel.collectives import Collectives
from .parallel.groups import ParallelConfig, unconnected_groups
from .registry import model_class


class SplitError(ValueError):
    """The model cannot be split over the asked (tp, dp, ep); the message names the dimension."""


def check_split(config: Any, par: ParallelConfig, fp8: BlockFP8 | None = None) -> None:
    """Raise ``SplitError`` if any rank of ``par`` cannot hold its shard of a model of ``config`` (kept in
    the block-FP8 format ``fp8`` when given)."""
    archs = getattr(config, "architectures", None) or []  # an HF config: getattr is its API
    if not archs:
        raise SplitError("config.json names no architecture ('architectures' is empty)")
    cls = model_class(str(archs[0]))
    kwargs = {"fp8": fp8} if fp8 is not None else {}
    # Ranks differ only in their coordinates; one rank per distinct (attn_tp, moe_tp, ep) position suffices,
    # but the grid is small and meta construction cheap: build every rank.
    for rank in range(par.tp):
        try:
            cls(config, unconnected_groups(par, rank), Collectives("gloo"), dtype=torch.float32, device="meta",
                **kwargs)
        except (WeightShapeError, ValueError, NotImplementedError) as e:
            raise SplitError(f"tp={par.tp} dp={par.dp} ep={par.ep} cannot split this {archs[0]}: {e}") from e
