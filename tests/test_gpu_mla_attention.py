"""GPU (-m gpu): MLA's latent cache at DeepSeek-V3's real shapes through the Triton kernels, bf16.

The cache holds one KV head of K 576 = [latent 512 | rope 64] per token, V = its first 512 columns
(``KVShape(1, 576, 512, v_in_k=True)``); every query head of a rank attends to it (128 heads at
attention-TP 1, 16 at 8). Checked against the per-sequence torch reference: split-KV decode at batch
1..64 over contexts up to 4k, prefill / chunked prefill / decode rows in one step, a decode step
captured as a CUDA graph and replayed for new layouts, and one absorbed MLA layer (random DeepSeek-V3
weights, prefill then decode through the Triton set) against the expanded per-head form in fp32.

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_mla_attention.py -m gpu``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache, KVShape, PagedAttentionMetadata

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(REPO))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BLOCK = 16
RANK, ROPE = 512, 64
SHAPE = KVShape(1, RANK + ROPE, RANK, v_in_k=True)
SCALE = (128 + 64) ** -0.5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _step(query_lens: list[int], context_lens: list[int], heads: int, seed: int
          ) -> tuple[KVCache, KVCache, Callable[[KVCache], ForwardBatch], torch.Tensor, torch.Tensor]:
    """A bf16 step over a latent cache of scattered blocks: (cache, its copy, batch maker, q, k)."""
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in context_lens) + 8
    kv = KVCache.allocate({0: SHAPE}, num_blocks, BLOCK, bf, dev)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, device=dev, generator=g))
    perm = torch.randperm(num_blocks, device=dev, generator=g).tolist()
    tables, slots = [], []
    for q_len, c in zip(query_lens, context_lens):
        n = -(-c // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - q_len, c)]
    t = sum(query_lens)
    q = torch.randn(t, heads, RANK + ROPE, device=dev, dtype=bf, generator=g)
    k = torch.randn(t, 1, RANK + ROPE, device=dev, dtype=bf, generator=g)
    slot_mapping = torch.tensor(slots, device=dev)

    def batch(cache: KVCache) -> ForwardBatch:
        zeros = torch.zeros(t, dtype=torch.long, device=dev)
        return ForwardBatch(zeros, zeros, query_lens, context_lens, slot_mapping, tables, cache)

    ref = KVCache.allocate({0: SHAPE}, num_blocks, BLOCK, bf, dev)
    ref.k[0].copy_(kv.k[0])
    return kv, ref, batch, q, k


@pytest.mark.parametrize("heads", [128, 16], ids=["attn-tp1", "attn-tp8"])
@pytest.mark.parametrize("batch_size", [1, 8, 64])
def test_latent_decode_equals_reference(heads: int, batch_size: int) -> None:
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton

    g = torch.Generator().manual_seed(batch_size)
    ctx = torch.randint(1, 4097, (batch_size,), generator=g).tolist()
    ctx[0] = 4096
    kv, ref, batch, q, k = _step([1] * batch_size, ctx, heads, seed=heads + batch_size)
    got = paged_decode_attention_triton(q, k, k[..., :RANK], 0, batch(kv), SCALE)
    want = paged_attention_reference(q, k, k[..., :RANK], 0, batch(ref), SCALE)
    assert _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref.k[0])


@pytest.mark.parametrize("heads", [128, 16], ids=["attn-tp1", "attn-tp8"])
def test_latent_prefill_chunk_and_decode_rows_equal_reference(heads: int) -> None:
    """A 1k-token prompt, a 128-token chunk over 896 cached tokens and two decode rows in one step."""
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.prefill_attention_triton import paged_prefill_attention_triton

    kv, ref, batch, q, k = _step([1024, 128, 1, 1], [1024, 1024, 300, 2000], heads, seed=heads)
    got = paged_prefill_attention_triton(q, k, k[..., :RANK], 0, batch(kv), SCALE)
    want = paged_attention_reference(q, k, k[..., :RANK], 0, batch(ref), SCALE)
    assert _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref.k[0])


def test_latent_decode_replays_as_a_cuda_graph() -> None:
    """8 sequences x 128 heads decoding, captured once on static buffers (block tables 256 wide), replayed
    for two layouts (contexts 1..4000): equal to the eager call on a copy of the cache."""
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton

    dev, bf = "cuda", torch.bfloat16
    b, heads, max_blocks = 8, 128, 256
    g = torch.Generator(device=dev).manual_seed(3)
    num_blocks = b * max_blocks + 1
    kv = KVCache.allocate({0: SHAPE}, num_blocks, BLOCK, bf, dev)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, device=dev, generator=g))
    q = torch.zeros(b, heads, RANK + ROPE, device=dev, dtype=bf)
    k = torch.zeros(b, 1, RANK + ROPE, device=dev, dtype=bf)
    meta = PagedAttentionMetadata.decode(torch.zeros(b, max_blocks, dtype=torch.int32, device=dev),
                                         torch.ones(b, dtype=torch.int32, device=dev))
    slots = torch.zeros(b, dtype=torch.long, device=dev)
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    static = ForwardBatch(zeros, zeros, [1] * b, [1] * b, slots, [[0]] * b, kv, paged=meta)

    def load(context_lens: list[int]) -> ForwardBatch:
        perm = torch.randperm(num_blocks - 1, device=dev, generator=g).tolist()
        tables = [perm[i * max_blocks: i * max_blocks + -(-c // BLOCK)] for i, c in enumerate(context_lens)]
        fresh = PagedAttentionMetadata.from_lists([1] * b, context_lens, tables, dev, max_blocks=max_blocks)
        meta.block_tables.copy_(fresh.block_tables)
        meta.context_lens.copy_(fresh.context_lens)
        meta.token_index.copy_(fresh.token_index)
        slots.copy_(torch.tensor([t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK
                                  for t, c in zip(tables, context_lens)], device=dev))
        for x in (q, k):
            x.copy_(torch.randn(x.shape, device=dev, generator=g))
        copy = KVCache.allocate({0: SHAPE}, num_blocks, BLOCK, bf, dev)
        copy.k[0].copy_(kv.k[0])
        return ForwardBatch(zeros, zeros, [1] * b, context_lens, slots.clone(), tables, copy)

    load([9, 40, 700, 1500, 1, 64, 4000, 333])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        paged_decode_attention_triton(q, k, k[..., :RANK], 0, static, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(q, k, k[..., :RANK], 0, static, SCALE)
    for context_lens in ([17, 3999, 4, 333, 2048, 65, 1, 1000], [1200, 9, 64, 65, 4000, 3000, 2, 512]):
        eager = load(context_lens)
        graph.replay()
        want = paged_decode_attention_triton(q.clone(), k.clone(), k.clone()[..., :RANK], 0, eager, SCALE)
        assert eager.kv_cache is not None
        assert _rel(out, want) < 1e-3
        assert torch.equal(kv.k[0], eager.kv_cache.k[0])


def test_absorbed_layer_at_deepseek_v3_shapes_equals_the_expanded_form() -> None:
    """One MLA layer (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, YaRN) with random bf16 weights:
    a 256-token prefill and 4 decode steps through the Triton set's attention, against the expanded
    per-head form of the same weights in fp32 (tests/test_mla_latent.py's ``expanded``)."""
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.layers.mla import MLADims, MLAttention
    from fusedserve.models.layers.mla_rotary import MLARotary, mla_softmax_scale
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import init_random_
    from tests.test_mla_latent import expanded

    dims = MLADims(hidden=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
    group = ParallelGroups.single_rank().attn_tp

    rotary = MLARotary(64, 10000.0, rope, 163840, interleave=True).cuda()
    scale = mla_softmax_scale(192, rope)
    plain = MLAttention(0, dims, group, rotary, scale, dtype=torch.float32, device="cuda")
    init_random_(plain, seed=1)
    fast = MLAttention(0, dims, group, rotary, scale, dtype=torch.bfloat16, device="cuda",
                       attention_backend=Kernels.triton().attention)
    fast.load_state_dict(plain.state_dict())  # the same weights, rounded to bf16
    fast.derive_from_weights()
    n, steps = 256, 4
    x = torch.randn(n + steps, 7168, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    want = expanded(plain, x, torch.arange(n + steps, device="cuda"),
                    torch.ones(n + steps, n + steps, dtype=torch.bool, device="cuda").tril())
    kv = KVCache.allocate({0: fast.kv_shape()}, 32, BLOCK, torch.bfloat16, "cuda")
    table = list(range(31, 31 - -(-(n + steps) // BLOCK), -1))  # blocks in reverse order

    def forward(span: range) -> torch.Tensor:
        pos = torch.tensor(list(span), device="cuda")
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in span], device="cuda")
        batch = ForwardBatch(torch.zeros(len(span), dtype=torch.long, device="cuda"), pos, [len(span)], [span.stop],
                             slots, [table], kv)
        with torch.no_grad():
            return fast(x[span.start: span.stop].bfloat16(), batch).partial

    got = torch.cat([forward(range(0, n))] + [forward(range(n + i, n + i + 1)) for i in range(steps)])
    assert _rel(got, want) < 3e-2
    assert _rel(got[n:], want[n:]) < 3e-2
