"""Benchmark (c): Llama-3-8B-shaped decode at tp=2 on 2 GPUs vs tp=1, measured in the same run.

    . bench/device_env.sh && python3 -P bench/decode_tp2.py --out $OUT/decode-tp2.json
    python bench/decode_tp2.py --tiny          # a small model on CPU (gloo): checks the script only

One set of random weights, named as an HF checkpoint (each tensor drawn from a seed of its
name), is loaded through our loader at tp=1 (one process, GPU 0) and at tp=2 (two processes,
NCCL, FlashInfer's fused all-reduce + residual add + RMSNorm at every boundary the plan fuses,
workspaces made before capture). Both run the Triton kernel set under CUDA graphs captured at
batch 1..64 (worker/cuda_graph_runner.py), twice: with cuBLAS decode matmuls, then with each
matmul (<= 16 rows) through the kernel timed fastest for its shape on that GPU
(``linear_triton.TunedDecodeMatmul``: cuBLAS or a Triton variant; the timings are recorded).
Per tp and variant: the copy bandwidth of each GPU; the
prefill logits of one prompt (tp=2 compared with tp=1: same weights, so bf16 noise only);
(c) batch-1 greedy decode: ms/token of the whole loop (replay + argmax + input update, no host
sync) and of the replay alone, % of the per-GPU roofline (this rank's weight bytes / its copy
bandwidth); (d) tokens/s at batch 1, 2, 4, ..., 64; a torch.profiler summary of one replayed
batch-1 step on rank 0 (kernel time per kind: matmul, communication, attention, ...).
Speed-up = tp=1 ms/token / tp=2 ms/token per variant, and fastest vs fastest (goal >= 1.7).
Progress lines go to stderr; the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.decode_roofline import (
    BATCH_SIZES,
    LLAMA3_8B,
    MAX_BLOCKS,
    PROMPT_LEN,
    TINY,
    DecodeState,
    copy_bandwidth,
    eager_step,
    profile_step,
    sync,
    timed,
)

_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[decode_tp2 {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def stable_seed(name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1_000_003
    return h


def hf_random_tensors(shape: dict[str, Any], device: torch.device, seed: int = 0, std: float = 0.02):  # type: ignore[no-untyped-def]
    """(HF name, tensor) of a Llama checkpoint with random weights, one tensor at a time (bf16):
    matrices ~ N(0, std^2), norm weights ~ U(0.8, 1.2); every rank draws the same values."""
    from fusedserve.models.layers.weight_source import TensorSource

    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = h // heads
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv_heads * hd, h)),
                  (p + "self_attn.v_proj.weight", (kv_heads * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                  (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                  (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                  (p + "post_attention_layernorm.weight", (h,))]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    for name, size in names:
        gen = torch.Generator(device=device).manual_seed(seed + stable_seed(name))
        t = torch.empty(size, dtype=torch.bfloat16, device=device)
        if len(size) == 2:
            t.normal_(0.0, std, generator=gen)
        else:
            t.uniform_(0.8, 1.2, generator=gen)
        yield TensorSource(name, t)


def _rank(rank: int, world: int, backend: str, opts: dict[str, Any]) -> dict[str, Any]:
    from transformers import LlamaConfig

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.llama import LlamaForCausalLM
    from fusedserve.models.loader import load_weights
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.fusion.reference import make_fused_allreduce_norm
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.worker.executor.cuda_graph_runner import CudaGraphRunner

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tiny = opts["tiny"]
    shape = TINY if tiny else LLAMA3_8B
    tag = f"tp={world} rank {rank}"
    out: dict[str, Any] = {"rank": rank, "tp": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    bw = copy_bandwidth(device, (4 << 30) if cuda and not tiny else (64 << 20))
    out["copy_bandwidth_TBps"] = bw / 1e12
    if rank == 0:
        progress(f"[{tag}] copy bandwidth {bw / 1e12:.3f} TB/s")

    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    groups = build_groups(ParallelConfig(tp=world), rank, backend)
    fusion_mode = "flashinfer" if cuda and world > 1 else "reference"
    fused = make_fused_allreduce_norm(fusion_mode, groups, config.hidden_size, torch.bfloat16)
    collectives = Collectives(backend, fused=fused)
    kernels = Kernels.triton() if cuda else Kernels.torch_native()
    model = LlamaForCausalLM(config, groups, collectives, fusion=True, dtype=torch.bfloat16, device=device,
                             kernels=kernels).eval()
    load_weights(model, hf_random_tensors(shape, device))
    if cuda:
        torch.cuda.empty_cache()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    out.update(fused_path=fused.path, kernels=kernels.name, weight_bytes=weight_bytes, embed_bytes=embed_bytes,
               plan_fused_boundaries=sum(1 for b in model.comm.plan.select(1).boundaries if "FUSED" in str(b.kind)))
    if rank == 0:
        progress(f"[{tag}] model loaded: {weight_bytes / 1e9:.2f} GB of weights on this rank; all-reduce+norm "
                 f"path {fused.path}")

    num_blocks = max(BATCH_SIZES) * MAX_BLOCKS + 1
    kv = KVCache.allocate(model.kv_shapes(), num_blocks, 16, torch.bfloat16, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=g).to(device)
    with torch.no_grad():
        prefill = model(ForwardBatch.prefill([prompt.tolist()], kv, device=device, all_logits=False))[0].float()
    out["prefill_logits"] = prefill.cpu()

    def measure(vname: str) -> dict[str, Any]:
        """Capture, batch-1 loop, batch 1..64, profile: one matmul variant."""
        res: dict[str, Any] = {}
        t = time.perf_counter()
        runner = CudaGraphRunner(model, kv, max_blocks_per_seq=MAX_BLOCKS, batch_sizes=BATCH_SIZES)
        sync(device)
        res["capture_s"] = time.perf_counter() - t
        if rank == 0:
            progress(f"[{tag} {vname}] captured {len(runner.captured)} decode graphs in {res['capture_s']:.1f}s "
                     f"(graphs: {runner.use_graphs})")
        res["collectives_per_replay"] = [list(k) for k in runner.planned(1)]

        # replay == eager (batch 1), then greedy tokens and the timed loop
        state = DecodeState(1, prefill.argmax().view(1), PROMPT_LEN, device)
        with torch.no_grad():
            eager = eager_step(model, kv, state).float()
        graph = runner.run(*state.inputs()).float()
        res["replay_vs_eager_rel_err"] = float((graph - eager).norm() / eager.norm())
        tokens = [int(state.ids[0])]
        for _ in range(8):
            state.advance(runner.run(*state.inputs()))
            tokens.append(int(state.ids[0]))
        res["greedy_tokens"] = tokens
        steps = 4 if tiny else opts["steps"]

        def loop_step() -> None:
            state.advance(runner.run(*state.inputs()))

        timed(loop_step, 3, device)
        loop_s = timed(loop_step, steps, device) / steps
        entry = runner.captured[1]
        replay_s = timed(entry.graph.replay, steps, device) / steps if entry.graph is not None else None
        roofline_s = weight_bytes / bw
        res["batch1"] = {"steps_timed": steps, "ms_per_token": 1000 * loop_s, "tok_per_s": 1 / loop_s,
                         "ms_per_replay_only": None if replay_s is None else 1000 * replay_s,
                         "roofline_ms": 1000 * roofline_s, "pct_of_roofline": 100 * roofline_s / loop_s,
                         "effective_bandwidth_TBps": (weight_bytes - embed_bytes) / loop_s / 1e12}
        if rank == 0:
            b = res["batch1"]
            progress(f"[{tag} {vname}] batch 1: {b['ms_per_token']:.3f} ms/token ({b['tok_per_s']:.1f} tok/s), replay alone "
                     f"{b['ms_per_replay_only']} ms; {b['pct_of_roofline']:.1f}% of this GPU's roofline "
                     f"({b['roofline_ms']:.3f} ms); replay vs eager rel err {res['replay_vs_eager_rel_err']:.2e}")

        rows = []
        for bs in BATCH_SIZES:
            gen = torch.Generator().manual_seed(bs)
            st = DecodeState(bs, torch.randint(0, shape["vocab_size"], (bs,), generator=gen).to(device), PROMPT_LEN,
                             device)

            def step(st: DecodeState = st) -> None:
                st.advance(runner.run(*st.inputs()))

            timed(step, 3, device)
            n = 4 if tiny else 32
            s = timed(step, n, device) / n
            rows.append({"batch": bs, "ms_per_step": 1000 * s, "tok_per_s": bs / s,
                         "pct_of_roofline_weights": 100 * roofline_s / s})
            if rank == 0:
                progress(f"[{tag} {vname}] batch {bs:>2}: {1000 * s:.3f} ms/step, {bs / s:,.0f} tok/s")
        res["throughput"] = rows

        if runner.use_graphs and entry.graph is not None:  # every rank replays: the graph holds collectives
            prof = profile_step(entry.graph.replay, device, top=24)
            if rank == 0:
                res["profile_batch1_replay"] = prof
        if rank == 0 and "profile_batch1_replay" in res:
            prof = res["profile_batch1_replay"]
            progress(f"[{tag} {vname}] profile of one replay: {prof['kernels_per_step']:.0f} kernels, "
                     f"{prof['kernel_us_per_step']:.0f} us of kernel time; by kind "
                     f"{json.dumps({k: round(v) for k, v in prof['by_kind_us'].items()})}")
            for r in prof["top"][:12]:
                progress(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['name'][:90]}")
        return res

    out["variants"] = {"cublas": measure("cublas")}
    if cuda and not tiny:  # the decode matmuls timed per shape and row count on this GPU, then used
        from fusedserve.models.layers.linear import use_matmul
        from fusedserve.models.layers.linear_triton import TunedDecodeMatmul

        shapes = [tuple(m.weight.shape) for m in model.modules() if hasattr(m, "matmul") and hasattr(m, "weight")]
        t = time.perf_counter()
        tuned = TunedDecodeMatmul.tune(shapes, [b for b in BATCH_SIZES if b <= 16], torch.bfloat16, device,
                                       log=progress if rank == 0 else None)
        use_matmul(model, tuned)
        out["tuned_matmul"] = {"tune_s": time.perf_counter() - t,
                               "table": {f"{n}x{k} rows {m}": c for (n, k, m), c in tuned.table.items()},
                               "timings_us": tuned.timings}
        out["variants"]["tuned"] = measure("tuned")
    led = collectives.ledger
    out["ledger_calls"] = {"|".join(k): v for k, v in led.calls.items()}
    return out


def main() -> None:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-decode-tp2-h200x2.json")
    ap.add_argument("--steps", type=int, default=128, help="timed batch-1 decode steps")
    ap.add_argument("--tiny", action="store_true", help="small model on CPU ranks (gloo): checks the script")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    backend = "nccl" if cuda else "gloo"
    opts = {"tiny": args.tiny, "steps": args.steps}
    record: dict[str, Any] = {
        "date": str(datetime.date.today()),
        "machine": (torch.cuda.get_device_name() + f" x{torch.cuda.device_count()}") if cuda else "cpu",
        "command": " ".join(["python", *sys.argv]), "dtype": "bfloat16",
        "model_shape": TINY if args.tiny else LLAMA3_8B, "batch_sizes": list(BATCH_SIZES),
        "context": f"prompt {PROMPT_LEN} tokens, then decode; cache {MAX_BLOCKS * 16} tokens per sequence",
        "versions": {"torch": torch.__version__},
    }
    results = {}
    for tp in (1, 2):
        progress(f"tp={tp}: spawning {tp} rank(s) ({backend})")
        ranks = run_on_ranks(_rank, tp, opts, backend=backend, timeout_s=900)
        results[tp] = ranks
    logits1 = results[1][0].pop("prefill_logits")
    logits2 = [r.pop("prefill_logits") for r in results[2]]
    record["prefill_tp2_vs_tp1"] = {
        "cosine": float(torch.nn.functional.cosine_similarity(logits2[0], logits1, dim=0)),
        "same_argmax": int(logits2[0].argmax()) == int(logits1.argmax()),
        "max_abs_diff": float((logits2[0] - logits1).abs().max()), "max_abs_logit": float(logits1.abs().max()),
        "ranks_agree": bool(torch.equal(logits2[0], logits2[1]))}
    record["tp1"] = results[1][0]
    record["tp2"] = {"rank0": results[2][0], "rank1": results[2][1]}
    r1, r2 = results[1][0]["variants"], results[2][0]["variants"]
    record["speedup_tp2_vs_tp1"] = {}
    for name in r1:
        if name in r2:
            record["speedup_tp2_vs_tp1"][name] = {
                "tp1_ms_per_token": r1[name]["batch1"]["ms_per_token"],
                "tp2_ms_per_token": r2[name]["batch1"]["ms_per_token"],
                "tp1_pct_of_roofline": r1[name]["batch1"]["pct_of_roofline"],
                "tp2_pct_of_roofline": r2[name]["batch1"]["pct_of_roofline"],
                "batch1": r1[name]["batch1"]["ms_per_token"] / r2[name]["batch1"]["ms_per_token"],
                "throughput": [{"batch": a["batch"], "speedup": a["ms_per_step"] / b["ms_per_step"]}
                               for a, b in zip(r1[name]["throughput"], r2[name]["throughput"])]}
    best1 = min(r1, key=lambda n: r1[n]["batch1"]["ms_per_token"])
    best2 = min(r2, key=lambda n: r2[n]["batch1"]["ms_per_token"])
    speedup = r1[best1]["batch1"]["ms_per_token"] / r2[best2]["batch1"]["ms_per_token"]
    record["headline"] = {"tp1_variant": best1, "tp2_variant": best2, "speedup_batch1": speedup,
                          "tp1_ms_per_token": r1[best1]["batch1"]["ms_per_token"],
                          "tp2_ms_per_token": r2[best2]["batch1"]["ms_per_token"]}
    record["goals"] = {"speedup_ge_1_7": speedup >= 1.7}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    progress(f"prefill logits tp=2 vs tp=1: {record['prefill_tp2_vs_tp1']}")
    print(json.dumps({"headline": record["headline"], "per_variant": {
        n: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "throughput"}
        for n, r in record["speedup_tp2_vs_tp1"].items()}}))


if __name__ == "__main__":
    main()
