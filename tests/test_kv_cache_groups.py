"""KVCache.allocate's groups: every layer's K and V are views of one tensor per shape, and moving slots
(StepExecutor.copy_kv, a tree verify's accepted nodes) through the groups equals moving them layer by
layer, the MLA latent layout (V a view of K) included."""

from __future__ import annotations

import torch

from fusedserve.models.forward_batch import KVCache, KVShape
from fusedserve.worker.executor.executor import StepExecutor


def _filled(shapes: dict[int, tuple[int, ...] | KVShape]) -> KVCache:
    kv = KVCache.allocate(shapes, num_blocks=6, block_size=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for t in kv.stored():
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def test_layers_of_one_shape_share_one_tensor_and_stay_separate() -> None:
    kv = _filled({0: (2, 8), 1: (2, 8), 2: (1, 16), 3: KVShape(1, 12, 8, v_in_k=True)})
    assert [tuple(g.shape) for g in kv.groups] == [(4, 24, 2, 8), (2, 24, 1, 16), (1, 24, 1, 12)]
    assert all(t.untyped_storage().data_ptr() == kv.groups[0].untyped_storage().data_ptr()
               for t in (kv.k[0], kv.v[0], kv.k[1], kv.v[1]))
    assert kv.v[3].data_ptr() == kv.k[3].data_ptr() and kv.v[3].shape == (24, 1, 8)
    assert list(kv.k) == [0, 1, 2, 3] and list(kv.v) == [0, 1, 2, 3]
    kv.k[0].zero_()
    assert kv.v[0].abs().sum() > 0 and kv.k[1].abs().sum() > 0
    assert kv.bytes_per_token() == 4 * (2 * 2 * 8 * 2 + 16 + 16 + 12)


def test_copy_kv_through_the_groups_equals_layer_by_layer() -> None:
    shapes: dict[int, tuple[int, ...] | KVShape] = {0: (2, 8), 1: (2, 8), 2: KVShape(1, 12, 8, v_in_k=True)}
    kv = _filled(shapes)
    want = [t.clone() for t in kv.stored()]
    src, dst = [5, 6, 9, 2], [3, 4, 5, 6]  # overlapping: every source is read before any is written
    for t in want:
        t[torch.tensor(dst)] = t[torch.tensor(src)].clone()
    executor = StepExecutor.__new__(StepExecutor)  # copy_kv needs only the cache, the device and its move
    executor.kv_cache, executor.device, executor.move_kv = kv, torch.device("cpu"), KVCache.move
    executor.copy_kv(src, dst)
    assert all(torch.equal(got, w) for got, w in zip(kv.stored(), want))
