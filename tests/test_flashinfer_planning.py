"""The FlashInfer planner's host side on CPU: a captured tree shape's packed mask (what the kernel reads:
per sequence, bit ``qo * kv_len + kv`` from the sequence's byte offset, little-endian) against the
layout's own full masks. The GPU side (the packed plan against FlashInfer's own packing, and no wait
for the device while planning) is tests/test_gpu_attention.py."""

from __future__ import annotations

import random

import numpy as np

from fusedserve.models.layers.attention_flashinfer import pack_tree_masks
from fusedserve.models.layers.attention_layout import AttentionLayout


def _tail(parents: tuple[int, ...]) -> tuple[bool, ...]:
    n = len(parents)
    rows = []
    for i in range(n):
        row, a = [False] * n, i
        while a >= 0:
            row[a] = True
            a = parents[a]
        rows += row
    return tuple(rows)


def _read(packed: np.ndarray, offset: int, q: int, kv: int) -> list[bool]:
    bits = np.unpackbits(packed[offset:], bitorder="little")
    return [bool(b) for b in bits[: q * kv]]


def test_packed_masks_are_each_sequences_full_mask_from_a_byte_boundary() -> None:
    rng = random.Random(5)
    qo, kv, masks = [], [], []
    for _ in range(7):
        n = rng.randint(1, 9)
        parents = tuple([-1] + [rng.randrange(i) for i in range(1, n)])
        qo.append(n)
        kv.append(n + rng.randint(0, 70))
        masks.append(_tail(parents) if rng.random() < 0.7 else None)  # some causal rows between trees
    layout = AttentionLayout(tuple(qo), tuple(kv), tuple((0,) for _ in qo), tuple(masks))
    packed, offsets = pack_tree_masks(layout)
    assert offsets[0] == 0 and len(offsets) == len(qo) + 1 and offsets[-1] == packed.size
    for i, (q, k) in enumerate(zip(qo, kv)):
        assert offsets[i + 1] - offsets[i] == -(-q * k // 8)  # whole bytes, no more
        assert _read(packed, offsets[i], q, k) == layout.full_mask(i), i


def test_an_empty_sequence_is_packed_at_the_length_the_kernel_sees() -> None:
    layout = AttentionLayout((2, 2), (0, 4), ((0,), (1,)), (None, (True, False, True, True)))
    packed, offsets = pack_tree_masks(layout)
    assert offsets == [0, 1, 2]  # the empty one: 2 x 1 bits (its page list reads one slot)
    assert _read(packed, offsets[1], 2, 4) == layout.full_mask(1)
