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
    import fusedserve.models.layers.linear_triton as lt
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.decode_attention_triton import paged_decode_attention_triton
    from fusedserve.models.layers.linear_triton import decode_gate_up_silu, decode_linear, decode_qkv_rope
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
            # the fast set's matmul: the GEMV at one row, the tensor-core decode GEMM at 5 and 64 (PDL where on)
            assert _rel(decode_linear(xin, w), torch.nn.functional.linear(xin, w)) < 1e-2, (n, out_f, in_f)
        # the matmuls with the op after them in the epilogue (2..64 rows; the GEMV and the op's kernel at 1)
        xin = torch.randn(n, 4096, device=dev, dtype=bf, generator=g)
        w = torch.randn(2 * 14336, 4096, device=dev, dtype=bf, generator=g) * 0.02
        want = silu_and_mul(torch.nn.functional.linear(xin.float(), w.float()))
        assert _rel(decode_gate_up_silu(xin, w), want) < 1e-2, n
        w = torch.randn(48 * 128, 4096, device=dev, dtype=bf, generator=g) * 0.02
        bias = torch.randn(48 * 128, device=dev, dtype=bf, generator=g)
        y = torch.nn.functional.linear(xin.float(), w.float(), bias.float())
        q_want, k_want = rope_reference(pos, y[:, :4096].view(n, 32, 128), y[:, 4096:5120].view(n, 8, 128), inv)
        q_got, k_got, v_got = decode_qkv_rope(xin, w, bias, pos, inv, 4096, 1024)
        assert _rel(q_got, q_want.view(n, 4096)) < 1e-2 and _rel(k_got, k_want.view(n, 1024)) < 1e-2, n
        assert _rel(v_got, y[:, 5120:]) < 1e-2, n
        if n == 1:  # one row: the GEMV with RoPE / SiLU-and-mul in its epilogue (linear_triton.GEMV_EPILOGUES,
            # the default) above; here the other way, the GEMV and then the op's own kernel
            before = lt.GEMV_EPILOGUES
            lt.GEMV_EPILOGUES = not before
            try:
                q_got, k_got, v_got = decode_qkv_rope(xin, w, bias, pos, inv, 4096, 1024)
                gu_w = torch.randn(2 * 14336, 4096, device=dev, dtype=bf, generator=g) * 0.02
                gu_got = decode_gate_up_silu(xin, gu_w)
            finally:
                lt.GEMV_EPILOGUES = before
            assert _rel(q_got, q_want.view(n, 4096)) < 1e-2 and _rel(k_got, k_want.view(n, 1024)) < 1e-2
            assert _rel(v_got, y[:, 5120:]) < 1e-2
            assert _rel(gu_got, silu_and_mul(torch.nn.functional.linear(xin.float(), gu_w.float()))) < 1e-2
    # greedy sampling's argmax on the 8B vocabulary, bf16 logits as the LM head leaves them
    from fusedserve.models.layers.argmax_triton import argmax_triton

    for n in (1, 16, 64):
        logits = torch.randn(n, 128256, device=dev, dtype=bf, generator=g) * 4
        assert torch.equal(argmax_triton(logits), logits.float().argmax(dim=-1)), n
    # SmolLM2-135M's widths (576, 1536): the GEMV's masked tail at one row, the GEMM's 64-wide K steps at more;
    # at 2..16 rows the weight slice is asked of L2 before the wait (L2_PREFETCH_K_MAX): the same sums without it
    for out_f, in_f in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(out_f, in_f, device=dev, dtype=bf, generator=g) * 0.02
        for n in (1, 6, 64):
            xin = torch.randn(n, in_f, device=dev, dtype=bf, generator=g)
            got = decode_linear(xin, w)
            assert _rel(got, torch.nn.functional.linear(xin, w)) < 1e-2, (n, out_f, in_f)
            before, lt.L2_PREFETCH_K_MAX = lt.L2_PREFETCH_K_MAX, 0
            try:
                assert torch.equal(decode_linear(xin, w), got), (n, out_f, in_f)
            finally:
                lt.L2_PREFETCH_K_MAX = before
            # the one tile as slices in batched dots (ONE_TILE_SLICES, for K 576 too): the same product
            before_slices = lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN
            lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN = (64, 8), 512
            try:
                assert _rel(decode_linear(xin, w), torch.nn.functional.linear(xin, w)) < 1e-2, (n, out_f, in_f)
            finally:
                lt.ONE_TILE_SLICES, lt.ONE_TILE_K_MIN = before_slices

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
def test_a_new_token_count_compiles_no_new_kernel() -> None:
    """Row and token counts that change from call to call (a prompt's length, a verify's tokens, a batch's
    sequences) are not specialised on: Triton compiles a new variant for an integer argument equal to 1 or
    divisible by 16, which would compile mid-run the first time such a count came. The decode GEMM at 17 /
    24 rows (one tile, BLOCK_M 32) and then at 32 rows: no new compiled variant, the same result as cuBLAS."""
    import torch.nn.functional as F

    from fusedserve.models.layers.linear_triton import _decode_gemm_kernel, gemm_triton

    def variants() -> int:
        return sum(len(cache[0]) for cache in _decode_gemm_kernel.device_caches.values())

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    for m in (17, 24):
        gemm_triton(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16), w)
    before = variants()
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    got = gemm_triton(x, w)
    assert variants() == before
    assert _rel(got, F.linear(x, w)) < 1e-2


@needs_gpu
def test_kv_move_in_one_launch_equals_kv_cache_move_past_32_bit_offsets() -> None:
    """``move_kv_triton`` (the executor's ``move_kv`` on a GPU) leaves SmolLM2's cache shape (30 layers of K and V,
    3 heads of 64, bf16) as ``KVCache.move`` does, on a group of more than 2**31 elements (where torch's
    ``index_copy_`` splits into a kernel per layer) with slots near its end, one move's source another's
    destination."""
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.worker.executor.kv_move_triton import move_kv_triton

    slots = (1 << 31) // (60 * 192) + 4096  # past 2**31 elements in the one group
    cache = KVCache.allocate({i: (3, 64) for i in range(30)}, slots // 16, 16, torch.bfloat16, "cuda")
    (group,) = cache.grouped()
    assert group.numel() > 1 << 31
    end = group.shape[1]
    src = torch.tensor([end - 1, end - 9, 700, end - 30, end - 20], device="cuda")
    dst = torch.tensor([end - 20, end - 30, 701, 5, end - 1], device="cuda")
    rows = torch.cat([src, dst])
    group[:, rows] = torch.randn(group[:, rows].shape, device="cuda").to(torch.bfloat16)
    want = group[:, rows].clone()
    want[:, 5:] = group[:, src]  # every source as it was before any move
    move_kv_triton(cache, src, dst)
    assert torch.equal(group[:, dst], want[:, 5:])
    assert torch.equal(group[:, src[1:3]], want[:, 1:3])  # sources no move writes keep their rows


@needs_gpu
def test_mla_decode_attention_and_fused_experts_equal_references() -> None:
    """DeepSeek-V3 shapes: decode attention over MLA's former expanded cache (K 192 padded to 256, V 128,
    one KV head per query head: still a shape the kernel takes; the latent cache MLA keeps now is
    tests/test_gpu_mla_attention.py's) and the routed experts' two block launches (7168 x 2048 experts)."""
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



@needs_gpu
def test_router_choice_and_moe_align_in_one_launch_equal_references() -> None:
    """DeepSeek-V3's router (256 experts, 8 groups, top-4 groups, top-8, correction bias) and the grouping of
    the routed pairs into expert blocks, each one launch, equal ``select_experts`` and ``moe_align`` on the
    device (``moe_blocks.same_blocks``), at decode batches and at the largest grouping the one-launch
    kernel takes."""
    from moe_blocks import same_blocks

    from fusedserve.models.layers.fused_moe import moe_align
    from fusedserve.models.layers.moe_align_triton import MAX_PAIRS, moe_align_triton
    from fusedserve.models.layers.router import RouterConfig, select_experts
    from fusedserve.models.layers.router_triton import select_experts_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    for shared in (0, 1):  # 1: the shared expert folded in (moe.py), id 256 in a ninth slot
        cfg = RouterConfig(256, 8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                           shared_experts=shared)
        for n in (1, 16, 64, MAX_PAIRS // 9):
            logits = torch.randn(n, 256, device="cuda", generator=g) * 2
            want_w, want_ids = select_experts(logits, cfg, bias)
            got_w, got_ids = select_experts_triton(logits, cfg, bias)
            want_ids, want_at = want_ids.sort(-1)
            got_ids, got_at = got_ids.sort(-1)
            assert torch.equal(got_ids, want_ids) and got_ids.shape[1] == 8 + shared, n
            torch.testing.assert_close(got_w.gather(1, got_at), want_w.gather(1, want_at))
            for experts, offset in ((256 + shared, 0), (32, 96)):  # all experts here; one ep rank's 32 of them
                local = torch.where((got_ids >= offset) & (got_ids < offset + experts), got_ids - offset, -1)
                assert same_blocks(moe_align_triton(local, experts, 16), moe_align(local, experts, 16)), (n, experts)


@needs_gpu
def test_router_logits_kernel_equals_the_fp32_product_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's gate (256 x 7168, fp32) over bf16 rows: the one-launch logits equal HF's fp32 product but
    for the order of the sums, at every row count it takes, captured in a CUDA graph too."""
    from fusedserve.models.layers import router_triton
    from fusedserve.models.layers.router import router_logits
    from fusedserve.models.layers.router_triton import router_logits_triton

    LOGITS_ROWS = 16
    monkeypatch.setattr(router_triton, "LOGITS_ROWS", LOGITS_ROWS)  # on, whatever the default
    g = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(256, 7168, device="cuda", generator=g) * 7168 ** -0.5
    for n in (1, 2, 3, 4, 8, LOGITS_ROWS, LOGITS_ROWS + 1):
        x = torch.randn(n, 7168, device="cuda", generator=g).bfloat16()
        torch.testing.assert_close(router_logits_triton(x, weight), router_logits(x, weight), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 7168, device="cuda", generator=g).bfloat16()
    router_logits_triton(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = router_logits_triton(x, weight)
    x.copy_(torch.randn(4, 7168, device="cuda", generator=g))
    graph.replay()
    torch.testing.assert_close(y, router_logits(x, weight), rtol=1e-5, atol=1e-5)


@needs_gpu
def test_mla_absorb_from_fp8_equals_the_dequantized_products_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's kv_b (128 heads, nope = v = 128, rank 512, 128 x 128 blocks): the absorbed products read from
    the e4m3 weight equal the bmm with the dequantized halves at every row count they take, in a CUDA graph too."""
    from fusedserve.models.layers import mla_absorb_triton as absorb
    from fusedserve.models.layers.fp8_block import BlockFP8, dequantize_weight, quantize_weight
    from fusedserve.models.layers.mla import KVBFP8

    monkeypatch.setattr(absorb, "ROWS", 16)  # on, whatever the default
    g = torch.Generator(device="cuda").manual_seed(4)
    fmt = BlockFP8(128, 128)
    w, s = quantize_weight(torch.randn(128 * 256, 512, device="cuda", generator=g) * 0.05, fmt)
    fp8 = KVBFP8(w, s, fmt, 128, 128)
    halves = dequantize_weight(w, s, fmt, torch.float32).view(128, 256, 512)
    w_uk, w_uv = halves[:, :128].contiguous(), halves[:, 128:].contiguous()
    for n in (1, 2, 4, 16):
        q = torch.randn(n, 128, 192, device="cuda", generator=g).bfloat16()
        o = torch.randn(n, 128, 512, device="cuda", generator=g).bfloat16()
        want_q = torch.bmm(q[..., :128].float().transpose(0, 1), w_uk).transpose(0, 1)
        want_v = torch.bmm(o.float().transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        got_q = absorb.absorb_q_triton(q[..., :128], w_uk.bfloat16(), fp8)
        got_v = absorb.absorb_v_triton(o, w_uv.bfloat16(), fp8)
        assert _rel(got_q, want_q) < 1e-2 and _rel(got_v, want_v) < 1e-2, (n, _rel(got_q, want_q), _rel(got_v, want_v))
    o = torch.randn(4, 128, 512, device="cuda", generator=g).bfloat16()
    absorb.absorb_v_triton(o, w_uv.bfloat16(), fp8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = absorb.absorb_v_triton(o, w_uv.bfloat16(), fp8)
    o.copy_(torch.randn(4, 128, 512, device="cuda", generator=g))
    graph.replay()
    assert _rel(y, torch.bmm(o.float().transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)) < 1e-2


def _tp2_rank(rank: int, world: int, backend: str, model_dir: str) -> dict[str, Any] | None:
    """A tp=2 engine on two GPUs: CUDA graphs captured on both ranks (the leader announces them), NCCL and
    FlashInfer's fused all-reduce + RMSNorm inside them; planned == executed on every rank."""
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.sequence import SamplingParams
    from fusedserve.worker.parallel.rank import build_rank, follower_channel, lead_engine, leads
    from fusedserve.worker.parallel.step_channel import follow

    torch.cuda.set_device(rank)
    groups = build_groups(ParallelConfig(tp=world), rank, backend)
    config = EngineConfig(num_blocks=64, max_num_seqs=4, skip_tokenizer=True, dtype="bfloat16", device=f"cuda:{rank}",
                          load_format="dummy", seed=5, cuda_graph_batch_sizes=(1, 2, 4))
    built = build_rank(model_dir, config, groups, backend, "flashinfer")
    out: dict[str, Any] = {"fusion": built.fusion.value, "tokens": None}
    if leads(groups):
        engine, runner = lead_engine(built, model_dir, config)
        try:
            done = engine.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]],
                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        finally:
            runner.stop()
        out["tokens"] = [c.token_ids for c in done]
    else:
        follow(built.executor, follower_channel(groups))
    ledger = built.executor.ledger
    assert ledger is not None
    executed: dict[tuple[str, str], int] = {}
    for (op, group, _path), n in ledger.calls.items():
        executed[(op, group)] = executed.get((op, group), 0) + n
    out.update(planned=dict(ledger.planned), executed=executed, paths=sorted({k[2] for k in ledger.calls}),
               graph_runs=built.executor.graphs.runs if built.executor.graphs is not None else 0)
    return out


@needs_two_gpus
def test_tp2_engine_graphs_run_the_planned_collectives(tmp_path: Any) -> None:
    import json

    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 1024,
        "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "rope_theta": 500000.0, "max_position_embeddings": 512}))
    for rank, res in enumerate(run_on_ranks(_tp2_rank, 2, str(tmp_path), backend="nccl", timeout_s=600)):
        assert res["fusion"] == "flashinfer" and "flashinfer_fused" in res["paths"], res
        assert res["planned"] == res["executed"] and res["graph_runs"] > 0, (rank, res)


@needs_gpu
def test_sampling_at_temperature_and_the_chain_rule_equal_references() -> None:
    """The draw at a temperature (a target's 49 152-token rows, a draft's 16 384 through its table, also inside a
    CUDA graph) and the one-launch rejection rule for sampled chains equal their torch references
    on the GPU: the same tokens for every number drawn (also from a column of a chain's numbers, a strided view),
    the distributions to float32 rounding."""
    from fusedserve.worker.engine.sample_triton import sample_triton
    from fusedserve.worker.engine.sampler import sample_at_temperature
    from fusedserve.worker.spec_decode.chain_accept_triton import accept_chains_triton
    from fusedserve.worker.spec_decode.rejection_sampler import accept_chains_at_temperature

    g = torch.Generator(device="cuda").manual_seed(0)
    temps = torch.tensor([0.0, 0.6, 1.0, 1.4], device="cuda")
    for vocab, table in ((49152, None), (16384, torch.randperm(49152, device="cuda", generator=g)[:16384])):
        logits = (4 * torch.randn(4, vocab, device="cuda", generator=g)).to(torch.bfloat16)
        for _ in range(50):
            u = torch.rand(4, 3, device="cuda", generator=g, dtype=torch.float64)[:, 1]
            want, want_q = sample_at_temperature(logits, temps, u, table, True)
            got, got_q = sample_triton(logits, temps, u, table, True)
            assert torch.equal(got, want)
            assert got_q is not None and want_q is not None and float((got_q - want_q).abs().max()) < 1e-6
    u = torch.rand(4, device="cuda", generator=g, dtype=torch.float64)
    graph = torch.cuda.CUDAGraph()
    sample_triton(logits, temps, u, table, True)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured, _ = sample_triton(logits, temps, u, table, True)
    for _ in range(5):
        u.copy_(torch.rand(4, device="cuda", generator=g, dtype=torch.float64))
        graph.replay()
        assert torch.equal(captured, sample_at_temperature(logits, temps, u, table)[0])
    chains, k, vocab = 3, 7, 49152
    first = torch.tensor([0, 8, 17], device="cuda")
    seen = set()
    for trial in range(40):
        logits = (5 * torch.randn(25, vocab, device="cuda", generator=g)).to(torch.bfloat16)
        t = torch.tensor([0.7, 1.0, 1.3], device="cuda")
        rows = first[:, None] + torch.arange(k + 1, device="cuda")
        p = torch.softmax(logits[rows].float() / t[:, None, None], dim=-1)
        mix = 0.25 * (trial % 5)
        q = (1 - mix) * p[:, :k] + mix * torch.softmax(3 * torch.randn(chains, k, vocab, device="cuda", generator=g), -1)
        q = q / q.sum(-1, keepdim=True)
        drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(chains, k)
        u = torch.rand(chains, k + 1, device="cuda", generator=g, dtype=torch.float64)
        want = accept_chains_at_temperature(logits, first, t, drafts, q, u)
        got = accept_chains_triton(logits, first, t, drafts, q, u)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), trial
        seen.update(want[0].tolist())
    assert {0, k} <= seen and len(seen) >= 4


@needs_gpu
def test_sampled_round_outcomes_and_restage_equal_references() -> None:
    """A sampled round's outcome over every chain (``chain_outcomes_triton``) and the next verify's inputs restaged
    to it (``restage_triton``) equal their torch references on the GPU (targets and greedy counts strided slices
    of a verdict, as the engine passes them)."""
    from dataclasses import replace

    from fusedserve.worker.executor.step_graphs import StaticInputs
    from fusedserve.worker.spec_decode.chain_accept_triton import chain_outcomes_triton
    from fusedserve.worker.spec_decode.rejection_sampler import chain_outcomes
    from fusedserve.worker.spec_decode.verify_program import restage_sampled
    from fusedserve.worker.spec_decode.verify_stage_triton import restage_triton

    g = torch.Generator(device="cuda").manual_seed(4)
    b, k = 4, 7
    q = k + 1
    verdict = torch.randint(0, 6, (b, 2 * q), device="cuda", generator=g)
    drafts = torch.randint(0, 6, (b, k), device="cuda", generator=g)
    drafts[0] = verdict[0, k:2 * k]
    for pick in ([], [2], [0, 1, 2, 3]):
        p = torch.tensor(pick, device="cuda") if pick else None
        count = torch.randint(0, q, (len(pick),), device="cuda", generator=g) if pick else None
        token = torch.randint(50, 90, (len(pick),), device="cuda", generator=g) if pick else None
        want = chain_outcomes(drafts, verdict[:, k:2 * k + 1], p, count, token)
        got = chain_outcomes_triton(drafts, verdict[:, k:2 * k + 1], p, count, token)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pick
    counts, tokens = want
    blocks, bs = 6, 16
    index = (torch.arange(q, device="cuda") + torch.tensor([20, 9, 30, 12], device="cuda")[:, None]).reshape(-1)
    base = StaticInputs(torch.zeros(b * q, dtype=torch.long, device="cuda"), index + 1, index * 0, index,
                        index.view(b, q)[:, -1] + 1, torch.randperm(b * blocks, device="cuda", generator=g).view(b, blocks),
                        None, None, 10 ** 6, bs)
    out = []
    for fn in (restage_sampled, restage_triton):
        inputs = replace(base, **{n: getattr(base, n).clone() for n in ("ids", "positions", "slots", "index",
                                                                        "context_lens")})
        fn(inputs, counts, verdict[:, -1], tokens, drafts, b, q)
        out.append(inputs)
    for name in ("ids", "positions", "slots", "index", "context_lens"):
        assert torch.equal(getattr(out[0], name), getattr(out[1], name)), name
