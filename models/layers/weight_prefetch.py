"""Which weight to pull into L2 after each matmul of a decode step, and the side stream that does it.

In a Llama layer the matmuls run qkv -> o -> gate_up -> down, and between two of them run kernels that
read almost nothing (RoPE and attention over a short context, the add-RMSNorm, the activation). The
model says after each matmul which weight comes next (``after(weight)``: explicit calls in
``SelfAttention``, ``GatedMLP``, ``LlamaDecoderLayer`` and the decoder stack), and a ``WeightPrefetch``
built for a GPU asks for the first ``max_bytes`` of it in L2 from a side stream that waits for the
matmul just queued, so the request runs beside the small kernels and the next matmul finds part of
its weight in L2 (``l2_prefetch_triton.py``). It runs only while a CUDA graph is being captured:
replays pay nothing on the host, while an eager forward (a prefill chunk) would pay a Triton launch per
matmul for nothing. ``join`` (the decoder stack's last call) brings the side stream back into the
forward's stream, as a capture requires.

Measured on an H200 (bench/results/2026-12-03-l2-prefetch-probe-h200.json, a Llama-3-8B-shaped step of
cuBLAS matmuls with the small kernels stood in by spin kernels): 4.48 -> 4.31 ms at batch 1, 4.73 ->
4.54 ms at batch 64 with 16 MB per weight and an evict-last policy; more per weight gained less.

The plain reference is ``NO_PREFETCH`` (nothing happens: a prefetch changes no value anywhere), the
only one on CPU and for every model that does not say what comes next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# The measured best share of each weight (see above).
PREFETCH_BYTES = 16 << 20


class WeightPrefetch:
    """``after(w)``: ``issue(w)`` when ``active()``; ``join()``: ``rejoin()`` when ``active()``."""

    def __init__(self, issue: Callable[[torch.Tensor], None], rejoin: Callable[[], None],
                 active: Callable[[], bool]) -> None:
        self._issue = issue
        self._rejoin = rejoin
        self._active = active

    def after(self, weight: torch.Tensor) -> None:
        # weight: the next matmul's [out, in]
        if self._active():
            self._issue(weight)

    def after_layer(self, layers: Any, i: int, lm_head: Any) -> None:
        """After layer ``i`` of ``layers``: the next layer's ``first_weight``, after the last the LM head's
        ``weight`` (looked up only when active: layers without a ``first_weight`` never prefetch)."""
        if self._active():
            self._issue(layers[i + 1].first_weight if i + 1 < len(layers) else lm_head.weight)

    def join(self) -> None:
        if self._active():
            self._rejoin()


def _never() -> bool:
    return False


def _nothing(*_: object) -> None:
    return None


NO_PREFETCH = WeightPrefetch(_nothing, _nothing, _never)


class SideStream:
    """The side stream of one device: each request waits for the work queued so far on the current
    stream, then runs ``kernel(weight, max_bytes)``."""

    def __init__(self, kernel: Callable[[torch.Tensor, int], None], max_bytes: int) -> None:
        self.kernel = kernel
        self.max_bytes = max_bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def issue(self, weight: torch.Tensor) -> None:
        side = self._stream(weight.device)
        side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(side):
            self.kernel(weight, self.max_bytes)

    def rejoin(self) -> None:
        current = torch.cuda.current_stream()
        side = self._streams.get(current.device)
        if side is not None:
            current.wait_stream(side)


def no_weight_prefetch() -> WeightPrefetch:
    return NO_PREFETCH


def l2_weight_prefetch(max_bytes: int = PREFETCH_BYTES) -> WeightPrefetch:
    """The GPU's prefetch (Hopper's bulk prefetch with an evict-last policy), active while a graph is
    captured; ``NO_PREFETCH`` where there is no SM90+ GPU (decided here, once)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return NO_PREFETCH
    from .l2_prefetch_triton import prefetch_l2

    side = SideStream(lambda w, n: prefetch_l2(w, n, evict_last=True), max_bytes)
    return WeightPrefetch(side.issue, side.rejoin, torch.cuda.is_current_stream_capturing)
