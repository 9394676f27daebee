"""How long collectives take, sampled, into the ledger (``fusedserve_collective_seconds``).

Chosen once per rank from the device path, never in the hot path:

- ``HostClock`` (gloo): gloo calls on CPU tensors return when the collective is done, so the
  wall time around the call is its time; every call is timed.
- ``CudaEventClock`` (nccl, and the fused kernels on GPU): CUDA events around one call in
  ``every`` per (op, group, path), read later without a host sync once they completed; nothing
  is timed while a stream is being captured (graph replays run collectives without Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

Key = tuple[str, str, str]  # (op, group, path)
# 10 µs .. 1 s
BOUNDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
Observe = Callable[[Key, float], None]


class CollectiveClock(Protocol):
    def start(self, key: Key) -> Any: ...

    def stop(self, key: Key, token: Any, observe: Observe) -> None: ...


class HostClock:
    def start(self, key: Key) -> float:
        return time.perf_counter()

    def stop(self, key: Key, token: float, observe: Observe) -> None:
        observe(key, time.perf_counter() - token)


class CudaEventClock:
    def __init__(self, every: int = 64, pending_max: int = 256) -> None:
        import torch

        self._torch = torch
        self.every = every
        self.pending_max = pending_max
        self._seen: dict[Key, int] = {}
        self._pending: list[tuple[Key, Any, Any]] = []

    def start(self, key: Key) -> Any:
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        cuda = self._torch.cuda
        if n % self.every or cuda.is_current_stream_capturing() or len(self._pending) >= self.pending_max:
            return None
        begin = cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def stop(self, key: Key, token: Any, observe: Observe) -> None:
        if token is None:
            if self._pending and not self._torch.cuda.is_current_stream_capturing():
                self._drain(observe)  # event queries are not allowed while capturing
            return
        self._drain(observe)
        end = self._torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((key, token, end))

    def _drain(self, observe: Observe) -> None:
        while self._pending and self._pending[0][2].query():
            key, begin, end = self._pending.pop(0)
            observe(key, begin.elapsed_time(end) / 1e3)


def clock_for(device_path: str) -> CollectiveClock:
    return CudaEventClock() if device_path == "nccl" else HostClock()
