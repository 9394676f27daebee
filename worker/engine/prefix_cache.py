"""Prefix caching: full KV blocks found again by their content (pure CPU bookkeeping).

A full block's *key* hashes its parent block's key and its own token ids (a chain: the key names
the block's tokens and every token before it), so two sequences whose first ``k`` blocks hold the
same tokens find the same ``k`` keys. ``lookahead`` extra tokens after the block join its key:
with EAGLE3 speculation the draft's K/V in a block's last slot is computed from the token after
the block (slot b reads token b + 1), so the block is only the same block if that token is too.

The cache maps keys to block ids. The ``BlockManager`` counts references; a cached block that
no sequence holds any more stays here, *evictable*, until a fresh block is needed: then the
least recently released one goes first (its key is dropped and the block is reused). A hit
takes an evictable block back out of the queue.

Example, block_size 4, no lookahead: a sequence of 10 tokens has 2 full blocks with keys
k0 = H(∅, t0..t3), k1 = H(k0, t4..t7); a later prompt with the same first 9 tokens finds both
(8 tokens need no prefill) and computes from position 8. A prompt of exactly 8 such tokens finds
only k0: its last token is always computed, to give the logits it samples from.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

Key = bytes


class TokenSource(Protocol):
    """What the cache reads of a sequence: its known tokens (``Sequence`` is one)."""

    @property
    def num_tokens(self) -> int: ...

    def token_ids(self, start: int, end: int) -> list[int]: ...


def block_key(parent: Key | None, tokens: Sequence[int]) -> Key:
    """The chain hash of one block: its parent's key and its tokens (128-bit BLAKE2b)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks a new sequence starts with, their keys, the tokens they hold, and the
    tokens looked up (the sequence's known tokens; 0 when nothing was looked up: caching is off)."""

    blocks: tuple[int, ...] = ()
    keys: tuple[Key, ...] = ()
    num_tokens: int = 0
    num_queried: int = 0


NO_HIT = PrefixHit()


class PrefixCache:
    """Cached full blocks by key, and the evictable ones (referenced by no sequence) in LRU order."""

    def __init__(self, block_size: int, lookahead: int = 0) -> None:
        if block_size < 1 or lookahead < 0:
            raise ValueError(f"need block_size >= 1 and lookahead >= 0, got {block_size}, {lookahead}")
        self.block_size = block_size
        self.lookahead = lookahead
        self._block_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first

    @property
    def enabled(self) -> bool:
        return True

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # --- keys -----------------------------------------------------------------------------------

    def num_keyed(self, num_tokens: int, num_settled: int) -> int:
        """Full blocks of a sequence that can have a key: their tokens (and the lookahead after
        them) are known, and their K/V is final in every cache (``num_settled`` tokens)."""
        b = self.block_size
        return max(min(num_settled // b, (num_tokens - self.lookahead) // b), 0)

    def extend_keys(self, keys: list[Key], seq: TokenSource, count: int) -> list[Key]:
        """``keys`` (a sequence's first blocks' keys) extended to ``count`` keys, in place."""
        b, extra = self.block_size, self.lookahead
        for k in range(len(keys), count):
            keys.append(block_key(keys[-1] if keys else None, seq.token_ids(k * b, (k + 1) * b + extra)))
        return keys

    # --- lookup ---------------------------------------------------------------------------------

    def match(self, seq: TokenSource) -> PrefixHit:
        """The longest run of cached blocks the sequence starts with, leaving at least its last
        known token to compute (it gives the logits the sequence samples from)."""
        b = self.block_size
        limit = (seq.num_tokens - max(self.lookahead, 1)) // b
        blocks: list[int] = []
        keys: list[Key] = []
        for k in range(max(limit, 0)):
            key = block_key(keys[-1] if keys else None, seq.token_ids(k * b, (k + 1) * b + self.lookahead))
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
        return PrefixHit(tuple(blocks), tuple(keys), len(blocks) * b, seq.num_tokens)

    # --- changes --------------------------------------------------------------------------------

    def insert(self, key: Key, block: int) -> bool:
        """Cache a (referenced) block under ``key``; False if the key already has a block (the
        block then stays uncached: it goes back to the free list when released)."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def claim(self, block: int) -> None:
        """A hit references an evictable block again: it leaves the eviction queue."""
        self._evictable.pop(block, None)

    def release(self, block: int) -> bool:
        """The last reference to a block went away: a cached block becomes evictable (the most
        recently released, evicted last); False if it is not cached (the caller frees it)."""
        if block not in self._key_of:
            return False
        self._evictable[block] = None
        return True

    def evict(self) -> int:
        """Drop the least recently released evictable block from the cache; returns it."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block


class NoPrefixCache(PrefixCache):
    """Prefix caching off (e.g. models with recurrent state): nothing is ever cached or found."""

    @property
    def enabled(self) -> bool:
        return False

    def num_keyed(self, num_tokens: int, num_settled: int) -> int:
        return 0

    def match(self, seq: TokenSource) -> PrefixHit:
        return NO_HIT

    def insert(self, key: Key, block: int) -> bool:
        return False
