"""Benchmark (e): a DeepSeek-V3-shaped slice, decode step time at ep=2 on 2 GPUs vs its roofline.

    . bench/device_env.sh && python3 -P bench/deepseek_slice.py --out $OUT/deepseek-slice.json
    python bench/deepseek_slice.py --tiny          # a tiny config on CPU ranks (gloo): checks the script

The slice: DeepSeek-V3's shapes (hidden 7168, MLA with 128 heads, q_lora 1536, kv_lora 512,
nope/rope/v 128/64/128, YaRN rope; 256 routed experts of intermediate 2048, top-8 of 8 groups
(4 kept), 1 shared expert, routed_scaling 2.5; vocab 129280) with ``--layers`` full-width
layers, all MoE (first_k_dense_replace = 0: the 58 of 61 layers that matter), random weights
(models/random_init.py), bf16. tp = 2, ep = 2, no DP attention: attention heads split over
the 2 GPUs, 128 routed experts per GPU, the shared expert split over both, FlashInfer's fused
all-reduce + add + RMSNorm at the boundaries, the vocab split over both.

Every sequence has 128 cached tokens (random K/V in the paged cache) and decodes one token.
Two ways of running the same model:
- graphs: the Triton kernel set (decode attention over the expanded MLA cache, head dim 192
  padded to 256; routed experts as two block launches, ``fused_moe_triton.py``), captured as
  CUDA graphs at batch 1..64 (worker/cuda_graph_runner.py), replayed on fixed inputs;
- eager: the reference attention and the per-expert loop (reads its row counts on the host),
  eager, as the model ran before this benchmark (a few batch sizes).
Roofline per GPU and step = bytes that GPU must read / its copy bandwidth, with bytes = its
attention weights + router + its shared-expert slice + the distinct local experts the batch
routes to (counted from the routing of the timed inputs, per layer) + final norm and its
LM-head shard; the step's roofline is the larger of the two GPUs'. The KV cache read (the
expanded MLA cache, 40 KB per token per layer per GPU) is reported beside it, not in it.
Progress lines go to stderr; the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.decode_roofline import MAX_BLOCKS, DecodeState, copy_bandwidth, sync, timed
from bench.decode_tp2 import profile_step

DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 0,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "rope_interleave": True, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": 4096},
}
TINY: dict[str, Any] = {
    **DEEPSEEK_V3, "vocab_size": 250, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "n_routed_experts": 16, "n_group": 4,
    "topk_group": 2, "num_experts_per_tok": 4, "max_position_embeddings": 4096,
    "rope_parameters": {**DEEPSEEK_V3["rope_parameters"], "original_max_position_embeddings": 64, "factor": 4.0},
}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
EAGER_BATCHES = (1, 8, 64)
BLOCK = 16  # DecodeState's sequences: MAX_BLOCKS (32) blocks of 16 tokens each
CONTEXT = 128  # cached tokens before the decoded one
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[deepseek_slice {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def use_reference_path(model: Any, on: bool, kernels: Any) -> None:
    """Switch every layer between the reference attention + per-expert loop (eager, as before)
    and the kernel set the model was built with (benchmark only: a model chooses at construction)."""
    from fusedserve.models.layers.attention import paged_attention_reference

    for layer in model.layers:
        layer.self_attn.attention = paged_attention_reference if on else kernels.attention
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.fused = None if on else kernels.fused_moe


def reference_batch(state: DecodeState, kv: Any) -> Any:
    """The decode step of ``state`` with the layout also as Python lists (the reference attention reads them)."""
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata

    ids, pos, slots, tables, ctx = state.inputs()
    n = ids.shape[0]
    lens = ctx.tolist()
    width = max(-(-c // BLOCK) for c in lens)
    return ForwardBatch(ids, pos, [1] * n, lens, slots, [t[:width] for t in tables.tolist()], kv,
                        paged=PagedAttentionMetadata.decode(tables, ctx))


def router_outputs(model: Any, fn: Any, pinned: list[Any] | None = None) -> tuple[list[Any], Any]:
    """(each MoE layer's router output (weights, ids) while ``fn`` ran eagerly, fn's result); with
    ``pinned`` the routers' outputs are replaced by those (the same experts and weights as another run)."""
    seen: list[Any] = []
    gates = [layer.mlp.gate for layer in model.layers if hasattr(layer.mlp, "gate")]

    def hook(i: int) -> Any:
        def record(_m: Any, _i: Any, out: Any) -> Any:
            seen.append((out[0].detach().clone(), out[1].detach().clone()))
            return pinned[i] if pinned is not None else None
        return record

    hooks = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    try:
        with torch.no_grad():
            result = fn()
    finally:
        for h in hooks:
            h.remove()
    return seen, result


def routed_ids(model: Any, fn: Any) -> list[torch.Tensor]:
    """The expert ids [n, k] each MoE layer's router chose while ``fn`` ran (eager)."""
    return [ids for _w, ids in router_outputs(model, fn)[0]]


def _kind(name: str) -> str:
    n = name.lower()
    for kind, marks in (("moe_experts", ("_gate_up_kernel", "_down_kernel")),
                        ("comm", ("allreduce", "all_reduce", "nccl", "fusion", "lamport", "oneshot", "twoshot")),
                        ("attention", ("_decode_kernel", "_combine_kernel")), ("rms_norm", ("rms_norm",)),
                        ("matmul", ("gemv", "gemm", "cutlass", "xmma", "nvjet", "sm90", "splitk", "cublas"))):
        if any(m in n for m in marks):
            return kind
    return "other (router, MoE metadata, rope, elementwise)"


def _rank(rank: int, world: int, backend: str, opts: dict[str, Any]) -> dict[str, Any]:
    from transformers import DeepseekV3Config

    import bench.decode_tp2 as dt
    from fusedserve.models.forward_batch import KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.reference import make_fused_allreduce_norm
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.models.random_init import random_model
    from fusedserve.worker.executor.cuda_graph_runner import CudaGraphRunner

    dt._kind = _kind  # the profile's kinds of kernel for this model
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tiny = opts["tiny"]
    shape = {**(TINY if tiny else DEEPSEEK_V3), "num_hidden_layers": opts["layers"]}
    out: dict[str, Any] = {"rank": rank}
    bw = copy_bandwidth(device, (4 << 30) if cuda and not tiny else (64 << 20))
    out["copy_bandwidth_TBps"] = bw / 1e12
    if rank == 0:
        progress(f"copy bandwidth {bw / 1e12:.3f} TB/s")

    config = DeepseekV3Config(**shape, architectures=["DeepseekV3ForCausalLM"])
    groups = build_groups(ParallelConfig(tp=world, ep=world), rank, backend)
    fused = make_fused_allreduce_norm("flashinfer" if cuda else "reference", groups, config.hidden_size,
                                      torch.bfloat16)
    collectives = Collectives(backend, fused=fused)
    kernels = Kernels.triton() if cuda else Kernels.torch_native()
    t = time.perf_counter()
    model = random_model(config, groups, collectives, dtype=torch.bfloat16, device=device, seed=0,
                         kernels=kernels)
    sync(device)
    moe0 = model.layers[0].mlp
    experts = moe0.experts
    expert_bytes = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 2
    per_layer = {"attention": nbytes(model.layers[0].self_attn), "router": nbytes(moe0.gate),
                 "shared_expert": nbytes(moe0.shared_experts),
                 "norms": nbytes(model.layers[0].input_layernorm) + nbytes(model.layers[0].post_attention_layernorm)}
    fixed = sum(per_layer.values()) * len(model.layers) + nbytes(model.norm) + nbytes(model.lm_head)
    out.update(fused_path=fused.path, kernels=kernels.name, weight_bytes=nbytes(model), local_experts=experts.num_local,
               first_local_expert=experts.first, expert_bytes=expert_bytes, bytes_per_layer_without_experts=per_layer,
               lm_head_bytes=nbytes(model.lm_head), fixed_bytes_per_step=fixed, build_s=time.perf_counter() - t)
    if rank == 0:
        progress(f"{len(model.layers)}-layer slice built in {out['build_s']:.1f}s: {nbytes(model) / 1e9:.1f} GB on "
                 f"this GPU ({experts.num_local} experts/layer here), fused path {fused.path}")

    num_blocks = max(BATCH_SIZES) * MAX_BLOCKS + 1
    kv = KVCache.allocate(model.kv_shapes(), num_blocks, BLOCK, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(7)
    for cache in (*kv.k.values(), *kv.v.values()):
        cache.normal_(0.0, 1.0, generator=gen)
    kv_token_bytes = sum(t[0].numel() * t.element_size() for t in (*kv.k.values(), *kv.v.values()))
    out["kv_bytes_per_token_all_layers"] = kv_token_bytes

    t = time.perf_counter()
    runner = CudaGraphRunner(model, kv, max_blocks_per_seq=MAX_BLOCKS, batch_sizes=BATCH_SIZES)
    sync(device)
    out["capture_s"] = time.perf_counter() - t
    if rank == 0:
        progress(f"captured {len(runner.captured)} decode graphs in {out['capture_s']:.1f}s (graphs: {runner.use_graphs})")

    vocab = shape["vocab_size"]
    rows = []
    for bs in BATCH_SIZES:
        g = torch.Generator().manual_seed(bs)
        st = DecodeState(bs, torch.randint(0, vocab, (bs,), generator=g).to(device), CONTEXT, device)
        runner.run(*st.inputs())  # the static buffers now hold this step's inputs
        entry = runner.captured[bs]
        replay = entry.graph.replay if entry.graph is not None else (lambda bs=bs: runner._forward(bs))
        timed(replay, 3, device)
        reps = 2 if tiny else 20
        times = [timed(replay, 1, device) for _ in range(reps)]
        step_s = statistics.median(times)
        ids = routed_ids(model, lambda bs=bs: runner._forward(bs))  # eager, same inputs: the same routing
        local = [((i >= experts.first) & (i < experts.first + experts.num_local)) for i in ids]
        distinct = [int(torch.unique(i[m]).numel()) for i, m in zip(ids, local)]
        routed = [int(m.sum()) for m in local]
        weight_bytes_read = fixed + sum(distinct) * expert_bytes
        kv_read = bs * (CONTEXT + 1) * kv_token_bytes
        # the advancing loop (new tokens, so new routing every step), for comparison with fixed inputs
        loop_st = DecodeState(bs, torch.randint(0, vocab, (bs,), generator=g).to(device), CONTEXT, device)
        n_loop = 2 if tiny else 10
        loop_s = timed(lambda st=loop_st: st.advance(runner.run(*st.inputs())), n_loop, device) / n_loop
        row = {"batch": bs, "ms_per_step": 1000 * step_s, "ms_per_step_min": 1000 * min(times),
               "ms_per_step_advancing_loop": 1000 * loop_s, "tok_per_s": bs / step_s,
               "distinct_local_experts_per_layer": distinct, "local_pairs_per_layer": routed,
               "weight_bytes_read": weight_bytes_read, "kv_bytes_read": kv_read,
               "roofline_ms_this_gpu": 1000 * weight_bytes_read / bw,
               "roofline_with_kv_ms_this_gpu": 1000 * (weight_bytes_read + kv_read) / bw}
        rows.append(row)
        if rank == 0:
            progress(f"batch {bs:>2}: {row['ms_per_step']:.3f} ms/step (graph replay, median of {reps}; advancing "
                     f"loop {row['ms_per_step_advancing_loop']:.3f}), {bs / step_s:,.0f} tok/s; this GPU reads "
                     f"{weight_bytes_read / 1e9:.2f} GB of weights ({sum(distinct)} expert-layers) + "
                     f"{kv_read / 1e9:.2f} GB KV: roofline {row['roofline_ms_this_gpu']:.3f} ms")
    out["graphs"] = rows

    if runner.use_graphs:
        prof = {}
        for bs in (1, 64):
            gen = torch.Generator().manual_seed(1000 + bs)  # the same tokens on both ranks
            st = DecodeState(bs, torch.randint(0, vocab, (bs,), generator=gen).to(device), CONTEXT, device)
            runner.run(*st.inputs())
            graph = runner.captured[bs].graph
            prof[str(bs)] = p = profile_step(graph.replay, device)
            if rank == 0:
                progress(f"profile, batch {bs}: {p['kernels_per_step']:.0f} kernels, {p['kernel_us_per_step']:.0f} us of "
                         f"kernel time; by kind {json.dumps({k: round(v) for k, v in p['by_kind_us'].items()})}")
                for r in p["top"][:10]:
                    progress(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['name'][:90]}")
        out["profile_replay"] = prof

    # correctness: the graph replay vs the same kernels eager, and vs the reference path (reference attention,
    # per-expert loop) eager, with its own routing and with the routing pinned to the kernel path's (a bf16
    # difference can move a token's top-8 across the boundary, which changes its output discontinuously)
    bs = 4
    st = DecodeState(bs, torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(99)).to(device),
                     CONTEXT, device)
    graph_logits = runner.run(*st.inputs()).float().clone()
    routing, eager_logits = router_outputs(model, lambda: runner._forward(bs)[:bs].float().clone())
    use_reference_path(model, True, kernels)
    ref_routing, ref_logits = router_outputs(model, lambda: model(reference_batch(st, kv)).float())
    _, pinned_logits = router_outputs(model, lambda: model(reference_batch(st, kv)).float(), pinned=routing)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    moved = [int((a[1].sort(-1).values != b[1].sort(-1).values).any(-1).sum()) for a, b in zip(routing, ref_routing)]
    out["check_batch4"] = {
        "replay_vs_same_kernels_eager_rel_err": rel(graph_logits, eager_logits),
        "replay_vs_reference_path_rel_err": rel(graph_logits, ref_logits),
        "replay_vs_reference_path_same_argmax": bool(torch.equal(graph_logits.argmax(-1), ref_logits.argmax(-1))),
        "tokens_whose_experts_differ_per_layer": moved,
        "replay_vs_reference_path_routing_pinned_rel_err": rel(graph_logits, pinned_logits),
        "routing_pinned_same_argmax": bool(torch.equal(graph_logits.argmax(-1), pinned_logits.argmax(-1)))}
    if rank == 0:
        progress(f"checks, batch {bs}: {json.dumps(out['check_batch4'])}")

    # eager, as the model ran before: reference attention + per-expert loop
    eager = []
    for bs in EAGER_BATCHES:
        st = DecodeState(bs, torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(bs)).to(device),
                         CONTEXT, device)
        batch = reference_batch(st, kv)
        with torch.no_grad():
            fn = lambda batch=batch: model(batch)
            timed(fn, 1, device)
            reps = 1 if tiny else 3
            s = timed(fn, reps, device) / reps
        eager.append({"batch": bs, "ms_per_step": 1000 * s, "tok_per_s": bs / s})
        if rank == 0:
            progress(f"eager reference path, batch {bs:>2}: {1000 * s:.2f} ms/step")
    out["eager_reference_path"] = eager
    use_reference_path(model, False, kernels)
    return out


def main() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-deepseek-slice-h200x2.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU ranks (gloo): checks the script")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    backend = "nccl" if cuda else "gloo"
    shape = {**(TINY if args.tiny else DEEPSEEK_V3), "num_hidden_layers": args.layers}
    ranks = run_on_ranks(_rank, 2, {"tiny": args.tiny, "layers": args.layers}, backend=backend, timeout_s=900)
    table = []
    for i, bs in enumerate(BATCH_SIZES):
        a, b = ranks[0]["graphs"][i], ranks[1]["graphs"][i]
        roof = max(a["roofline_ms_this_gpu"], b["roofline_ms_this_gpu"])
        roof_kv = max(a["roofline_with_kv_ms_this_gpu"], b["roofline_with_kv_ms_this_gpu"])
        table.append({"batch": bs, "ms_per_step": a["ms_per_step"], "tok_per_s": a["tok_per_s"],
                      "roofline_ms": roof, "pct_of_roofline": 100 * roof / a["ms_per_step"],
                      "roofline_with_kv_ms": roof_kv, "pct_of_roofline_with_kv": 100 * roof_kv / a["ms_per_step"],
                      "distinct_experts_per_layer_rank0_rank1": [a["distinct_local_experts_per_layer"],
                                                                  b["distinct_local_experts_per_layer"]]})
    eager = {e["batch"]: e["ms_per_step"] for e in ranks[0]["eager_reference_path"]}
    for row in table:
        if row["batch"] in eager:
            row["eager_reference_path_ms"] = eager[row["batch"]]
            row["graphs_speedup_vs_eager"] = eager[row["batch"]] / row["ms_per_step"]
    record = {
        "date": str(datetime.date.today()),
        "machine": (torch.cuda.get_device_name() + f" x{torch.cuda.device_count()}") if cuda else "cpu",
        "command": " ".join(["python", *sys.argv]), "dtype": "bfloat16", "model_shape": shape,
        "parallel": {"tp": 2, "ep": 2, "dp": 1, "attention": "heads split over tp=2", "experts_per_gpu": 128},
        "layers": f"{args.layers} full-width layers, all MoE (first_k_dense_replace=0); vocab-parallel embedding and LM head",
        "context": f"{CONTEXT} cached tokens per sequence (random K/V), one decoded",
        "kv_cache_layout": "expanded per-head MLA cache (K 192, V 128 per head), not the latent cache",
        "mode": "CUDA graphs (Triton decode attention + Triton block MoE) vs eager reference path",
        "versions": {"torch": torch.__version__},
        "summary": table, "rank0": ranks[0], "rank1": ranks[1],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                       if k != "distinct_experts_per_layer_rank0_rank1"} for r in table]))


if __name__ == "__main__":
    main()
