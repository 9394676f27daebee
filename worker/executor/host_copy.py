"""Host values onto the device without waiting for the GPU.

``torch.tensor(values, device=cuda)`` copies synchronously: the host waits until every kernel queued
on the stream has finished (a pageable copy is followed by a stream synchronisation), so a step
that builds an index this way mid-forward leaves the GPU idle while the host prepares the next
launch. ``to_device`` stages the values in a host tensor and copies them asynchronously: for
pageable memory CUDA copies the source into its staging buffer before returning, so the host
tensor may go at once, and the copy runs in stream order (after the kernels queued before it,
before the ones queued after). Off CUDA it is the plain tensor.

    last = to_device([3, 7, 9], out.device)  # int64, no wait
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], device: torch.device | str,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True) if torch.device(device).type == "cuda" else host.to(device)
