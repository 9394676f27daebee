"""The graph-capturable torch paged attention equals the per-sequence reference (CPU, fast).

Layouts: decode (one token per sequence), prefill, chunked prefill and verify-like mixes, GQA
groups 1/4, blocks scattered through the cache, fp32 and bf16; the device metadata built from the
lists, and its decode form built on the device.
"""

from __future__ import annotations

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
from fusedserve.models.layers.attention import paged_attention_reference
from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

BLOCK = 4


def _batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, dim: int,
           dtype: torch.dtype, seed: int) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in context_lens) + 3
    kv = KVCache.allocate({0: (kv_heads, dim)}, num_blocks, BLOCK, dtype)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))  # earlier tokens' K/V (and stale slots)
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    tables, slots = [], []
    for q, c in zip(query_lens, context_lens):
        n = -(-c // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - q, c)]
    t = sum(query_lens)
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.tensor([p for q_, c in zip(query_lens, context_lens) for p in range(c - q_, c)]),
        query_lens=query_lens, context_lens=context_lens, slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables, kv_cache=kv)
    return batch, q, k, v


def _copy(batch: ForwardBatch) -> ForwardBatch:
    assert batch.kv_cache is not None
    kv = batch.kv_cache
    clone = KVCache({i: t.clone() for i, t in kv.k.items()}, {i: t.clone() for i, t in kv.v.items()},
                    kv.block_size, kv.num_blocks)
    return ForwardBatch(batch.input_ids, batch.positions, batch.query_lens, batch.context_lens, batch.slot_mapping,
                        batch.block_tables, clone)


LAYOUTS = {
    "decode": ([1, 1, 1], [1, 9, 17]),
    "prefill": ([5, 8], [5, 8]),
    "chunked": ([3, 1, 4], [10, 6, 4]),
    "verify": ([4, 4], [12, 7]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_reference(layout: str, group: int, dtype: torch.dtype) -> None:
    query_lens, context_lens = LAYOUTS[layout]
    kv_heads, dim = 2, 16
    batch, q, k, v = _batch(query_lens, context_lens, kv_heads * group, kv_heads, dim, dtype, seed=group)
    ref_batch = _copy(batch)
    got = paged_attention_torch(q, k, v, 0, batch, dim**-0.5)
    want = paged_attention_reference(q, k, v, 0, ref_batch, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()
    assert batch.kv_cache is not None and ref_batch.kv_cache is not None
    assert torch.equal(batch.kv_cache.k[0], ref_batch.kv_cache.k[0])  # the same K/V written
    assert torch.equal(batch.kv_cache.v[0], ref_batch.kv_cache.v[0])


def test_metadata_from_lists_and_decode_form_agree() -> None:
    meta = PagedAttentionMetadata.from_lists([1, 3], [6, 3], [[7, 2], [5]], max_blocks=3)
    assert meta.block_tables.tolist() == [[7, 2, 0], [5, 0, 0]]
    assert meta.token_seq.tolist() == [0, 1, 1, 1] and meta.token_index.tolist() == [5, 0, 1, 2]
    assert meta.max_query_len == 3 and meta.query_start.tolist() == [0, 1, 4]
    dec = PagedAttentionMetadata.decode(meta.block_tables, torch.tensor([6, 1], dtype=torch.int32))
    assert dec.token_seq.tolist() == [0, 1] and dec.token_index.tolist() == [5, 0] and dec.max_query_len == 1
    assert dec.query_start.tolist() == [0, 1, 2] and dec.query_start.dtype == torch.int32


def test_padding_rows_on_a_pad_slot_leave_real_sequences_alone() -> None:
    """A padded decode row (context 1, block 0, writing a spare slot) changes no real row's output."""
    batch, q, k, v = _batch([1, 1], [5, 9], 4, 2, 16, torch.float32, seed=3)
    assert batch.kv_cache is not None
    spare = set(range(batch.kv_cache.num_blocks)) - {b for t in batch.block_tables for b in t}
    pad_slot = min(spare) * BLOCK + BLOCK - 1
    alone = paged_attention_torch(q, k, v, 0, _copy(batch), 0.25)
    padded = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.long), positions=torch.cat([batch.positions, torch.zeros(1).long()]),
        query_lens=[1, 1, 1], context_lens=[5, 9, 1], slot_mapping=torch.cat([batch.slot_mapping,
                                                                               torch.tensor([pad_slot])]),
        block_tables=batch.block_tables + [[0]], kv_cache=batch.kv_cache)
    out = paged_attention_torch(torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), 0, padded, 0.25)
    assert torch.allclose(out[:2], alone, atol=1e-6) and torch.isfinite(out).all()
