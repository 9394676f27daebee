"""GPU (-m gpu): FlashInfer paged attention equals the plain reference, and the engine's fast set
(FlashInfer attention planned per forward, Triton norms, CUDA graphs) equals the reference set.

Attention: decode over contexts across pages and scattered blocks, a prefill chunk after a cached
prefix, a mixed batch, a causal chain verify, a tree verify with its mask, and an empty step.
Engine level: a small GQA model (head_dim 128, bf16, random weights) through ``build_rank``: the
graphed fast executor against the eager reference one on decode, chain-verify and tree-verify steps.

    cd /tmp && python -m pytest <repo>/tests/test_gpu_attention.py -m gpu
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
try:
    import flashinfer  # noqa: F401

    HAVE_FLASHINFER = True
except ImportError:
    HAVE_FLASHINFER = False
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER, reason="needs FlashInfer (bench/device_env.sh stages it)")
BLOCK = 16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _case(rows: list[int], ctx: list[int], masks: list[Any], heads: int = 32, kv_heads: int = 8, dim: int = 128
          ) -> dict[str, Any]:
    """q/k/v for sequences with ``rows`` new rows ending their ``ctx``, pages scattered over the cache."""
    from fusedserve.models.forward_batch import KVCache

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(sum(ctx) + len(rows))
    nb = sum(-(-c // BLOCK) for c in ctx) + 3
    kv = KVCache.allocate({0: (kv_heads, dim)}, nb, BLOCK, bf, dev)
    kv.k[0].normal_(generator=g)
    kv.v[0].normal_(generator=g)
    perm = torch.randperm(nb, device=dev, generator=g).tolist()
    tables = []
    for c in ctx:
        tables.append(tuple(perm[: -(-c // BLOCK)]))
        perm = perm[len(tables[-1]):]
    t = sum(rows)
    return {"kv": kv, "tables": tables, "rows": rows, "ctx": ctx, "masks": masks,
            "q": torch.randn(t, heads, dim, device=dev, dtype=bf, generator=g),
            "k": torch.randn(t, kv_heads, dim, device=dev, dtype=bf, generator=g),
            "v": torch.randn(t, kv_heads, dim, device=dev, dtype=bf, generator=g)}


def _batch(case: dict[str, Any], kv: Any, attention: Any = None) -> Any:
    from fusedserve.models.forward_batch import ForwardBatch

    dev = "cuda"
    slots, full = [], []
    for table, r, c, m in zip(case["tables"], case["rows"], case["ctx"], case["masks"]):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - r, c)]
        if m is None:
            full.append(None)
        else:
            tail = len(m) // r
            f = torch.ones(r, c, dtype=torch.bool)
            f[:, c - tail:] = torch.tensor(m).view(r, tail)
            full.append(f.to(dev))
    positions = [p for r, c in zip(case["rows"], case["ctx"]) for p in range(c - r, c)]
    return ForwardBatch(torch.zeros(sum(case["rows"]), dtype=torch.long, device=dev),
                        torch.tensor(positions, device=dev), list(case["rows"]), list(case["ctx"]),
                        torch.tensor(slots, dtype=torch.long, device=dev), [list(t) for t in case["tables"]], kv,
                        attn_masks=full if any(m is not None for m in full) else None, attention=attention)


def _tree(parents: tuple[int, ...]) -> tuple[bool, ...]:
    from fusedserve.worker.executor.step import ancestor_mask

    return ancestor_mask(parents)


CASES = {
    "decode": ([1] * 6, [1, 17, 64, 65, 300, 1000], [None] * 6),
    "prefill-after-prefix": ([100, 7], [400, 7], [None, None]),
    "mixed": ([1, 33, 1], [50, 33, 129], [None] * 3),
    "chain-verify": ([4, 4, 4], [20, 77, 300], [None] * 3),
    "tree-verify": ([5, 5], [40, 200], [_tree((-1, 0, 0, 1, 2)), _tree((-1, 0, 1, 1, 0))]),
}


@needs_gpu
@needs_flashinfer
@pytest.mark.parametrize("name", sorted(CASES))
def test_flashinfer_attention_equals_the_reference(name: str) -> None:
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.attention_flashinfer import flashinfer_attention, flashinfer_planner
    from fusedserve.models.layers.attention_layout import AttentionLayout

    rows, ctx, masks = CASES[name]
    case = _case(rows, ctx, masks)
    kv, scale = case["kv"], 128 ** -0.5
    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, kv.num_blocks)
    planner = flashinfer_planner(32, 8, 128, scale, kv)
    layout = AttentionLayout(tuple(rows), tuple(ctx), tuple(case["tables"]),
                             tuple(masks) if any(m is not None for m in masks) else None)
    got = flashinfer_attention(case["q"], case["k"], case["v"], 0, _batch(case, kv, planner.plan(layout)), scale)
    want = paged_attention_reference(case["q"], case["k"], case["v"], 0, _batch(case, ref_kv), scale)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2, (name, _rel(got, want))
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


@needs_gpu
@needs_flashinfer
@pytest.mark.parametrize("name", ["chain-verify", "tree-verify"])
def test_a_captured_speculative_shape_runs_on_device_metadata_alone(name: str) -> None:
    """A captured chain or tree shape is planned on the device (nothing on the host before a replay): the
    Triton kernels read the batch's metadata, a tree's mask as its ``tail_mask``, and equal FlashInfer's
    eager plan of the same layout (a custom mask for the tree) and the reference."""
    import dataclasses

    from fusedserve.models.forward_batch import KVCache, PagedAttentionMetadata
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.attention_flashinfer import (
        DevicePlan,
        flashinfer_attention,
        flashinfer_planner,
    )
    from fusedserve.models.layers.attention_layout import AttentionLayout

    rows, ctx, masks = CASES[name]
    case = _case(rows, ctx, masks)
    kv, scale = case["kv"], 128 ** -0.5
    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, kv.num_blocks)
    eager_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, kv.num_blocks)
    planner = flashinfer_planner(32, 8, 128, scale, kv)
    layout = AttentionLayout(tuple(rows), tuple(ctx), tuple(case["tables"]),
                             tuple(masks) if any(m is not None for m in masks) else None)
    eager = flashinfer_attention(case["q"], case["k"], case["v"], 0, _batch(case, eager_kv, planner.plan(layout)),
                                 scale)
    tail = len(masks[0]) // rows[0] if masks[0] is not None else 0
    state = planner.graph_plan()
    assert isinstance(state, DevicePlan)
    meta = PagedAttentionMetadata.from_lists(rows, ctx, [list(t) for t in case["tables"]], "cuda")
    if tail:
        meta = dataclasses.replace(meta, tail_mask=torch.tensor([m for mask in masks for m in mask],
                                                                device="cuda").view(sum(rows), tail))
    device = _batch(case, kv, state)
    device.attn_masks, device.paged = None, meta
    got = flashinfer_attention(case["q"], case["k"], case["v"], 0, device, scale)
    want = paged_attention_reference(case["q"], case["k"], case["v"], 0, _batch(case, ref_kv), scale)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2 and _rel(got, eager) < 1e-2, (
        name, _rel(got, want), _rel(got, eager))
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


@needs_gpu
@needs_flashinfer
@pytest.mark.parametrize("batch", [20, 64])
def test_every_decode_batch_runs_the_device_only_triton_kernel(batch: int) -> None:
    """A decode batch of any size, eager or captured, gets the Triton kernel's empty plan (nothing planned
    on the host, so a decode shape can be chained) and equals the reference at contexts up to 1000."""
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.attention import paged_attention_reference
    from fusedserve.models.layers.attention_flashinfer import (
        DevicePlan,
        flashinfer_attention,
        flashinfer_planner,
    )
    from fusedserve.models.layers.attention_layout import AttentionLayout

    rows, ctx = [1] * batch, [1 + (999 * i) // (batch - 1) for i in range(batch)]
    case = _case(rows, ctx, [None] * batch)
    kv, scale = case["kv"], 128 ** -0.5
    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, kv.num_blocks)
    planner = flashinfer_planner(32, 8, 128, scale, kv)
    layout = AttentionLayout(tuple(rows), tuple(ctx), tuple(case["tables"]))
    assert isinstance(planner.graph_plan(), DevicePlan)
    plan = planner.plan(layout)
    assert isinstance(plan, DevicePlan)
    got = flashinfer_attention(case["q"], case["k"], case["v"], 0, _batch(case, kv, plan), scale)
    want = paged_attention_reference(case["q"], case["k"], case["v"], 0, _batch(case, ref_kv), scale)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2, _rel(got, want)
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


def _small_model(root: Path) -> Path:
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 1024,
        "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "rope_theta": 500000.0, "max_position_embeddings": 1024}))
    return root


@needs_gpu
@needs_flashinfer
def test_graphed_fast_executor_equals_the_eager_reference(tmp_path: Path) -> None:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.executor.step import SeqRows, Step
    from fusedserve.worker.executor.step_shape import StepShape
    from fusedserve.worker.parallel.rank import build_rank

    path = _small_model(tmp_path)
    base = {"num_blocks": 40, "max_num_seqs": 4, "dtype": "bfloat16", "device": "cuda", "load_format": "dummy",
            "seed": 3, "skip_tokenizer": True}
    fast = build_rank(path, EngineConfig(**base)).executor
    ref = build_rank(path, EngineConfig(**base, kernels="reference", cuda_graphs=False)).executor
    assert fast.kernels is not None and fast.kernels.name == "flashinfer" and fast.graph_ready
    tree = _tree((-1, 0, 0, 1, 2))
    fast.capture([StepShape(b, 1) for b in (1, 2, 4)] + [StepShape(b, 4) for b in (1, 2, 4)]
                 + [StepShape(b, 5, tail=5) for b in (1, 2, 4)], max_blocks=8)
    tables = [(0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15), (16, 17, 18, 19, 20, 21, 22, 23)]
    prompts = [list(range(3, 3 + n)) for n in (70, 9, 33)]
    prefill = Step(tuple(SeqRows(t, tuple(p), tuple(range(len(p))), len(p), 1) for t, p in zip(tables, prompts)))
    for ex in (fast, ref):
        ex.run(prefill)
    steps = [
        Step(tuple(SeqRows(t, (7,), (len(p),), len(p) + 1) for t, p in zip(tables, prompts))),  # decode
        Step(tuple(SeqRows(t, (8, 9, 10, 11), tuple(range(len(p) + 1, len(p) + 5)), len(p) + 5, 4)
                   for t, p in zip(tables[:2], prompts[:2]))),  # chain verify, 2 of 3 sequences
        Step(tuple(SeqRows(t, (12, 13, 14, 15, 16), (len(p) + 5, len(p) + 6, len(p) + 6, len(p) + 7, len(p) + 7),
                           len(p) + 10, 5, tree) for t, p in zip(tables, prompts))),  # tree verify
    ]
    for step in steps:
        assert fast.graph_shape(step) is not None
        got, want = fast.run(step).logits, ref.run(step).logits
        assert got.shape == want.shape and torch.isfinite(got).all() and _rel(got, want) < 3e-2, _rel(got, want)
    assert fast.graphs is not None and fast.graphs.use_graphs and fast.graphs.runs == len(steps)


@needs_gpu
def test_triton_kv_store_equals_the_reference() -> None:
    from fusedserve.models.layers.kv_write_triton import write_kv_triton
    from fusedserve.models.layers.paged_attention_torch import write_kv

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    for kv_heads, k_dim, v_dim in ((8, 128, 128), (4, 192, 128), (2, 24, 20)):
        caches = [torch.randn(300, kv_heads, d, device=dev, dtype=bf, generator=g) for d in (k_dim, v_dim)]
        ref = [c.clone() for c in caches]
        k = torch.randn(37, kv_heads, k_dim, device=dev, dtype=bf, generator=g)
        v = torch.randn(37, kv_heads, v_dim, device=dev, dtype=bf, generator=g)
        slots = torch.randperm(300, device=dev, generator=g)[:37]
        write_kv_triton(caches[0], caches[1], slots, k, v)
        write_kv(ref[0], ref[1], slots, k, v)
        assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
