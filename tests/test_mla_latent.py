"""MLA over the latent cache (``models/layers/mla.py``): the absorbed attention equals HF's expanded form.

One MLA layer with random weights (fp32, heads 8, kv_lora 32, nope/rope/v 16/8/24, YaRN with
mscale != mscale_all_dim) runs through its serving path — latent cache, absorbed queries, W_UV after
the attention — and its outputs are compared with the expanded per-head form written out here (K =
[kv_b's k_nope | rope(k_r)], V = kv_b's v, masked softmax over the whole sequence, o_proj), for
prefill, chunked prefill over a cached prefix beside decode rows, decode, and a speculative tree (a
tail mask), on the reference and the graph-capturable torch backends; the same with block-FP8
weights (W_UK / W_UV dequantized at load). Plus the cache layout (K alone stored, V a view, its bytes
at DeepSeek-V3's shape), the kernel-set choice for MLA, and the tiny DeepSeek-V3 engine's padded
static-shape steps (``cuda_graphs=True``, run eagerly on CPU) against its eager steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedserve.models.forward_batch import ForwardBatch, KVCache, KVShape, PagedAttentionMetadata
from fusedserve.models.layers.attention import AttentionBackend, paged_attention_reference
from fusedserve.models.layers.fp8_block import BlockFP8, dequantize_weight
from fusedserve.models.layers.mla import MLADims, MLAttention
from fusedserve.models.layers.mla_rotary import MLARotary, mla_softmax_scale
from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
from fusedserve.models.parallel.groups import Group, ParallelGroups
from fusedserve.models.random_init import init_random_

DIMS = MLADims(hidden=64, num_heads=8, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=24)
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 64}
BLOCK = 4
NUM_BLOCKS = 16
TOL = 1e-5
BACKENDS: dict[str, AttentionBackend] = {"reference": paged_attention_reference, "torch": paged_attention_torch}


def mla(backend: AttentionBackend, fp8: BlockFP8 | None = None, seed: int = 0) -> MLAttention:
    rotary = MLARotary(DIMS.qk_rope_head_dim, ROPE["rope_theta"], ROPE, 256, interleave=True)
    attn = MLAttention(0, DIMS, ParallelGroups.single_rank().attn_tp, rotary,
                       mla_softmax_scale(DIMS.qk_head_dim, ROPE), attention_backend=backend, fp8=fp8)
    init_random_(attn, seed, std=0.2)  # peaked attention, so a wrong mask or position shows
    return attn


@torch.no_grad()
def expanded(attn: MLAttention, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's form over a whole sequence. x: [L, hidden]; mask: [L, L] (row may attend column) -> [L, hidden]"""
    d, n, heads = attn.dims, x.shape[0], attn.heads
    q, kv_a = attn._projections(x)
    q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
    latent, k_rope = kv_a.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
    q_rope, k_rope = attn.rotary(positions, q_rope, k_rope.view(n, 1, d.qk_rope_head_dim))
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(n, heads, d.qk_nope_head_dim + d.v_head_dim)
    k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)
    k = torch.cat((k_nope, k_rope.expand(n, heads, d.qk_rope_head_dim)), dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(dim=-1)
    o = torch.einsum("hqk,khd->qhd", probs, v)
    return attn.o_proj(o.reshape(n, heads * d.v_head_dim))  # type: ignore[no-any-return]


class Sequences:
    """Sequences of random hidden states fed to one MLA layer a slice at a time through a latent cache."""

    def __init__(self, attn: MLAttention, lengths: list[int], tables: list[list[int]], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.attn, self.tables = attn, tables
        self.x = [torch.randn(n, DIMS.hidden, generator=g) for n in lengths]
        self.cache = KVCache.allocate({0: attn.kv_shape()}, NUM_BLOCKS, BLOCK, torch.float32)

    def slots(self, s: int, positions: range) -> list[int]:
        return [self.tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    @torch.no_grad()
    def step(self, spans: dict[int, range]) -> dict[int, torch.Tensor]:
        """One forward of sequence s's tokens ``spans[s]`` (the earlier ones cached) -> s -> [tokens, hidden]."""
        seqs = list(spans)
        batch = ForwardBatch(
            input_ids=torch.zeros(sum(len(r) for r in spans.values()), dtype=torch.long),
            positions=torch.tensor([p for s in seqs for p in spans[s]]),
            query_lens=[len(spans[s]) for s in seqs], context_lens=[spans[s].stop for s in seqs],
            slot_mapping=torch.tensor([slot for s in seqs for slot in self.slots(s, spans[s])]),
            block_tables=[self.tables[s] for s in seqs], kv_cache=self.cache)
        out = self.attn(torch.cat([self.x[s][spans[s].start: spans[s].stop] for s in seqs]), batch).partial
        return dict(zip(seqs, out.split([len(spans[s]) for s in seqs])))


@pytest.mark.parametrize("fp8", [None, BlockFP8(8, 8)], ids=["bf16-weights", "block-fp8"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_chunks_and_decode_equal_the_expanded_form(backend: str, fp8: BlockFP8 | None) -> None:
    """Two sequences over scattered blocks: prefill 7 and 3, a 5-token chunk over 7 cached beside a
    decode row, both decoding, then two chunks; every new row equals the expanded form's."""
    attn = mla(BACKENDS[backend], fp8)
    seqs = Sequences(attn, [20, 9], [[9, 2, 7, 4, 11], [0, 5, 3]], seed=1)
    schedule = [{0: range(0, 7), 1: range(0, 3)}, {0: range(7, 12), 1: range(3, 4)},
                {0: range(12, 13), 1: range(4, 5)}, {0: range(13, 20), 1: range(5, 9)}]
    want = {s: expanded(attn, x, torch.arange(len(x)), torch.ones(len(x), len(x), dtype=torch.bool).tril())
            for s, x in enumerate(seqs.x)}
    for step in schedule:
        for s, got in seqs.step(step).items():
            torch.testing.assert_close(got, want[s][step[s].start: step[s].stop], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_tree_verify_equals_the_expanded_form(backend: str) -> None:
    """A draft tree of 5 nodes over 9 cached tokens: each node sees the prefix, its ancestors and itself
    (reference: ``batch.attn_masks``; torch: the metadata's device ``tail_mask``, as a captured graph)."""
    from fusedserve.worker.executor.step import ancestor_mask
    from fusedserve.worker.spec_decode.draft_tree import tree_attention_mask

    attn = mla(BACKENDS[backend], seed=3)
    parents, cached = (-1, 0, 0, 1, 2), 9
    n = len(parents)
    seqs = Sequences(attn, [cached + n], [[6, 1, 8, 13]], seed=4)
    seqs.step({0: range(0, cached)})
    depth = [0] * n
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    positions = torch.tensor(list(range(cached)) + [cached + d for d in depth])
    tree = tree_attention_mask(parents, cached)
    full = torch.ones(cached + n, cached + n, dtype=torch.bool).tril()
    full[cached:] = tree
    want = expanded(attn, seqs.x[0], positions, full)[cached:]
    slots = torch.tensor(seqs.slots(0, range(cached, cached + n)))
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), positions[cached:], [n], [cached + n], slots,
                         [seqs.tables[0]], seqs.cache)
    if backend == "reference":
        batch.attn_masks = [tree]
    else:
        meta = PagedAttentionMetadata.from_lists([n], [cached + n], seqs.tables, max_blocks=6)
        meta.tail_mask = torch.tensor(ancestor_mask(parents)).view(n, n)
        batch.paged = meta
    with torch.no_grad():
        got = attn(seqs.x[0][cached:], batch).partial
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_absorbed_weights_are_kv_b_halves_in_the_compute_dtype() -> None:
    """W_UK / W_UV are kv_b_proj's per-head rows [nope | v], dequantized once (bf16 model, FP8 weights);
    NaN before the weights are in, so a forward on an unloaded layer cannot pass for a real one."""
    rotary = MLARotary(DIMS.qk_rope_head_dim, 10000.0, None, 256, interleave=True)
    fmt = BlockFP8(8, 8)
    attn = MLAttention(0, DIMS, ParallelGroups.single_rank().attn_tp, rotary, 0.1, dtype=torch.bfloat16, fp8=fmt)
    assert attn.w_uk.isnan().all() and attn.w_uv.isnan().all()
    init_random_(attn, 5)
    proj = attn.kv_b_proj
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv is not None
    w = dequantize_weight(proj.weight, proj.weight_scale_inv, fmt, torch.bfloat16).view(8, 16 + 24, 32)
    assert attn.w_uk.dtype == attn.w_uv.dtype == torch.bfloat16
    assert torch.equal(attn.w_uk, w[:, :16]) and torch.equal(attn.w_uv, w[:, 16:])


def test_the_latent_cache_stores_k_alone() -> None:
    from fusedserve.worker.executor.kv_cache import kv_bytes_per_block

    shape = KVShape(1, 40, 32, v_in_k=True)
    cache = KVCache.allocate({0: shape, 1: (2, 8)}, 3, BLOCK, torch.float32)
    assert cache.v_in_k == {0}
    assert cache.v[0].data_ptr() == cache.k[0].data_ptr() and cache.v[0].shape == (3 * BLOCK, 1, 32)
    assert len(cache.stored()) == 3  # K of layer 0, K and V of layer 1
    assert cache.bytes_per_token() == (40 + 2 * 8 * 2) * 4
    assert kv_bytes_per_block({0: shape, 1: (2, 8)}, BLOCK, torch.float32) == cache.bytes_per_token() * BLOCK
    cache.k[0][5] = torch.arange(40.0)
    assert torch.equal(cache.v[0][5, 0], torch.arange(32.0))
    with pytest.raises(ValueError, match="first columns"):
        KVCache.allocate({0: KVShape(1, 8, 16, v_in_k=True)}, 1, BLOCK, torch.float32)


def test_deepseek_v3_latent_cache_bytes_per_token() -> None:
    """DeepSeek-V3's MLA (128 heads, kv_lora 512, nope/rope/v 128/64/128) on one rank and on 8: one
    [latent 512 | rope 64] row per token and layer, 1152 bytes in bf16, against the expanded cache's
    heads x (192 + 128) values (80 KiB at 128 heads)."""
    from fusedserve.worker.executor.kv_cache import kv_bytes_per_block

    dims = MLADims(hidden=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    rotary = MLARotary(64, 10000.0, None, 4096, interleave=True)
    for tp in (1, 8):
        group = Group("attn_tp", 0, tuple(range(tp)))
        attn = MLAttention(0, dims, group, rotary, 0.1, dtype=torch.bfloat16, device="meta")
        assert attn.kv_shape() == KVShape(1, 576, 512, v_in_k=True)
        assert kv_bytes_per_block({0: attn.kv_shape()}, 1, torch.bfloat16) == 1152
        expanded_bytes = kv_bytes_per_block({0: (attn.heads, 192, 128)}, 1, torch.bfloat16)
        assert expanded_bytes == 128 // tp * 320 * 2  # 81920 on one rank: 71x the latent row


def test_mla_runs_the_triton_set_on_a_gpu_and_refuses_flashinfer() -> None:
    from transformers import DeepseekV3Config

    from fusedserve.tiny import DEEPSEEK_V3_DEFAULTS
    from fusedserve.worker.executor.kernel_set import KernelChoiceError, kernel_choice

    config = DeepseekV3Config(**{**DEEPSEEK_V3_DEFAULTS, "architectures": ["DeepseekV3ForCausalLM"]})
    libraries = frozenset({"triton", "flashinfer"})
    assert kernel_choice("cuda", None, config, torch.bfloat16, libraries).kernels == "triton"
    with pytest.raises(KernelChoiceError, match="no MLA attention"):
        kernel_choice("cuda", None, config, torch.bfloat16, libraries, "flashinfer")


def _generate(model: Path, graphs: bool) -> tuple[list[list[int]], int]:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    engine = Engine(model, EngineConfig(num_blocks=24, block_size=4, max_num_seqs=3, max_batch_tokens=16,
                                        skip_tokenizer=True, cuda_graphs=graphs, cuda_graph_batch_sizes=(1, 2, 4)))
    prompts = [[5, 17, 99, 3, 201, 44, 8, 61, 130, 7, 12, 250 - 9, 77, 31, 2, 90, 66, 23], [11, 4, 180], [42] * 7]
    out = [c.token_ids for c in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9,
                                                                         ignore_eos=True))]
    runs = engine.executor.graphs.runs if engine.executor.graphs is not None else 0
    return out, runs


def test_deepseek_v3_static_shape_steps_equal_eager(tmp_path: Path) -> None:
    """The tiny DeepSeek-V3 engine with ``cuda_graphs=True`` (the padded static-shape forwards of
    ``step_graphs.py``, eager on CPU, torch kernel set: padding rows write the pad slot of the latent
    cache) gives the eager engine's greedy tokens (chunked prefill, batched decode)."""
    from fusedserve.tiny import make_tiny_deepseek_v3

    model = make_tiny_deepseek_v3(tmp_path / "ds", seed=3)
    eager, _ = _generate(model, graphs=False)
    padded, runs = _generate(model, graphs=True)
    assert runs > 0 and padded == eager and all(len(t) == 9 for t in eager)
