"""Host values onto the device without waiting for the GPU.

``torch.tensor(values, device=cuda)`` copies synchronously: the host waits until every kernel queued
on the stream has finished (a pageable copy is followed by a stream synchronisation), so a step
that builds an index this way mid-forward leaves the GPU idle while the host prepares the next
launch. ``to_device`` stages the values in a host tensor and copies them asynchronously: for
pageable memory CUDA copies the source into its staging buffer before returning, so the host
tensor may go at once, and the copy runs in stream order (after the kernels queued before it,
before the ones queued after). Off CUDA it is the plain tensor.

    last = to_device([3, 7, 9], out.device)  # int64, no wait

``read_later`` is the other way: it queues a tensor's copy into pinned host memory behind the work
queued so far and returns a function that waits for that copy alone, not for work queued after it
(a step launched meanwhile keeps the GPU busy while the host reads the one before).

    read = read_later(tokens)    # the copy queued now
    launch_next_step()
    values = read()              # waits for the copy, not for the next step
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], device: torch.device | str,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True) if torch.device(device).type == "cuda" else host.to(device)


def read_later(values: torch.Tensor) -> Callable[[], list[Any]]:
    """Start copying ``values`` to the host behind the work queued so far; the function returned waits for
    that copy only and gives ``values.tolist()``. Off CUDA the values are there already."""
    if values.device.type != "cuda":
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read() -> list[Any]:
        done.synchronize()
        out: list[Any] = host.tolist()
        return out

    return read
