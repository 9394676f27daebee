"""Paged KV block allocator: accounting, growth, watermark, no block shared or leaked."""

from __future__ import annotations

import random

import pytest

from fusedserve.worker.engine.block_manager import BlockManager, NoFreeBlocks
from fusedserve.worker.engine.prefix_cache import PrefixCache, block_key


def test_allocate_append_free_accounting() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    table = bm.allocate(7, 6)  # 6 slots -> 2 blocks
    assert len(table) == 2 and bm.num_slots(7) == 6 and bm.num_free_blocks == 6
    assert bm.append(7, 2) == table  # 8 slots still fit in 2 blocks
    assert bm.num_free_blocks == 6
    table = bm.append(7, 1)  # the 9th slot needs a third block
    assert len(table) == 3 and bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.table(7) == table and len(set(table)) == 3
    assert bm.free(7) == 3
    assert bm.num_free_blocks == 8 and not bm.has(7) and bm.table(7) == []
    assert bm.free(7) == 0  # freeing twice is harmless


def test_reserve_is_idempotent_and_grows() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.reserve(1, 5)
    assert len(bm.table(1)) == 2
    bm.reserve(1, 3)  # already holds more
    assert bm.num_slots(1) == 5 and len(bm.table(1)) == 2
    bm.reserve(1, 12)
    assert len(bm.table(1)) == 3 and bm.num_slots(1) == 12


def test_can_allocate_and_can_append_and_exhaustion() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.can_allocate(6) and not bm.can_allocate(7)
    bm.allocate(1, 4)
    assert bm.can_append(1, 2) and not bm.can_append(1, 3)
    assert bm.blocks_needed(1, 7) == 2
    with pytest.raises(NoFreeBlocks):
        bm.append(1, 3)
    assert bm.num_free_blocks == 1 and bm.num_slots(1) == 4  # a failed append changes nothing
    with pytest.raises(ValueError):
        bm.allocate(1, 1)
    with pytest.raises(KeyError):
        bm.append(99, 1)


def test_watermark_applies_to_new_sequences_only() -> None:
    bm = BlockManager(num_blocks=10, block_size=1, watermark=0.2)  # keep 2 blocks for growth
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    bm.allocate(1, 8)
    assert bm.can_append(1, 2)  # running sequences may use the watermark


@pytest.mark.parametrize("bad", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0},
                                 {"num_blocks": 4, "block_size": 4, "watermark": 1.0}])
def test_invalid_construction(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BlockManager(**bad)  # type: ignore[arg-type]


def test_random_operations_keep_blocks_disjoint_and_never_leak() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: set[int] = set()
    for step in range(2000):
        op = rng.random()
        if op < 0.3 and bm.can_allocate(n := rng.randint(1, 20)):
            bm.allocate(step, n)
            live.add(step)
        elif op < 0.7 and live:
            sid = rng.choice(sorted(live))
            n = rng.randint(1, 6)
            if bm.can_append(sid, n):
                bm.append(sid, n)
        elif live:
            sid = rng.choice(sorted(live))
            bm.free(sid)
            live.discard(sid)
        owned = [b for sid in live for b in bm.table(sid)]
        assert len(owned) == len(set(owned)), "a block is in two tables"
        assert len(owned) + bm.num_free_blocks == 32
        for sid in live:
            assert len(bm.table(sid)) == bm.blocks_for(bm.num_slots(sid))
    for sid in list(live):
        bm.free(sid)
    assert bm.num_free_blocks == 32


# --- prefix caching ---------------------------------------------------------------------------


class Tokens:
    """A token list as the cache reads a sequence."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.ids[start:end]


def caching(num_blocks: int, block_size: int = 4, lookahead: int = 0, watermark: float = 0.0) -> BlockManager:
    return BlockManager(num_blocks, block_size, watermark, PrefixCache(block_size, lookahead))


def test_block_keys_chain_their_parents() -> None:
    k0 = block_key(None, [1, 2, 3, 4])
    assert k0 == block_key(None, [1, 2, 3, 4]) and len(k0) == 16
    assert block_key(k0, [5, 6, 7, 8]) != block_key(block_key(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_key(None, [1, 2, 3, 4]) != block_key(None, [1, 2, 3, 5])


def test_full_settled_blocks_are_found_and_shared_by_reference() -> None:
    bm = caching(8)
    a = Tokens(list(range(10, 20)))  # 10 tokens: 2 full blocks + 2
    table_a = bm.allocate(0, 10)
    assert bm.cache_blocks(0, a, num_settled=7) == 1  # the second block is not final yet
    assert bm.cache_blocks(0, a, num_settled=10) == 2
    b = Tokens(list(range(10, 19)) + [99, 98])  # the same first 9 tokens
    hit = bm.match(b)
    assert hit.blocks == tuple(table_a[:2]) and hit.num_tokens == 8
    free_before = bm.num_free_blocks
    table_b = bm.allocate(1, 12, hit)
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert bm.num_free_blocks == free_before - 1  # only the one fresh block
    bm.free(0)
    assert bm.num_free_blocks == 8 - 3  # the shared blocks are still held by sequence 1
    bm.free(1)
    assert bm.num_free_blocks == 8 and bm.cache.num_cached == 2 and bm.cache.num_evictable == 2


def test_the_last_prompt_token_is_always_computed() -> None:
    bm = caching(8)
    a = Tokens(list(range(8)))
    bm.allocate(0, 8)
    bm.cache_blocks(0, a, 8)
    assert bm.match(Tokens(list(range(8)))).num_tokens == 4  # 8 tokens: the second block holds the last one
    assert bm.match(Tokens(list(range(9)))).num_tokens == 8
    assert bm.match(Tokens(list(range(4)))).num_tokens == 0


def test_partial_blocks_are_never_cached_or_shared() -> None:
    bm = caching(8)
    a = Tokens(list(range(7)))
    bm.allocate(0, 7)
    assert bm.cache_blocks(0, a, 7) == 1
    assert bm.cache.num_cached == 1
    assert bm.match(Tokens(list(range(7)) + [50, 51])).num_tokens == 4


def test_a_different_earlier_block_changes_every_later_key() -> None:
    bm = caching(8)
    bm.allocate(0, 12)
    bm.cache_blocks(0, Tokens(list(range(12))), 12)
    other = list(range(12))
    other[1] = 77  # the second block is the same, its parent is not
    assert bm.match(Tokens(other + [1])).num_tokens == 0


def test_lookahead_key_covers_the_next_token() -> None:
    bm = caching(8, lookahead=1)
    a = Tokens(list(range(12)))
    bm.allocate(0, 12)
    assert bm.cache_blocks(0, a, 12) == 2  # the third block has no next token yet
    assert bm.match(Tokens(list(range(9)) + [40])).num_tokens == 8  # token 8 follows block 1 in both
    assert bm.match(Tokens(list(range(8)) + [40, 41])).num_tokens == 4  # block 1 is followed by another token


def test_unreferenced_cached_blocks_are_evicted_least_recently_released_first() -> None:
    bm = caching(4, block_size=2)
    for sid, base in ((0, 0), (1, 100)):
        seq = Tokens([base + i for i in range(4)])
        bm.allocate(sid, 4)
        bm.cache_blocks(sid, seq, 4)
    bm.free(0)  # released first: evicted first (its tail block before its head)
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.cache.num_evictable == 4
    bm.allocate(2, 2)  # one fresh block: sequence 0's second block goes
    assert bm.match(Tokens([0, 1, 2, 3, 4])).num_tokens == 2
    assert bm.match(Tokens([100, 101, 102, 103, 104])).num_tokens == 4
    bm.allocate(3, 2)
    assert bm.match(Tokens([0, 1, 2, 3, 4])).num_tokens == 0
    assert bm.match(Tokens([100, 101, 102, 103, 104])).num_tokens == 4


def test_a_hit_takes_its_blocks_out_of_the_eviction_queue() -> None:
    bm = caching(3, block_size=2)
    seq = Tokens([1, 2, 3, 4, 5])
    bm.allocate(0, 5)
    bm.cache_blocks(0, seq, 5)
    bm.free(0)
    hit = bm.match(seq)
    assert hit.num_tokens == 4
    assert bm.can_allocate(6, hit) and not bm.can_allocate(8, hit)  # 2 cached + 1 fresh of 3
    table = bm.allocate(1, 6, hit)
    assert table[:2] == list(hit.blocks)
    assert bm.num_free_blocks == 0 and bm.cache.num_evictable == 0
    with pytest.raises(NoFreeBlocks):
        bm.append(1, 1)  # the shared blocks cannot be evicted while held


def test_duplicate_content_keeps_the_first_block_and_frees_the_second() -> None:
    bm = caching(4, block_size=2)
    seq = Tokens([1, 2, 3])
    bm.allocate(0, 3)
    bm.allocate(1, 3)  # admitted together: neither found the other
    bm.cache_blocks(0, seq, 3)
    bm.cache_blocks(1, seq, 3)
    assert bm.cache.num_cached == 1 and bm.match(seq).blocks == (bm.table(0)[0],)
    bm.free(1)
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.cache.num_evictable == 1


def test_caching_off_finds_nothing() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(0, 9)
    assert bm.cache_blocks(0, Tokens(list(range(9))), 9) == 0
    assert bm.match(Tokens(list(range(9)))).num_tokens == 0


def test_random_sharing_never_leaks_or_shares_a_written_block() -> None:
    """Sequences over few prefixes: held blocks are counted once per table, every block is free,
    held or cached, and only full settled blocks (never the block a sequence writes) are shared."""
    rng = random.Random(1)
    bm = caching(24, block_size=2)
    prefixes = [[rng.randrange(50) for _ in range(9)] for _ in range(3)]
    live: dict[int, Tokens] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            seq = Tokens(list(rng.choice(prefixes)[: rng.randint(1, 9)]) + [rng.randrange(50)])
            hit = bm.match(seq)
            if bm.can_allocate(seq.num_tokens, hit):
                bm.allocate(step, seq.num_tokens, hit)
                live[step] = seq
        elif op < 0.75 and live:
            sid = rng.choice(sorted(live))
            seq = live[sid]
            bm.cache_blocks(sid, seq, seq.num_tokens - 1)  # all but the last token computed
            if bm.can_append(sid, 1):
                seq.ids.append(rng.randrange(50))
                bm.append(sid, 1)
        elif live:
            sid = rng.choice(sorted(live))
            bm.free(sid)
            del live[sid]
        held: dict[int, int] = {}
        for sid, seq in live.items():
            table = bm.table(sid)
            assert len(table) == bm.blocks_for(bm.num_slots(sid))
            for b in table:
                held[b] = held.get(b, 0) + 1
        for sid, seq in live.items():  # the block the next token is written to is this sequence's alone
            write_block = bm.table(sid)[(seq.num_tokens - 1) // 2]
            assert held[write_block] == 1 and not bm.cache.is_cached(write_block)
        assert len(held) + bm.num_free_blocks == 24
        assert not any(bm.cache.is_evictable(b) for b in held)
    for sid in list(live):
        bm.free(sid)
    assert bm.num_free_blocks == 24
