"""The FlashInfer planner's host side on CPU: the full masks an eager tree forward hands FlashInfer (each
sequence's [qo, kv] mask at the context length its kernel sees) against the layout's own. The GPU side
(the eager custom-mask plan against the reference and against a captured shape's device-only kernels) is
tests/test_gpu_attention.py."""

from __future__ import annotations

import random

from fusedserve.models.layers.attention_flashinfer import full_masks
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


def test_full_masks_are_each_sequences_mask_causal_rows_included() -> None:
    rng = random.Random(5)
    qo, kv, masks = [], [], []
    for _ in range(7):
        n = rng.randint(1, 9)
        parents = tuple([-1] + [rng.randrange(i) for i in range(1, n)])
        qo.append(n)
        kv.append(n + rng.randint(0, 70))
        masks.append(_tail(parents) if rng.random() < 0.7 else None)  # some causal rows between trees
    layout = AttentionLayout(tuple(qo), tuple(kv), tuple((0,) for _ in qo), tuple(masks))
    got = full_masks(layout)
    assert len(got) == len(qo)
    for i, (q, k) in enumerate(zip(qo, kv)):
        assert got[i].shape == (q, k) and got[i].ravel().tolist() == list(layout.full_mask(i)), i


def test_an_empty_sequence_is_masked_at_the_length_the_kernel_sees() -> None:
    layout = AttentionLayout((2, 2), (0, 4), ((0,), (1,)), (None, (True, False, True, True)))
    got = full_masks(layout)
    assert got[0].shape == (2, 1)  # its page list reads one slot
    assert got[1].ravel().tolist() == list(layout.full_mask(1))
