"""Where a chained capture's forwards read and write: each chain step's positions, causal limits, context
lengths and cache slots, and a first pass's rows with the rows it drops moved out (torch; the reference).

A chain step j (1 .. chain) of ``b`` sequences with ``q`` rows each sits one RoPE position, one causal
limit and ``q`` context tokens further per step than step 1, its cache slots through the block tables
(``chain_steps``; padding rows keep ``pad_slot``). A chain after a first pass (``first_pass``) packs the
first pass's rows first: sequence s's last ``drop[s]`` rows are not real, so its rows shift to the end and its
front rows are all copies of its first real row (the same K/V to the same slot, their outputs dropped); then
one row per sequence, one position, limit, context token and slot after its last row, for ``chain`` steps.
In a capture these are some 25 small torch kernels a round; ``chain_layout_triton.first_pass_triton`` is one
launch for the first pass's layout and its chain's, equal to ``first_pass`` (the Triton interpreter test).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainSteps:
    """Every chain step's layout at once: positions and causal limits [chain, rows], context lengths
    [chain, batch], cache slots [chain, rows]; step j reads row j - 1."""

    positions: torch.Tensor
    index: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class FirstPass:
    """A first pass's packed rows ([b * q]: token ids, positions, slots, causal limits; hidden inputs
    [b * q, H]), its context lengths [b], and the one-row chain's steps after it."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor
    hidden: torch.Tensor
    context_lens: torch.Tensor
    steps: ChainSteps


def chain_steps(b: int, q: int, chain: int, positions: torch.Tensor, index: torch.Tensor,
                context_lens: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, block_size: int,
                pad_slot: int) -> ChainSteps:
    """Step 1's layout (``positions``, ``index``, ``slots`` [b * q], ``context_lens`` [b]) and the block
    ``tables`` [b, max_blocks] -> every step's (rows whose step-1 slot is ``pad_slot`` keep it)."""
    on = torch.arange(chain, device=positions.device)[:, None]  # [chain, 1]: steps after the first
    positions = positions + on  # [chain, rows]
    index = index + on * q
    context_lens = context_lens + on * q  # [chain, batch]
    per_seq = (index // block_size).view(chain, b, q).transpose(0, 1).reshape(b, chain * q)
    block = tables.gather(1, per_seq).view(b, chain, q).transpose(0, 1).reshape(chain, b * q)
    slots = torch.where(slots != pad_slot, block * block_size + index % block_size, pad_slot)
    return ChainSteps(positions, index, context_lens, slots)


def first_pass(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
               context_lens: torch.Tensor, hidden: torch.Tensor, drop: torch.Tensor, tables: torch.Tensor, q: int,
               chain: int, block_size: int, pad_slot: int, consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               leaves: int = 1) -> FirstPass:
    """The packed first pass of ``b`` sequences of ``q`` rows (``ids`` .. ``index`` [b * q], ``context_lens``
    and ``drop`` [b], ``hidden`` [b * q, H]) and its ``chain`` one-row steps (see the module). ``consts``:
    arange(q), arange(b) and each sequence's last row (arange(b) * q + q - 1), made once outside a capture.
    ``leaves`` > 1: a draft tree's steps after it instead, ``leaves`` rows per sequence, all at the RoPE position
    after its last row, in the ``leaves`` slots after it (step j's ``(j - 1) * leaves`` further:
    ``Drafter.tree_on_device``'s layout)."""
    row, seq, last = consts
    b = seq.shape[0]
    src = (seq[:, None] * q + (row[None, :] - drop[:, None]).clamp(min=0)).view(-1)
    positions, slots, index = positions[src], slots[src], index[src]
    context_lens = context_lens - drop
    if leaves == 1:
        steps = chain_steps(b, 1, chain, positions[last] + 1, index[last] + 1, context_lens + 1, slots[last], tables,
                            block_size, pad_slot)
    else:
        on = torch.arange(1, leaves + 1, device=index.device)
        steps = chain_steps(b, leaves, chain, (positions[last] + 1).repeat_interleave(leaves),
                            (index[last][:, None] + on).view(-1), context_lens + leaves,
                            slots[last].repeat_interleave(leaves), tables, block_size, pad_slot)
    return FirstPass(ids[src], positions, slots, index, hidden[src], context_lens, steps)
