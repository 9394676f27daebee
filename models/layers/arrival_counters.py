"""Per-tile arrival counts for kernels whose last program finishes a tile's work (GPU and Triton's interpreter).

A split-K GEMM (``linear_triton``) or a split-KV decode attention (``decode_attention_triton``) cuts one
output tile's work over several programs; each stores its partial result, then adds 1 to the tile's count
(``atomic_add``, acquire-release, GPU scope, after a barrier so every thread's partial is stored): the one
that finds the others all arrived combines the partials, stores the tile and sets the count back to 0. So
the counts are 0 between launches, and every such kernel can share one buffer per device, as long as its
launches never overlap another's counting — true on one stream, PDL included (each of these kernels waits
for the kernel before it before any of that).
"""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """At least ``count`` int32 counts on ``device``, all 0; made once per device (and again when a launch
    needs more), never during a CUDA-graph capture: None there (the caller then does not split)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
