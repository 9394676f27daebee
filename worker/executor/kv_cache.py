"""How big the paged KV cache (and the recurrent state) of a rank is: pure arithmetic plus one
reading of the device's free memory. The cache itself is ``models.forward_batch.KVCache``; the
slot of a sequence position is ``step.cache_slots``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...models.forward_batch import KVShape
from ...models.layers.mamba_state import MambaStateShape


class KVCacheSizeError(ValueError):
    """The configured KV cache cannot be allocated or holds no block."""


def kv_bytes_per_block(kv_shapes: dict[int, tuple[int, ...]], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer (K, and V unless it is in K). kv_shapes: layer -> a ``KVShape``
    or one of its short forms ((heads, dim), (heads, k, v))."""
    per_token = sum(KVShape.of(shape).elements_per_token for shape in kv_shapes.values())
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_memory(available_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """Blocks that fit in ``fraction`` of ``available_bytes``."""
    if not 0.0 < fraction <= 1.0:
        raise KVCacheSizeError(f"KV memory fraction must be in (0, 1], got {fraction}")
    return int(available_bytes * fraction) // max(bytes_per_block, 1)


def state_bytes_per_slot(shapes: dict[int, MambaStateShape], dtype: torch.dtype,
                         ssm_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one sequence's recurrent state over every Mamba layer (conv in dtype, SSM in ssm_dtype)."""
    conv = sum(math.prod(s.conv) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()
    ssm = sum(math.prod(s.ssm) for s in shapes.values()) * torch.empty((), dtype=ssm_dtype).element_size()
    return conv + ssm


# At most this many KV blocks on a CPU rank sized by a memory fraction: a share of host memory would be tens of
# GB, every page zeroed at start-up (0.5 of 23 GB took 17.7 s, 2026-12-05), for a cache CPU serving never fills.
CPU_KV_BLOCKS = 512


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: free GPU memory, or MemAvailable on a CPU host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise KVCacheSizeError("cannot measure free host memory; configure num_blocks explicitly")


def blocks_for(kv_shapes: dict[int, tuple[int, ...]], state_shapes: dict[int, MambaStateShape],
               block_size: int, dtype: torch.dtype, num_state_slots: int, memory_fraction: float,
               available: int) -> int:
    """KV blocks that fit in ``memory_fraction`` of ``available`` bytes once the recurrent state is
    allocated."""
    if not 0.0 < memory_fraction <= 1.0:
        raise KVCacheSizeError(f"KV memory fraction must be in (0, 1], got {memory_fraction}")
    state = state_bytes_per_slot(state_shapes, dtype) * num_state_slots
    budget = int(available * memory_fraction) - state
    return num_blocks_for_memory(max(budget, 0), 1.0, kv_bytes_per_block(kv_shapes, block_size, dtype))
