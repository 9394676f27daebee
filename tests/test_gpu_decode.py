"""GPU (-m gpu): Triton kernels equal their references; CUDA-graph decode equals the eager forward;
captured collectives keep executed == planned (2 GPUs, NCCL + FlashInfer's fused all-reduce).

Run outside the checkout (the source folder fusedserve/ would shadow the package), e.g.
``cd /tmp && python -m pytest <repo>/tests/test_gpu_decode.py -m gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs")
BLOCK = 16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_gpu
def test_triton_kernels_equal_references() -> None:
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.linear_triton import linear_triton
    from fusedserve.models.layers.mlp import silu_and_mul
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch
    from fusedserve.models.layers.rms_norm_triton import add_rms_norm_triton, rms_norm_triton
    from fusedserve.models.layers.rope_triton import rope_triton
    from fusedserve.models.layers.rotary import rope_inv_freq, rope_reference
    from fusedserve.models.layers.silu_mul_triton import silu_and_mul_triton
    from fusedserve.models.parallel.fusion.reference import add_rms_norm, rms_norm

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    for n in (1, 5, 64):
        x, r = (torch.randn(n, 4096, device=dev, dtype=bf, generator=g) for _ in range(2))
        w = torch.rand(4096, device=dev, dtype=bf, generator=g) + 0.5
        assert _rel(rms_norm_triton(x, w, 1e-5), rms_norm(x, w, 1e-5)) < 1e-2
        (n1, s1), (n2, s2) = add_rms_norm_triton(x, r, w, 1e-5), add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s1, s2) and _rel(n1, n2) < 1e-2
        qkv = torch.randn(n, 48 * 128, device=dev, dtype=bf, generator=g)
        q, k = qkv[:, : 32 * 128].view(n, 32, 128), qkv[:, 32 * 128: 40 * 128].view(n, 8, 128)
        pos = torch.randint(0, 8000, (n,), device=dev)
        inv = rope_inv_freq(128, 500000.0, None).to(dev)
        (q1, k1), (q2, k2) = rope_triton(pos, q, k, inv), rope_reference(pos, q, k, inv)
        assert _rel(q1, q2) < 1e-2 and _rel(k1, k2) < 1e-2
        gu = torch.randn(n, 2 * 14336, device=dev, dtype=bf, generator=g)
        assert _rel(silu_and_mul_triton(gu), silu_and_mul(gu)) < 1e-2
        for out_f, in_f in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
            w = torch.randn(out_f, in_f, device=dev, dtype=bf, generator=g) * 0.02
            xin = torch.randn(n, in_f, device=dev, dtype=bf, generator=g)
            assert _rel(linear_triton(xin, w), torch.nn.functional.linear(xin, w)) < 1e-2, (n, out_f, in_f)

    # decode attention: GQA 32/8, head_dim 128, contexts across several kernel tiles, scattered blocks
    ctx = [1, 17, 64, 65, 300, 1000]
    nb = sum(-(-c // BLOCK) for c in ctx) + 4
    kv = KVCache.allocate({0: (8, 128)}, nb, BLOCK, bf, dev)
    kv.k[0].normal_(generator=g)
    kv.v[0].normal_(generator=g)
    perm = torch.randperm(nb, device=dev, generator=g).tolist()
    tables = []
    for c in ctx:
        tables.append(perm[: -(-c // BLOCK)])
        perm = perm[len(tables[-1]):]
    slots = torch.tensor([t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for t, c in zip(tables, ctx)], device=dev)
    b = len(ctx)
    q = torch.randn(b, 32, 128, device=dev, dtype=bf, generator=g)
    kvn = torch.randn(b, 2 * 8 * 128, device=dev, dtype=bf, generator=g)
    k, v = kvn[:, :1024].view(b, 8, 128), kvn[:, 1024:].view(b, 8, 128)

    def batch(cache: Any) -> ForwardBatch:
        return ForwardBatch(torch.zeros(b, dtype=torch.long, device=dev), torch.tensor(ctx, device=dev) - 1,
                            [1] * b, ctx, slots, tables, cache)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, nb)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv), 128**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), 128**-0.5)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])


@needs_gpu
def test_mla_decode_attention_and_fused_experts_equal_references() -> None:
    """DeepSeek-V3 shapes: decode attention over the expanded MLA cache (K 192 padded to 256, V 128,
    one KV head per query head) and the routed experts' two block launches (7168 x 2048 experts)."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.fused_moe import fused_experts_torch
    from fusedserve.models.layers.fused_moe_triton import fused_experts_triton
    from fusedserve.models.layers.paged_attention_torch import paged_attention_torch

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    heads, ctx = 64, [1, 129, 300]
    nb = sum(-(-c // BLOCK) for c in ctx) + 2
    kv = KVCache.allocate({0: (heads, 192, 128)}, nb, BLOCK, bf, dev)
    kv.k[0].normal_(generator=g)
    kv.v[0].normal_(generator=g)
    tables, start = [], 0
    for c in ctx:
        tables.append(list(range(start, start + -(-c // BLOCK))))
        start += len(tables[-1])
    slots = torch.tensor([t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for t, c in zip(tables, ctx)], device=dev)
    b = len(ctx)
    q, k = (torch.randn(b, heads, 192, device=dev, dtype=bf, generator=g) for _ in range(2))
    v = torch.randn(b, heads, 128, device=dev, dtype=bf, generator=g)

    def batch(cache: Any) -> ForwardBatch:
        return ForwardBatch(torch.zeros(b, dtype=torch.long, device=dev), torch.tensor(ctx, device=dev) - 1,
                            [1] * b, ctx, slots, tables, cache)

    ref_kv = KVCache({0: kv.k[0].clone()}, {0: kv.v[0].clone()}, BLOCK, nb)
    got = paged_decode_attention_triton(q, k, v, 0, batch(kv), 192**-0.5)
    want = paged_attention_torch(q, k, v, 0, batch(ref_kv), 192**-0.5)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    assert torch.equal(kv.k[0], ref_kv.k[0]) and torch.equal(kv.v[0], ref_kv.v[0])

    experts, hidden, inter = 16, 7168, 2048
    gate_up = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf, generator=g) * 0.02
    down = torch.randn(experts, hidden, inter, device=dev, dtype=bf, generator=g) * 0.02
    for n in (1, 7, 64):
        x = torch.randn(n, hidden, device=dev, dtype=bf, generator=g)
        ids = torch.randint(-1, experts, (n, 8), device=dev, generator=g)
        w = torch.rand(n, 8, device=dev, generator=g)
        out = fused_experts_triton(x, ids, w, gate_up, down)
        ref = fused_experts_torch(x.float(), ids, w, gate_up.float(), down.float())
        assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2, (n, _rel(out, ref))


def _small_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=128, rope_theta=500000.0,
                       architectures=["LlamaForCausalLM"])


def _decode_inputs(tables: torch.Tensor, lens: torch.Tensor, n: int, step: int) -> tuple[torch.Tensor, ...]:
    dev = tables.device
    pos = lens[:n] + step
    ids = (torch.arange(n, device=dev) * 37 + step * 11) % 1000
    slots = tables[:n].long().gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK
    return ids, pos, slots, tables[:n], (pos + 1).to(torch.int32)


def _eager(model: Any, kv: Any, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
           ctx: torch.Tensor) -> torch.Tensor:
    from fusedserve.models.forward_batch import ForwardBatch

    n = ids.shape[0]
    tl = tables.tolist()
    return model(ForwardBatch(ids, pos, [1] * n, ctx.tolist(), slots, tl, kv)).logits


def _prefill(model: Any, kv: Any, tables: torch.Tensor, lens: list[int]) -> None:
    from fusedserve.models.forward_batch import ForwardBatch

    dev = tables.device
    ids = torch.cat([(torch.arange(n, device=dev) * 7 + i) % 1000 for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    slots = torch.cat([tables[i].long()[torch.arange(n, device=dev) // BLOCK] * BLOCK
                       + torch.arange(n, device=dev) % BLOCK for i, n in enumerate(lens)])
    model(ForwardBatch(ids, pos, lens, lens, slots, tables.tolist(), kv))


@needs_gpu
def test_graph_replay_equals_eager_and_reference() -> None:
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups
    from fusedserve.models.random_init import random_model
    from fusedserve.worker.executor.cuda_graph_runner import CudaGraphRunner

    dev = torch.device("cuda")
    models = {name: random_model(_small_config(), ParallelGroups.single_rank(), Collectives("nccl"),
                                 dtype=torch.bfloat16, device=dev, seed=3, kernels=Kernels.named(name))
              for name in ("triton", "reference")}
    lens = [5, 40, 17, 100, 1, 64, 33, 9]
    tables = torch.arange(8 * 8, dtype=torch.int32, device=dev).view(8, 8)  # 8 blocks (128 tokens) each
    caches = {}
    for name, model in models.items():
        caches[name] = KVCache.allocate(model.kv_shapes(), 8 * 8 + 1, BLOCK, torch.bfloat16, dev)
        _prefill(model, caches[name], tables, lens)
    lens_t = torch.tensor(lens, device=dev)
    runner = CudaGraphRunner(models["triton"], caches["triton"], max_blocks_per_seq=8, batch_sizes=(1, 2, 4, 8))
    assert runner.use_graphs and set(runner.captured) == {1, 2, 4, 8}
    ledger = runner.ledger
    forwards = ledger.forwards
    for step, n in enumerate((3, 8, 1, 5)):
        inputs = _decode_inputs(tables, lens_t, n, step)
        eager = _eager(models["triton"], caches["triton"], *inputs)
        ref = _eager(models["reference"], caches["reference"], *inputs)
        graph = runner.run(*inputs).clone()
        assert graph.shape == (n, 1000) and torch.isfinite(graph).all()
        assert _rel(graph, eager) < 1e-2, (step, _rel(graph, eager))
        assert _rel(graph, ref) < 3e-2, (step, _rel(graph, ref))
        assert [r.key for r in ledger.forward_records()] == runner.planned(n) == []
    assert ledger.forwards == forwards + 2 * 4  # each step: an eager forward and a replay


def _tp2_rank(rank: int, world: int, backend: str) -> dict[str, Any]:
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.selection import FusionMode, fused_kernel
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.models.random_init import random_model
    from fusedserve.worker.executor.cuda_graph_runner import CudaGraphRunner

    dev = torch.device("cuda", rank)
    config = _small_config()
    groups = build_groups(ParallelConfig(tp=world), rank, backend)
    fused = make_fused_allreduce_norm("flashinfer", groups, config.hidden_size, torch.bfloat16)
    collectives = Collectives(backend, fused=fused)
    model = random_model(config, groups, collectives, dtype=torch.bfloat16, device=dev, seed=5,
                         kernels=Kernels.triton())
    lens = [5, 40, 17]
    tables = torch.arange(3 * 8, dtype=torch.int32, device=dev).view(3, 8)
    kv = KVCache.allocate(model.kv_shapes(), 3 * 8 + 1, BLOCK, torch.bfloat16, dev)
    _prefill(model, kv, tables, lens)
    runner = CudaGraphRunner(model, kv, max_blocks_per_seq=8, batch_sizes=(1, 2, 4))
    lens_t = torch.tensor(lens, device=dev)
    out: dict[str, Any] = {"path": fused.path, "errors": [], "planned": [], "executed": [], "eager_planned": []}
    calls_before = dict(collectives.ledger.calls)
    replays = 0
    for step, n in enumerate((3, 1, 2, 3)):
        inputs = _decode_inputs(tables, lens_t, n, step)
        eager = _eager(model, kv, *inputs)
        out["eager_planned"].append(model.comm.active.expected() == [r.key for r in collectives.ledger.forward_records()])
        graph = runner.run(*inputs).clone()
        replays += 1
        out["errors"].append(_rel(graph, eager))
        out["planned"].append(runner.planned(n))
        out["executed"].append([r.key for r in collectives.ledger.forward_records()])
    torch.cuda.synchronize()
    calls = collectives.ledger.calls
    # per op: eager forwards + replays, each exactly the planned count (capture not counted)
    out["calls_delta"] = {}
    for (op, group, _path), count in calls.items():
        key = f"{op}|{group}"
        out["calls_delta"][key] = out["calls_delta"].get(key, 0) + count - calls_before.get((op, group, _path), 0)
    out["per_forward"] = {}
    for _site, op, group in runner.planned(1):
        out["per_forward"][f"{op}|{group}"] = out["per_forward"].get(f"{op}|{group}", 0) + 1
    out["forwards"] = 4 + replays
    return out


@needs_two_gpus
def test_tp2_graph_capture_runs_the_planned_collectives() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    for rank, res in enumerate(run_on_ranks(_tp2_rank, 2, backend="nccl", timeout_s=600)):
        assert max(res["errors"]) < 1e-2, (rank, res["errors"])
        assert all(res["eager_planned"])
        for planned, executed in zip(res["planned"], res["executed"]):
            assert planned and executed == planned, (rank, executed, planned)
        assert res["path"] == "flashinfer_fused", res["path"]
        assert any(key.startswith("fused_ar_add_rmsnorm|") for key in res["per_forward"])
        ran = {key: delta for key, delta in res["calls_delta"].items() if delta}
        assert set(ran) == set(res["per_forward"]), (ran, res["per_forward"])
        for key, delta in ran.items():
            assert delta == res["forwards"] * res["per_forward"][key], (rank, key, delta, res["per_forward"])
