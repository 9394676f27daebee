"""Per-sequence recurrent state of every Mamba layer: the conv window and the SSM state.

A runner allocates one slot per running sequence (``ForwardBatch.state_slots[i]`` is
sequence i's slot) from the model's ``state_shapes()``, which are this rank's shapes (heads
and groups split over the attention-TP group). A Mamba layer reads and writes only the slots
of its batch's sequences; a sequence whose ``context_len == query_len`` starts from zeros
whatever its slot held before, so slots can be reused without clearing.

    conv[layer]: [num_slots, conv_channels, conv_kernel - 1]  last raw inputs of the conv window
    ssm[layer]:  [num_slots, heads, head_dim, state_size]      SSM state (float32 by default)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MambaStateShape:
    """One Mamba layer's per-sequence state on this rank."""

    conv: tuple[int, int]  # (conv_channels, conv_kernel - 1)
    ssm: tuple[int, int, int]  # (heads, head_dim, state_size)


@dataclass
class MambaStateCache:
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    num_slots: int

    @staticmethod
    def allocate(shapes: dict[int, MambaStateShape], num_slots: int, dtype: torch.dtype,
                 device: torch.device | str | None = None,
                 ssm_dtype: torch.dtype = torch.float32) -> MambaStateCache:
        """shapes: layer id -> this rank's state shape (``model.state_shapes()``)."""
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        conv = {i: torch.zeros((num_slots, *s.conv), dtype=dtype, device=device) for i, s in shapes.items()}
        ssm = {i: torch.zeros((num_slots, *s.ssm), dtype=ssm_dtype, device=device) for i, s in shapes.items()}
        return MambaStateCache(conv=conv, ssm=ssm, num_slots=num_slots)

    def clear(self, slots: list[int]) -> None:
        """Zero these slots in every layer (optional: fresh sequences ignore old contents)."""
        index = torch.tensor(slots, dtype=torch.long)
        for t in (*self.conv.values(), *self.ssm.values()):
            t[index.to(t.device)] = 0
