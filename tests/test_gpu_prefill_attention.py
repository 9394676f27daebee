"""GPU (-m gpu): the Triton paged prefill attention equals the torch references at bf16 on real shapes
(Llama-3-8B: 32 heads / 8 KV heads, dim 128; MLA's former expanded cache: 128 heads, K 192, V 128 — the
latent cache MLA keeps now is tests/test_gpu_mla_attention.py's) and a CUDA graph of a chain-verify step
(4 sequences x 4 new tokens) replays what the eager call computes.

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_prefill_attention.py -m gpu``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BLOCK = 16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _step(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, kdim: int, vdim: int,
          seed: int) -> tuple[KVCache, KVCache, Callable[[KVCache], ForwardBatch], torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    """A bf16 step over scattered blocks: (cache, its clone, batch maker, q, k, v)."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in context_lens) + 8
    kv = KVCache.allocate({0: (kv_heads, kdim, vdim)}, num_blocks, BLOCK, bf, dev)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, device=dev, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, device=dev, generator=g))
    perm = torch.randperm(num_blocks, device=dev, generator=g).tolist()
    tables, slots = [], []
    for q_len, c in zip(query_lens, context_lens):
        n = -(-c // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - q_len, c)]
    t = sum(query_lens)
    q = torch.randn(t, heads, kdim, device=dev, dtype=bf, generator=g)
    k = torch.randn(t, kv_heads, kdim, device=dev, dtype=bf, generator=g)
    v = torch.randn(t, kv_heads, vdim, device=dev, dtype=bf, generator=g)
    slot_mapping = torch.tensor(slots, device=dev)

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(t, dtype=torch.long, device=dev)
        return ForwardBatch(zeros, zeros, query_lens, context_lens, slot_mapping, tables, cache)

    ref = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, num_blocks)
    return kv, ref, batch, q, k, v


def test_llama_8b_shape_prompt_chunk_and_decode_equal_torch() -> None:
    """A 2k-token prompt, a 128-token chunk over 1024 cached tokens and a decode row, GQA 4."""
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton

    kv, ref, batch, q, k, v = _step([2048, 128, 1], [2048, 1152, 700], 32, 8, 128, 128, seed=0)
    got = paged_prefill_attention_triton(q, k, v, 0, batch(kv), 128**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref), 128**-0.5)
    assert _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref.k[0]) and torch.equal(kv.v[0], ref.v[0])


def test_mla_shape_prompt_and_chunk_equal_reference() -> None:
    """MLA's former expanded cache at DeepSeek-V3's heads: a 1k-token prompt and a 128-token chunk over 896 cached tokens.
    (paged_attention_torch's fp32 gather would take ~170 GiB here: the per-sequence reference instead.)"""
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton

    kv, ref, batch, q, k, v = _step([1024, 128], [1024, 1024], 128, 128, 192, 128, seed=1)
    got = paged_prefill_attention_triton(q, k, v, 0, batch(kv), 192**-0.5)
    want = paged_attention_reference(q, k, v, 0, batch(ref), 192**-0.5)
    assert _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref.k[0]) and torch.equal(kv.v[0], ref.v[0])


def test_chain_verify_step_replays_as_a_cuda_graph() -> None:
    """4 sequences x 4 new tokens through the kernel set's attention, captured once on static buffers,
    replayed for two layouts (contexts 9..1500): equal to the eager call on a copy of the cache."""
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton

    dev, bf = "cuda", torch.bfloat16
    b, n, heads, kv_heads, dim, max_blocks = 4, 4, 32, 8, 128, 96
    g = torch.Generator(device=dev).manual_seed(2)
    num_blocks = b * max_blocks + 1
    kv = KVCache.allocate({0: (kv_heads, dim)}, num_blocks, BLOCK, bf, dev)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, device=dev, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, device=dev, generator=g))
    q, k, v = (torch.zeros(b * n, h, dim, device=dev, dtype=bf) for h in (heads, kv_heads, kv_heads))
    meta = PagedAttentionMetadata.from_lists([n] * b, [n] * b, [[0]] * b, dev, max_blocks=max_blocks)
    slots = torch.zeros(b * n, dtype=torch.long, device=dev)
    zeros = torch.zeros(b * n, dtype=torch.long, device=dev)
    static = ForwardBatch(zeros, zeros, [n] * b, [n] * b, slots, [[0]] * b, kv, paged=meta)

    def load(context_lens: list[int]) -> ForwardBatch:
        """Write a layout into the static buffers; return the same step as an eager batch on a cache copy."""
        perm = torch.randperm(num_blocks - 1, device=dev, generator=g).tolist()
        tables = [perm[i * max_blocks: i * max_blocks + -(-c // BLOCK)] for i, c in enumerate(context_lens)]
        fresh = PagedAttentionMetadata.from_lists([n] * b, context_lens, tables, dev, max_blocks=max_blocks)
        for name in ("block_tables", "context_lens", "token_index"):
            getattr(meta, name).copy_(getattr(fresh, name))
        slots.copy_(torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t, c in zip(tables, context_lens)
                                  for p in range(c - n, c)], device=dev))
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device=dev, generator=g))
        copy = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, num_blocks)
        return ForwardBatch(zeros, zeros, [n] * b, context_lens, slots.clone(), tables, copy)

    load([9, 40, 700, 1500])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        paged_decode_attention_triton(q, k, v, 0, static, dim**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(q, k, v, 0, static, dim**-0.5)
    for context_lens in ([17, 1500, 4, 333], [1200, 9, 64, 65]):
        eager = load(context_lens)
        graph.replay()
        want = paged_decode_attention_triton(q.clone(), k.clone(), v.clone(), 0, eager, dim**-0.5)
        assert eager.kv_cache is not None
        assert _rel(out, want) < 1e-3
        assert torch.equal(kv.k[0], eager.kv_cache.k[0]) and torch.equal(kv.v[0], eager.kv_cache.v[0])


def test_prompts_of_other_lengths_and_batch_sizes_compile_nothing_new() -> None:
    """The split count and the sequence search's steps follow a step's tokens and sequences; they are kernel
    arguments, not compile-time constants, so a prompt of another length or a batch of more sequences (here
    1 x 200 tokens, then 3 sequences of 40 / 600 / 90) compiles no new variant of the prefill kernel or of the
    splits' combine, and still equals the torch path."""
    from fusedserve.models.layers.attention_splits_triton import _combine_kernel
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.models.layers.prefill_attention_triton import (
        _prefill_kernel,
        paged_prefill_attention_triton,
    )

    def variants() -> int:
        return sum(len(c[0]) for k in (_prefill_kernel, _combine_kernel) for c in k.device_caches.values())

    kv, _, batch, q, k, v = _step([200], [200], 32, 8, 128, 128, seed=2)
    paged_prefill_attention_triton(q, k, v, 0, batch(kv), 128**-0.5)
    before = variants()
    kv, ref, batch, q, k, v = _step([40, 600, 90], [40, 600, 90], 32, 8, 128, 128, seed=3)
    got = paged_prefill_attention_triton(q, k, v, 0, batch(kv), 128**-0.5)
    assert variants() == before
    assert _rel(got, paged_attention_torch(q, k, v, 0, batch(ref), 128**-0.5)) < 1e-2
