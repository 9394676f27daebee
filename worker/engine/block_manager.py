"""Paged KV-cache blocks: a free list, one block table per sequence, shared full blocks (pure CPU bookkeeping).

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A sequence reserves slots
as it grows; its block table lists its blocks in order, so token position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. The watermark keeps a few blocks free
when a *new* sequence is admitted, so the running ones can still grow by a token or two without
an immediate preemption (vLLM's watermark).

Example, block_size 4: reserving 6 slots for sequence 7 takes two blocks, say [0, 1]; reserving
3 more takes one more block ([0, 1, 2], 9 slots of 12 in use); freeing returns all three.

With a prefix cache (``prefix_cache.py``) a sequence's full blocks whose K/V is final are cached
by the key of their tokens (``cache_blocks``); a new sequence starts its table with the cached
blocks of its longest cached prefix (``match``, then ``allocate(..., hit)``), each block counted
once per table that holds it. Only full, final blocks are ever shared, and a sequence only writes
past its computed tokens, so no sequence writes into a block another one holds. A block no table
holds is free; a cached one stays findable until a fresh block is needed and it is the least
recently released (``num_free_blocks`` counts it as free).
"""

from __future__ import annotations

from collections import deque

from .prefix_cache import NO_HIT, Key, NoPrefixCache, PrefixCache, PrefixHit, TokenSource


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free (the caller should have checked)."""


class BlockManager:
    """``cache``: the prefix cache (its block size must be ``block_size``); default none (nothing shared)."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0,
                 cache: PrefixCache | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.cache = cache if cache is not None else NoPrefixCache(block_size)
        if self.cache.block_size != block_size:
            raise ValueError(f"the prefix cache has blocks of {self.cache.block_size}, not {block_size}")
        self._free: deque[int] = deque(range(num_blocks))  # held by no table and not cached
        self._refs = [0] * num_blocks  # tables holding each block
        self._tables: dict[int, list[int]] = {}
        self._slots: dict[int, int] = {}  # reserved token slots per sequence
        self._keys: dict[int, list[Key]] = {}  # keys of each sequence's first full blocks

    # --- accounting -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return len(self._free) + self.cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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

    def match(self, seq: TokenSource) -> PrefixHit:
        """The cached blocks a new sequence can start with (its longest cached prefix)."""
        return self.cache.match(seq)

    def _new_blocks(self, num_tokens: int, hit: PrefixHit) -> int:
        """Blocks taken from the free ones by a new table of ``num_tokens`` slots starting with ``hit``."""
        claimed = sum(1 for b in hit.blocks if self._refs[b] == 0)  # evictable now, held once allocated
        return max(self.blocks_for(num_tokens) - len(hit.blocks), 0) + claimed

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Can a new sequence reserve ``num_tokens`` slots (its first ``hit`` blocks cached) and
        leave the watermark free?"""
        return self.num_free_blocks - self._new_blocks(num_tokens, hit) >= self.watermark_blocks

    def allocate(self, seq_id: int, num_tokens: int, hit: PrefixHit = NO_HIT) -> list[int]:
        """Start a sequence's block table with ``num_tokens`` slots, the first ``hit.num_tokens``
        of them in the hit's cached blocks; returns the table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if num_tokens < hit.num_tokens:
            raise ValueError(f"sequence {seq_id}: {num_tokens} slots cannot hold its {hit.num_tokens} cached tokens")
        need = self._new_blocks(num_tokens, hit)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id} needs {need} blocks, {self.num_free_blocks} free")
        for b in hit.blocks:
            if self._refs[b] == 0:
                self.cache.claim(b)
            self._refs[b] += 1
        self._tables[seq_id] = list(hit.blocks)
        self._slots[seq_id] = hit.num_tokens
        self._keys[seq_id] = list(hit.keys)
        return self.append(seq_id, num_tokens - hit.num_tokens)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Can the sequence reserve ``num_tokens`` more slots (no watermark: it is running)?"""
        return self.blocks_needed(seq_id, self.num_slots(seq_id) + num_tokens) <= self.num_free_blocks

    def append(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve ``num_tokens`` more slots for the sequence; returns its table."""
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} has no blocks (allocate first)")
        total = self._slots[seq_id] + num_tokens
        need = self.blocks_needed(seq_id, total)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id} needs {need} blocks, {self.num_free_blocks} free")
        self._tables[seq_id].extend(self._take() for _ in range(need))
        self._slots[seq_id] = total
        return list(self._tables[seq_id])

    def _take(self) -> int:
        """A fresh block: a free one, else the least recently released cached one (evicted)."""
        block = self._free.popleft() if self._free else self.cache.evict()
        self._refs[block] = 1
        return block

    def reserve(self, seq_id: int, total_tokens: int) -> list[int]:
        """Make the sequence hold at least ``total_tokens`` slots (allocating its table if new)."""
        if seq_id not in self._tables:
            return self.allocate(seq_id, total_tokens)
        return self.append(seq_id, max(total_tokens - self._slots[seq_id], 0))

    def cache_blocks(self, seq_id: int, seq: TokenSource, num_settled: int) -> int:
        """Cache the sequence's full blocks whose K/V is final in every cache (its first
        ``num_settled`` tokens) and not yet cached; returns how many of its blocks have keys."""
        keys = self._keys.get(seq_id)
        if keys is None:
            return 0
        table = self._tables[seq_id]
        count = min(self.cache.num_keyed(seq.num_tokens, num_settled), len(table))
        first = len(keys)
        if count > first:
            self.cache.extend_keys(keys, seq, count)
            for k in range(first, count):
                self.cache.insert(keys[k], table[k])  # a block with the same key already cached: not this one
        return len(keys)

    def free(self, seq_id: int) -> int:
        """Release the sequence's blocks; returns how many (0 if it had none). A block no other
        table holds is free again; a cached one stays findable (evictable)."""
        table = self._tables.pop(seq_id, [])
        self._slots.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        # The tail goes first into the eviction order: a prefix is worth more than its last blocks.
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0 and not self.cache.release(block):
                self._free.append(block)
        return len(table)
