"""Paged KV block allocator: accounting, growth, watermark, no block shared or leaked."""

from __future__ import annotations

import random

import pytest
from fusedserve.worker.engine.block_manager import BlockManager, NoFreeBlocks


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
