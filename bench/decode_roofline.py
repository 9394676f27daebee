"""Benchmarks (b) and (d): decode of a Llama-3-8B-shaped random-weight model on one GPU vs the HBM roofline.

    . bench/device_env.sh && python -P bench/decode_roofline.py --out $OUT/decode-roofline.json
    python bench/decode_roofline.py --tiny          # a small model on CPU: checks the script only

In one run: (1) the copy bandwidth (a 4 GiB device-to-device copy, read + write counted);
(2) HF transformers' LlamaForCausalLM with random weights (bf16, its default attention, eager),
prefill of a 128-token prompt, then greedy decode tokens timed one by one; its prefill logits in
fp32 too (the oracle, and the bf16 noise floor); (3) our
LlamaForCausalLM loaded from the same weights through our loader, Triton kernels, its prefill
logits compared with HF's; (4) CUDA graphs captured at batch 1..64 (worker/cuda_graph_runner.py);
for each kernel set (Triton with cuBLAS matmuls, the default, and with the decode matmuls tuned per
shape on this GPU: ``linear_triton.TunedDecodeMatmul``, which also times the opt-in skinny kernel):
(b) batch-1 greedy decode: ms/token of the whole loop (replay + argmax + input update, no host
sync), of the replay alone, and of our eager forward; % of roofline = (weight bytes / copy
bandwidth) / ms per token; the same tokens as HF?; (d) tokens/s at batch 1, 2, 4, ..., 64 (each
sequence at context 128+); a torch.profiler summary of one replayed batch-1 step (top kernels,
time per kind of kernel). Progress lines go to stderr; the JSON record to --out.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "tie_word_embeddings": False}
TINY: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 500, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024, "tie_word_embeddings": False}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
BLOCK = 16
MAX_BLOCKS = 32  # 512 tokens of context per sequence
PROMPT_LEN = 128
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[decode_roofline {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Seconds for ``reps`` calls of fn back to back (device time on CUDA)."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write (median of 20)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timed(lambda: dst.copy_(src), 1, device) for _ in range(20)]
    return 2 * nbytes / statistics.median(times)


def build_hf(shape: dict[str, Any], device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    # No hf.to(bfloat16): it would also round the fp32 RoPE inv_freq buffer to bf16 (seen: greedy tokens and
    # logits then drift from the fp32 oracle), which HF keeps in fp32 when it builds in bf16.
    assert all(p.dtype == torch.bfloat16 for p in hf.parameters())
    assert all(b.dtype == torch.float32 for n, b in hf.named_buffers() if "inv_freq" in n)
    return hf.eval()


@torch.no_grad()
def hf_decode(hf: Any, prompt: torch.Tensor, tokens: int, device: torch.device) -> dict[str, Any]:
    """Prefill, then greedy decode; every decode step timed (synchronised), the first two as warm-up."""
    out = hf(input_ids=prompt[None], use_cache=True)
    last_logits = out.logits[0, -1].float()
    tok = out.logits[0, -1].argmax()
    cache = out.past_key_values
    seq = [int(tok)]
    step_s = []
    for _ in range(tokens + 2):
        sync(device)
        t = time.perf_counter()
        out = hf(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[0, -1].argmax()
        sync(device)
        step_s.append(time.perf_counter() - t)
        seq.append(int(tok))
    timed_steps = step_s[2:]
    return {"tokens_timed": len(timed_steps), "ms_per_token": 1000 * statistics.mean(timed_steps),
            "tok_per_s": len(timed_steps) / sum(timed_steps), "greedy_tokens": seq,
            "attn_implementation": getattr(hf.config, "_attn_implementation", None), "prefill_logits": last_logits}


class DecodeState:
    """bs sequences decoding greedily on the device: sequence i owns blocks [i*MAX_BLOCKS, (i+1)*MAX_BLOCKS)."""

    def __init__(self, bs: int, first_ids: torch.Tensor, start_pos: int, device: torch.device) -> None:
        self.tables = torch.arange(bs * MAX_BLOCKS, dtype=torch.int32, device=device).view(bs, MAX_BLOCKS)
        self.ids = first_ids.clone()
        self.pos = torch.full((bs,), start_pos, dtype=torch.long, device=device)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        slots = self.tables.long().gather(1, (self.pos // BLOCK)[:, None])[:, 0] * BLOCK + self.pos % BLOCK
        return self.ids, self.pos, slots, self.tables, (self.pos + 1).to(torch.int32)

    def advance(self, logits: torch.Tensor) -> None:
        self.ids = logits.argmax(-1)
        self.pos += 1


def eager_step(model: Any, kv: Any, state: DecodeState) -> torch.Tensor:
    from fusedserve.models.forward_batch import ForwardBatch, PagedAttentionMetadata

    ids, pos, slots, tables, ctx = state.inputs()
    n = ids.shape[0]
    batch = ForwardBatch(ids, pos, [1] * n, [0] * n, slots, [[0]] * n, kv,
                         paged=PagedAttentionMetadata.decode(tables, ctx))
    logits: torch.Tensor = model(batch)
    return logits


def profile_step(fn: Callable[[], Any], device: torch.device, reps: int = 3, top: int = 20) -> dict[str, Any]:
    """Kernels of ``reps`` calls (per call): the top kernels and the time per kind of kernel."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    rows = []
    for evt in prof.key_averages():
        us = float(getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0))
        if us > 0 and getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
            rows.append({"name": evt.key[:120], "calls_per_step": evt.count / reps, "us_per_step": us / reps})
    rows.sort(key=lambda r: -r["us_per_step"])
    kinds: dict[str, float] = {}
    for r in rows:
        kinds[_kind(r["name"])] = kinds.get(_kind(r["name"]), 0.0) + r["us_per_step"]
    total = sum(r["us_per_step"] for r in rows)
    return {"kernel_us_per_step": total, "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "by_kind_us": dict(sorted(kinds.items(), key=lambda kv: -kv[1])), "top": rows[:top]}


def _kind(name: str) -> str:
    n = name.lower()
    for kind, marks in (("comm", ("allreduce", "all_reduce", "nccl", "fusion", "lamport", "oneshot", "twoshot")),
                        ("attention", ("_decode_kernel", "_combine_kernel")), ("rms_norm", ("rms_norm",)),
                        ("rope", ("rope",)), ("silu_mul", ("silu_mul",)),
                        ("matmul", ("gemv", "gemm", "cutlass", "xmma", "nvjet", "sm90", "splitk", "cublas")),
                        ("embedding", ("embedding", "index")), ("argmax", ("argmax", "reduce"))):
        if any(m in n for m in marks):
            return kind
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-decode-roofline-h200.json")
    ap.add_argument("--steps", type=int, default=128, help="timed batch-1 decode steps")
    ap.add_argument("--hf-tokens", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="small model (CPU if no GPU): checks the script")
    args = ap.parse_args()

    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.layers.weight_source import TensorSource
    from fusedserve.models.llama import LlamaForCausalLM
    from fusedserve.models.loader import load_weights
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.groups import ParallelGroups

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = TINY if args.tiny else LLAMA3_8B
    record: dict[str, Any] = {
        "date": str(datetime.date.today()), "machine": torch.cuda.get_device_name() if cuda else "cpu",
        "command": " ".join(["python", *sys.argv]), "dtype": "bfloat16", "model_shape": shape,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    try:
        import triton

        record["versions"]["triton"] = triton.__version__
    except ImportError:
        pass

    bw = copy_bandwidth(device, (4 << 30) if cuda and not args.tiny else (64 << 20))
    record["copy_bandwidth_TBps"] = bw / 1e12
    progress(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")

    hf = build_hf(shape, device)
    progress("HF model built (random weights)")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (PROMPT_LEN,), generator=g).to(device)
    hf_res = hf_decode(hf, prompt, args.hf_tokens, device)
    hf_prefill = hf_res.pop("prefill_logits")
    record["hf_eager"] = hf_res
    progress(f"HF eager decode: {hf_res['ms_per_token']:.1f} ms/token = {hf_res['tok_per_s']:.2f} tok/s "
             f"(attention {hf_res['attn_implementation']})")

    # the oracle, and the noise floor of a bf16 forward: HF in fp32 on the same prompt
    hf32 = copy.deepcopy(hf).float()
    with torch.no_grad():
        hf32_prefill = hf32(input_ids=prompt[None]).logits[0, -1].float()
    del hf32
    if cuda:
        torch.cuda.empty_cache()
    record["hf_bf16_vs_hf_fp32"] = _compare(hf_prefill, hf32_prefill)
    progress(f"HF bf16 vs HF fp32 prefill logits: {record['hf_bf16_vs_hf_fp32']}")

    # where our bf16 error comes from: the plain torch reference kernels in bf16 and in fp32, same weights
    record["prefill_precision_vs_hf_fp32"] = {}
    for dtype in (torch.bfloat16, torch.float32):
        ref = LlamaForCausalLM(hf.config, ParallelGroups.single_rank(), Collectives("nccl" if cuda else "gloo"),
                               fusion=False, dtype=dtype, device=device, kernels=Kernels.reference()).eval()
        load_weights(ref, (TensorSource(n, t) for n, t in hf.state_dict().items()))
        kv_ref = KVCache.allocate(ref.kv_shapes(), PROMPT_LEN // BLOCK, BLOCK, dtype, device)
        with torch.no_grad():
            logits = ref(ForwardBatch.prefill([prompt.tolist()], kv_ref, device=device, all_logits=False))[0].float()
        key = f"ours_reference_kernels_{str(dtype).split('.')[-1]}"
        record["prefill_precision_vs_hf_fp32"][key] = _compare(logits, hf32_prefill)
        progress(f"{key} prefill logits vs HF fp32: {record['prefill_precision_vs_hf_fp32'][key]}")
        del ref, kv_ref
        if cuda:
            torch.cuda.empty_cache()

    # triton_tuned_matmul: the same kernels, decode matmuls (<= 16 rows) through the kernel timed fastest
    # per weight shape and row count on this GPU (cuBLAS or a Triton variant; linear_triton.TunedDecodeMatmul)
    variants = {"triton": Kernels.triton(), "triton_tuned_matmul": Kernels.triton()} if cuda \
        else {"torch": Kernels.torch_native()}
    models = {}
    for name, kernels in variants.items():
        model = LlamaForCausalLM(hf.config, ParallelGroups.single_rank(), Collectives("nccl" if cuda else "gloo"),
                                 fusion=False, dtype=torch.bfloat16, device=device, kernels=kernels).eval()
        load_weights(model, (TensorSource(n, t) for n, t in hf.state_dict().items()))
        if name == "triton_tuned_matmul":
            from fusedserve.models.layers.linear import use_matmul
            from fusedserve.models.layers.linear_triton import TunedDecodeMatmul

            shapes = [tuple(m.weight.shape) for m in model.modules() if hasattr(m, "matmul") and hasattr(m, "weight")]
            t = time.perf_counter()
            tuned = TunedDecodeMatmul.tune(shapes, [b for b in BATCH_SIZES if b <= 16], torch.bfloat16, device,
                                           log=progress)
            use_matmul(model, tuned)
            record["tuned_matmul"] = {"tune_s": time.perf_counter() - t,
                                      "table": {f"{n}x{k} rows {m}": c for (n, k, m), c in tuned.table.items()},
                                      "timings_us": tuned.timings}
        models[name] = model
    del hf
    if cuda:
        torch.cuda.empty_cache()
    first = next(iter(models.values()))
    weight_bytes = sum(p.numel() * p.element_size() for p in first.parameters())
    embed_bytes = first.embed_tokens.weight.numel() * first.embed_tokens.weight.element_size()
    record["weight_bytes"] = weight_bytes
    progress(f"our models loaded from the HF weights: {weight_bytes / 1e9:.2f} GB of weights each; "
             f"variants {list(models)}")

    record["variants"] = {}
    for name, model in models.items():
        record["variants"][name] = measure(name, model, prompt, hf_prefill, hf32_prefill, hf_res, bw, weight_bytes,
                                           embed_bytes, args, device)
    main_variant = min(record["variants"], key=lambda n: record["variants"][n]["b_batch1"]["ms_per_token"])
    record["headline_variant"] = main_variant  # the fastest at batch 1; every variant is recorded
    v = record["variants"][main_variant]
    b = v["b_batch1"]
    record["goals"] = {"pct_of_roofline_ge_85": b["pct_of_roofline"] >= 85,
                       "speedup_vs_hf_ge_20": b["speedup_vs_hf_eager"] >= 20}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    summary = {name: {"ms_per_token": r["b_batch1"]["ms_per_token"], "pct_of_roofline": r["b_batch1"]["pct_of_roofline"],
                      "speedup_vs_hf_eager": r["b_batch1"]["speedup_vs_hf_eager"],
                      "d_tok_per_s": [(x["batch"], round(x["tok_per_s"])) for x in r["d_throughput"]]}
               for name, r in record["variants"].items()}
    print(json.dumps({"hf_tok_per_s": hf_res["tok_per_s"], "variants": summary, "goals": record["goals"]}))


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    return {"cosine": float(torch.nn.functional.cosine_similarity(got, want, dim=0)),
            "same_argmax": int(got.argmax()) == int(want.argmax()),
            "max_abs_diff": float((got - want).abs().max()), "max_abs_logit": float(want.abs().max())}


def measure(name: str, model: Any, prompt: torch.Tensor, hf_prefill: torch.Tensor, hf32_prefill: torch.Tensor,
            hf_res: dict[str, Any],
            bw: float, weight_bytes: int, embed_bytes: int, args: Any, device: torch.device) -> dict[str, Any]:
    """Prefill check, capture, (b) batch-1 decode, (d) throughput, profile: one kernel set."""
    from fusedserve.models.forward_batch import ForwardBatch, KVCache
    from fusedserve.worker.executor.cuda_graph_runner import CudaGraphRunner

    out: dict[str, Any] = {"kernels": model.kernels.name,
                           "skinny_matmul": model.kernels.matmul is not None}
    num_blocks = max(BATCH_SIZES) * MAX_BLOCKS + 1  # the last block holds the padding rows' slot
    kv = KVCache.allocate(model.kv_shapes(), num_blocks, BLOCK, torch.bfloat16, device)
    kv_bytes_per_token = sum(t[0].numel() * t.element_size() for t in [*kv.k.values(), *kv.v.values()])
    with torch.no_grad():
        prefill = model(ForwardBatch.prefill([prompt.tolist()], kv, device=device, all_logits=False))[0].float()
    out["prefill_vs_hf"] = _compare(prefill, hf_prefill)
    progress(f"[{name}] prefill logits vs HF bf16: {out['prefill_vs_hf']}")
    out["prefill_vs_hf_fp32"] = _compare(prefill, hf32_prefill)
    progress(f"[{name}] prefill logits vs HF fp32: {out['prefill_vs_hf_fp32']}")

    t = time.perf_counter()
    runner = CudaGraphRunner(model, kv, max_blocks_per_seq=MAX_BLOCKS, batch_sizes=BATCH_SIZES)
    sync(device)
    out["capture_s"] = time.perf_counter() - t
    progress(f"[{name}] captured {len(runner.captured)} decode graphs in {out['capture_s']:.1f}s "
             f"(graphs: {runner.use_graphs})")

    # (b) batch 1: greedy tokens (compared with HF's), then the timed loop
    state = DecodeState(1, prefill.argmax().view(1), PROMPT_LEN, device)
    ours = [int(state.ids[0])]
    for _ in range(args.hf_tokens + 2):
        state.advance(runner.run(*state.inputs()))
        ours.append(int(state.ids[0]))
    hf_tokens = hf_res["greedy_tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(ours, hf_tokens)) if a != b), len(hf_tokens))
    steps = args.steps if not args.tiny else 8

    def loop_step() -> None:
        state.advance(runner.run(*state.inputs()))

    loop_s = timed(loop_step, steps, device) / steps
    entry = runner.captured[1]
    replay_s = timed(entry.graph.replay, steps, device) / steps if entry.graph is not None else None
    eager_s = timed(lambda: state.advance(eager_step(model, kv, state)), 5, device) / 5
    ctx_mean = PROMPT_LEN + args.hf_tokens + 3 + steps // 2
    roofline_s = weight_bytes / bw
    streamed = weight_bytes - embed_bytes + kv_bytes_per_token * ctx_mean
    b: dict[str, Any] = {
        "batch": 1, "context_tokens_mean": ctx_mean, "steps_timed": steps,
        "ms_per_token": 1000 * loop_s, "tok_per_s": 1 / loop_s,
        "ms_per_replay_only": None if replay_s is None else 1000 * replay_s,
        "ms_per_token_eager_ours": 1000 * eager_s,
        "weight_bytes": weight_bytes, "roofline_ms": 1000 * roofline_s, "roofline_tok_per_s": 1 / roofline_s,
        "pct_of_roofline": 100 * roofline_s / loop_s,
        "bytes_streamed_per_token": streamed,
        "effective_bandwidth_TBps": streamed / loop_s / 1e12,
        "speedup_vs_hf_eager": hf_res["ms_per_token"] / 1000 / loop_s,
        "greedy_tokens_ours": ours, "greedy_tokens_agree_with_hf": agree, "greedy_tokens_compared": len(hf_tokens),
    }
    out["b_batch1"] = b
    progress(f"[{name}] batch 1: {b['ms_per_token']:.3f} ms/token ({b['tok_per_s']:.1f} tok/s), replay alone "
             f"{b['ms_per_replay_only']} ms, eager {b['ms_per_token_eager_ours']:.1f} ms; "
             f"{b['pct_of_roofline']:.1f}% of roofline ({b['roofline_ms']:.3f} ms); "
             f"{b['speedup_vs_hf_eager']:.1f}x HF eager; first {agree}/{len(hf_tokens)} greedy tokens as HF")

    # (d) throughput at batch 1..64
    rows = []
    for bs in BATCH_SIZES:
        gen = torch.Generator().manual_seed(bs)
        st = DecodeState(bs, torch.randint(0, model.config.vocab_size, (bs,), generator=gen).to(device),
                         PROMPT_LEN, device)

        def step(st: DecodeState = st) -> None:
            st.advance(runner.run(*st.inputs()))

        timed(step, 3, device)
        n = 32 if not args.tiny else 4
        s = timed(step, n, device) / n
        rows.append({"batch": bs, "ms_per_step": 1000 * s, "tok_per_s": bs / s,
                     "pct_of_roofline_weights": 100 * roofline_s / s})
        progress(f"[{name}] batch {bs:>2}: {1000 * s:.3f} ms/step, {bs / s:,.0f} tok/s")
    out["d_throughput"] = rows

    if runner.use_graphs and entry.graph is not None:
        prof = out["profile_batch1_replay"] = profile_step(entry.graph.replay, device)
        if not prof["top"]:  # the profiler saw no kernels inside the graph: profile the eager step instead
            prof = out["profile_batch1_eager"] = profile_step(lambda: eager_step(model, kv, state), device)
        progress(f"[{name}] profile of one replay: {prof['kernels_per_step']:.0f} kernels, "
                 f"{prof['kernel_us_per_step']:.0f} us of kernel time; by kind "
                 f"{json.dumps({k: round(v) for k, v in prof['by_kind_us'].items()})}")
        for r in prof["top"][:14]:
            progress(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['name'][:90]}")
    return out


if __name__ == "__main__":
    main()
