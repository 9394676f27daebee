"""Paged KV-cache blocks: a free list and one block table per sequence (pure CPU bookkeeping).

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A sequence reserves slots
as it grows; its block table lists its blocks in order, so token position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. The watermark keeps a few blocks free
when a *new* sequence is admitted, so the running ones can still grow by a token or two without
an immediate preemption (vLLM's watermark).

Example, block_size 4: reserving 6 slots for sequence 7 takes two blocks, say [0, 1]; reserving
3 more takes one more block ([0, 1, 2], 9 slots of 12 in use); freeing returns all three.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free (the caller should have checked)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._slots: dict[int, int] = {}  # reserved token slots per sequence

    # --- accounting -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def table(self, seq_id: int) -> list[int]:
        """The sequence's blocks in position order (a copy)."""
        return list(self._tables.get(seq_id, ()))

    def num_slots(self, seq_id: int) -> int:
        """Token slots reserved for the sequence."""
        return self._slots.get(seq_id, 0)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """More blocks the sequence needs so that it holds ``num_tokens`` slots in all."""
        return max(self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())), 0)

    # --- allocation -------------------------------------------------------------------------

    def can_allocate(self, num_tokens: int) -> bool:
        """Can a new sequence reserve ``num_tokens`` slots and leave the watermark free?"""
        return self.num_free_blocks - self.blocks_for(num_tokens) >= self.watermark_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Start a sequence's block table with ``num_tokens`` slots; returns the table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        self._tables[seq_id] = []
        self._slots[seq_id] = 0
        return self.append(seq_id, num_tokens)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Can the sequence reserve ``num_tokens`` more slots (no watermark: it is running)?"""
        return self.blocks_needed(seq_id, self.num_slots(seq_id) + num_tokens) <= self.num_free_blocks

    def append(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve ``num_tokens`` more slots for the sequence; returns its table."""
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} has no blocks (allocate first)")
        total = self._slots[seq_id] + num_tokens
        need = self.blocks_needed(seq_id, total)
        if need > len(self._free):
            raise NoFreeBlocks(f"sequence {seq_id} needs {need} blocks, {len(self._free)} free")
        self._tables[seq_id].extend(self._free.popleft() for _ in range(need))
        self._slots[seq_id] = total
        return list(self._tables[seq_id])

    def reserve(self, seq_id: int, total_tokens: int) -> list[int]:
        """Make the sequence hold at least ``total_tokens`` slots (allocating its table if new)."""
        if seq_id not in self._tables:
            return self.allocate(seq_id, total_tokens)
        return self.append(seq_id, max(total_tokens - self._slots[seq_id], 0))

    def free(self, seq_id: int) -> int:
        """Return the sequence's blocks to the free list; returns how many (0 if it had none)."""
        table = self._tables.pop(seq_id, [])
        self._slots.pop(seq_id, None)
        # Most recently freed blocks are reused last: a freed sequence's K/V stays intact a while
        # (useful to a prefix cache later; harmless now).
        self._free.extend(table)
        return len(table)
