"""Decode and prefill through the engine's public API, against HF transformers in the same run.

    . bench/device_env.sh && python -P bench/decode_engine.py --out $OUT/decode-engine.json
    python bench/decode_engine.py --tiny          # a small model on CPU: checks the script only

A Llama-3-8B-shaped model (random bf16 weights: ``load_format="dummy"``, the engine's defaults
otherwise: CUDA graphs and the fast kernel set on the GPU) is driven only through
``Engine.add_request`` / ``Engine.step``; every figure is wall time of ``step()`` calls run back to
back, as a serving loop runs them, after a warm-up (the engine overlaps a step's host work with the
GPU running the next: ``inflight_step.py``; the time of ``steps`` steps over ``steps``). In one run:

1. ceilings: copy bandwidth (read + write counted) and a large bf16 matmul;
2. decode at batch 1 .. 64: each sequence a 128-token prompt (``--prompt-len``), then ``--steps`` greedy decode
   steps; ms per step (median, with min/max/spread over the steps) and tok/s; the honest roofline
   of that step = bytes it must stream (every weight except the embedding table, one embedding
   row per sequence, the K/V of each sequence's real context, the new K/V) over the copy bandwidth;
3. a profile of one batch-1 and one batch-64 decode step (kernels by kind; ``--profile-batches``);
4. prefill: time to first token of one 1k- and one 8k-token prompt, at the default
   ``max_batch_tokens`` (chunked prefill) and with one chunk; model FLOPs (2 x non-embedding
   parameters x tokens + causal attention 2 x layers x L^2 x q_heads x head_dim) over the time,
   against the datasheet dense bf16 peak (989 TFLOP/s) and the matmul measured here;
5. the peer a user would otherwise pick on one GPU: HF transformers with a ``StaticCache`` and a
   ``torch.compile``d one-token step (``cudagraph_mark_step_begin`` before each call) at the same
   batches and prompt length;
6. decode at batch 1 / 16 / 64 with ``overlap_scheduling=False`` (each step's tokens read back
   before the next is planned), what the overlap gains;
7. the fast kernel set's greedy tokens against the reference set's (same weights, eager) for
   ``--check-tokens`` steps at batch 1: first divergence, the largest difference of the top-1
   log-probability over the common prefix (the bf16 distance), and both runs' margin between their two
   best tokens where they part (a near-tie or not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)
from fusedserve.models.layers.pdl import pdl_enabled
from fusedserve.worker.engine.config import EngineConfig
from fusedserve.worker.engine.engine import Engine
from fusedserve.worker.engine.sequence import SamplingParams

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.common import (
    Progress,
    apply_settings,
    copy_bandwidth,
    drop_kernels,
    matmul_peak,
    profile,
    record_header,
    spread,
    sync,
    write_record,
)

LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "tie_word_embeddings": False}
TINY: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 500, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048, "tie_word_embeddings": False}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 128
DENSE_BF16_PEAK = 989e12  # H200 SXM datasheet, dense bf16
progress = Progress("decode_engine")


def model_dir(shape: dict[str, Any], root: Path) -> Path:
    """A checkpoint directory with only config.json: the engine draws the weights (load_format dummy)."""
    d = root / "llama-shape"
    d.mkdir(parents=True, exist_ok=True)
    config = {**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    (d / "config.json").write_text(json.dumps(config))
    return d


def weight_bytes(shape: dict[str, Any], dtype_bytes: int = 2) -> tuple[int, int]:
    """(streamed weight bytes per decode step excluding the embedding table, embedding row bytes)."""
    h, i, n, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    lm_head = v * h
    return (n * per_layer + h + lm_head) * dtype_bytes, h * dtype_bytes


def kv_bytes_per_token(shape: dict[str, Any], dtype_bytes: int = 2) -> int:
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * hd * dtype_bytes


def engine_for(path: Path, device: str, **cfg: Any) -> Engine:
    config = EngineConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32", load_format="dummy",
                          seed=0, skip_tokenizer=True, **cfg)
    return Engine(path, config)


def prompts_of(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def decode_run(engine: Engine, batch: int, steps: int, vocab: int, dev: torch.device) -> dict[str, Any]:
    """``batch`` sequences prefilled, then ``steps`` decode steps timed one by one (wall time of step())."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    pending = {engine.add_request(p, params) for p in prompts_of(batch, PROMPT_LEN, vocab)}
    while pending:  # prefill (chunked) until every sequence has its first token: all decode from here
        pending -= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(3):
        engine.step()  # warm-up decode steps
    times = []
    sync(dev)
    t0 = t = time.perf_counter()
    for _ in range(steps):  # back to back, as a serving loop runs them (overlapped steps run ahead of the GPU)
        engine.step()
        now = time.perf_counter()
        times.append(now - t)
        t = now
    sync(dev)
    per_step = (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    s = spread(times)
    return {"batch": batch, "ms_per_step": 1000 * per_step, "ms_median": 1000 * s["median"], "ms_min": 1000 * s["min"],
            "ms_max": 1000 * s["max"], "spread": s["spread"], "steps": steps, "tok_per_s": batch / per_step,
            "overlapped": engine.overlap, "context_at_midpoint": PROMPT_LEN + 3 + steps // 2}


def host_profile(engine: Engine, batch: int, steps: int, vocab: int, top: int = 25) -> list[str]:
    """cProfile of ``steps`` decode steps at ``batch``: where the host's time per step goes."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    pending = {engine.add_request(p, params) for p in prompts_of(batch, PROMPT_LEN, vocab, seed=5)}
    while pending:
        pending -= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(3):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_unfinished():
        engine.step()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][:top + 12]


def ttft(engine: Engine, length: int, vocab: int, dev: torch.device, seed: int) -> float:
    """Time to the first token of a fresh prompt (its own ``seed``: no prefix-cache hit)."""
    [prompt] = prompts_of(1, length, vocab, seed=seed)
    sync(dev)
    t = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    seconds = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return seconds


def prefill_run(engine: Engine, length: int, shape: dict[str, Any], dev: torch.device, peak: float
                ) -> dict[str, Any]:
    ttft(engine, length, shape["vocab_size"], dev, seed=100 * length)  # warm-up at this shape
    s = spread([ttft(engine, length, shape["vocab_size"], dev, seed=100 * length + k) for k in range(1, 4)])
    flops = prefill_flops(shape, length)
    r = {"prompt_tokens": length, "max_batch_tokens": engine.config.max_batch_tokens, "ttft_ms": 1000 * s["median"],
         "spread": s["spread"], "model_flops": flops, "TFLOPs": flops / s["median"] / 1e12,
         "fraction_of_datasheet_peak": flops / s["median"] / DENSE_BF16_PEAK,
         "fraction_of_measured_matmul": flops / s["median"] / peak}
    progress(f"prefill {length} (chunks of {engine.config.max_batch_tokens}): TTFT {r['ttft_ms']:.1f} ms = "
             f"{r['TFLOPs']:.0f} TFLOP/s ({100 * r['fraction_of_datasheet_peak']:.0f}% of the datasheet peak)")
    return r


def prefill_flops(shape: dict[str, Any], length: int) -> float:
    weights, _ = weight_bytes(shape, 1)
    lm_head = shape["vocab_size"] * shape["hidden_size"]
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    attention = 2 * shape["num_hidden_layers"] * length * length * shape["num_attention_heads"] * hd
    return 2 * (weights - lm_head) * length + 2 * lm_head + attention  # the LM head runs on the last row only


def hf_peer(shape: dict[str, Any], batches: tuple[int, ...], steps: int, dev: torch.device) -> dict[str, Any]:
    """HF transformers, StaticCache + a compiled one-token step, random bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    try:
        with torch.device(dev):
            hf = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    out: dict[str, Any] = {"what": "transformers LlamaForCausalLM, StaticCache, torch.compile(mode='reduce-overhead') "
                                   "one-token step", "batches": []}
    for batch in batches:
        cache = StaticCache(config=hf.config, max_cache_len=PROMPT_LEN + steps + 8)
        ids = torch.tensor(prompts_of(batch, PROMPT_LEN, shape["vocab_size"]), device=dev)
        with torch.no_grad():
            logits = hf(input_ids=ids, past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(PROMPT_LEN, device=dev)).logits[:, -1]
        tok = logits.argmax(-1)[:, None]

        def one(tok: torch.Tensor, pos: torch.Tensor, model: Any = hf, kv: Any = cache) -> torch.Tensor:
            return model(input_ids=tok, past_key_values=kv, use_cache=True, cache_position=pos).logits[:, -1]

        step = torch.compile(one, mode="reduce-overhead" if dev.type == "cuda" else None, fullgraph=False)
        pos = torch.tensor([PROMPT_LEN], device=dev)
        times = []
        with torch.no_grad():
            for i in range(steps + 3):
                if dev.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                sync(dev)
                t = time.perf_counter()
                logits = step(tok, pos)
                tok = logits.argmax(-1)[:, None].clone()
                int(tok[0, 0])  # a user reads the token: synchronise
                if i >= 3:
                    times.append(time.perf_counter() - t)
                pos = pos + 1
        s = spread(times)
        out["batches"].append({"batch": batch, "ms_per_step": 1000 * s["median"], "spread": s["spread"],
                               "tok_per_s": batch / s["median"]})
        progress(f"HF peer batch {batch}: {1000 * s['median']:.2f} ms/step = {batch / s['median']:.0f} tok/s")
        torch.compiler.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def token_check(path: Path, device: str, steps: int, vocab: int) -> dict[str, Any]:
    """Greedy tokens of the default (fast) set vs the reference set, same random weights, batch 1, with each
    step's two best log-probabilities (the engine's raw ``logprobs``): over the common prefix the two sets see
    the same context, so the largest difference of their top-1 log-probability is the fast set's numerical
    distance; at the first divergence each run's margin between its best two tokens says whether it was a
    near-tie (random weights give many) or a real disagreement."""
    [prompt] = prompts_of(1, PROMPT_LEN, vocab, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=2)
    runs, tops = {}, {}
    for name, cfg in (("fast", {}), ("reference", {"kernels": "reference", "cuda_graphs": False})):
        e = engine_for(path, device, max_num_seqs=4, **cfg)
        [c] = e.generate([prompt], params)
        runs[name] = c.token_ids
        tops[name] = [lp.top for lp in c.logprobs]
        del e
        if device == "cuda":
            torch.cuda.empty_cache()
    same = next((i for i, (a, b) in enumerate(zip(runs["fast"], runs["reference"])) if a != b), steps)
    prefix = range(min(same + 1, len(tops["fast"]), len(tops["reference"])))  # the divergence step too
    out: dict[str, Any] = {
        "steps": steps, "first_divergence": same, "identical": runs["fast"] == runs["reference"],
        "fast": runs["fast"][:16], "reference": runs["reference"][:16],
        "max_abs_top1_logprob_diff_over_common_prefix": max(
            (abs(tops["fast"][i][0][1] - tops["reference"][i][0][1]) for i in prefix), default=0.0)}
    if same < steps:
        out["at_divergence"] = {name: {"top2": [list(t) for t in tops[name][same]],
                                       "margin": tops[name][same][0][1] - tops[name][same][1][1]}
                                for name in ("fast", "reference")}
    return out


def probe_tiles(path: str) -> None:
    """Points ``linear_triton.decode_gemm_tile`` at a probe record's best tiles (shapes it did not sweep keep
    the engine's)."""
    import ast

    import fusedserve.models.layers.linear_triton as linear_triton
    from bench.pdl_gemv_probe import SHAPES

    sweeps = json.loads(Path(path).read_text())["dot_sweep"]
    shapes = {name: (n, k) for name, n, k in SHAPES}
    table = {(int(rows), *shapes[name]): ast.literal_eval(r["best"]) for rows, sweep in sweeps.items()
             for name, r in sweep.items()}
    engine_tile = linear_triton.decode_gemm_tile

    def tile(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
        swept = [r for r, _, _ in table if r >= m]  # the smallest swept row count covering m
        found = table.get((min(swept), n, k)) if swept and m > 1 else None
        return found or engine_tile(m, n, k)

    linear_triton.decode_gemm_tile = tile  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--check-only", action="store_true",
                    help="only the fast-vs-reference greedy check (item 7), no timing")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--peer-batches", default="1,16,64", help="HF peer batch sizes (each compiles once)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=128,
                    help="prompt tokens of each decoding sequence (the context the decode rows attend over)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of decode steps")
    ap.add_argument("--tiny", action="store_true", help="small model (CPU if no GPU): checks the script")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode rows (no prefill, read-back engine, token check or peer; no profile unless "
                         "--profile-batches)")
    ap.add_argument("--profile-batches", default=None,
                    help="batch sizes whose decode step is profiled (kernels by kind; default 1,64, none with "
                         "--decode-only); with FUSEDSERVE_PDL=0 each kernel's time is its own (with PDL a kernel's "
                         "span includes its wait for the one before)")
    ap.add_argument("--cublas-matmuls", action="store_true",
                    help="the fast set's decode matmuls (<= 64 rows) through cuBLAS instead of its GEMV / decode GEMM "
                         "(the qkv and gate/up ones too only with --separate-epilogues) "
                         "(an A/B of the kernels; FUSEDSERVE_PDL=0 in the environment is the A/B of programmatic "
                         "dependent launch)")
    ap.add_argument("--torch-argmax", action="store_true",
                    help="greedy sampling through torch.argmax instead of the fast set's argmax_triton (an A/B)")
    ap.add_argument("--separate-combine", action="store_true",
                    help="split decode attention combined by _combine_kernel after the launch, not by each tile's "
                         "last split program (an A/B of decode_attention_triton.FUSED_COMBINE)")
    ap.add_argument("--no-split-k", action="store_true",
                    help="the decode GEMM never splits K (an A/B of linear_triton.decode_gemm_splits)")
    ap.add_argument("--gemm-tiles", default="",
                    help="a bench/pdl_gemv_probe.py record: the decode GEMM at each of its shapes' best tile (rows <= 16: "
                         "its 16-row sweep, more: its 64-row one) instead of decode_gemm_tile's (an A/B of the tiles)")
    ap.add_argument("--separate-epilogues", action="store_true",
                    help="RoPE and SiLU-and-mul as their own kernels after the qkv / gate-up matmuls, not in the decode "
                         "GEMM's epilogue (an A/B of Kernels.qkv_rope / gate_up_act)")
    ap.add_argument("--drop", default="",
                    help="comma list of bench.common.DROPPABLE (rope, silu, norm, attention, ...): the fast set's kernel "
                         "of that kind left out of every "
                         "step (wrong numbers; timing only: what the kind costs inside a captured step, the most that "
                         "fusing it away can save; rope and silu only where they run as their own kernels: one row, or "
                         "with --separate-epilogues)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant under fusedserve. first (an A/B), e.g. "
                         "models.layers.linear_triton.GEMV_EPILOGUES=True")
    args = ap.parse_args()
    settings = apply_settings(args.set)
    global PROMPT_LEN
    PROMPT_LEN = args.prompt_len
    if args.gemm_tiles:  # before any engine is built: gemm_triton looks the tile up at each call
        probe_tiles(args.gemm_tiles)
    if args.cublas_matmuls:  # before any engine is built: Kernels.triton() reads it then
        import torch.nn.functional as F

        import fusedserve.models.layers.linear_triton as linear_triton
        linear_triton.decode_linear = F.linear  # type: ignore[assignment]
    if args.torch_argmax:  # before any engine is built: Kernels.triton() imports it then
        import fusedserve.models.layers.argmax_triton as argmax_module
        argmax_module.argmax_triton = lambda logits: logits.float().argmax(dim=-1)  # type: ignore[assignment]
    if args.separate_combine:
        import fusedserve.models.layers.decode_attention_triton as decode_attention
        decode_attention.FUSED_COMBINE = False
    if args.no_split_k:
        import fusedserve.models.layers.linear_triton as linear_triton
        linear_triton.SPLIT_K_MAX = 1
    if args.separate_epilogues:  # before any engine is built: Kernels.triton() imports them then
        import fusedserve.models.layers.linear_triton as linear_triton
        linear_triton.decode_qkv_rope = None  # type: ignore[assignment]
        linear_triton.decode_gate_up_silu = None  # type: ignore[assignment]
    dropped = drop_kernels(args.drop)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else LLAMA3_8B
    batches = tuple(int(b) for b in args.batches.split(","))
    record: dict[str, Any] = {**record_header(), "model_shape": shape, "dtype": "bfloat16" if cuda else "float32",
                              "prompt_len": PROMPT_LEN, "decode_matmuls": "cublas" if args.cublas_matmuls else "gemv+gemm",
                              "split_k": not args.no_split_k, "attention_combine": "kernel" if args.separate_combine else "last split", "argmax": "torch" if args.torch_argmax else "triton",
                              "gemm_tiles": args.gemm_tiles or "decode_gemm_tile",
                              "pdl": pdl_enabled(), "dropped_kernels": dropped, "settings": settings,
                              "matmul_epilogues": "separate kernels" if args.separate_epilogues else "rope, silu"}
    bw = copy_bandwidth(dev, (4 << 30) if cuda and not args.tiny else (64 << 20))
    peak = matmul_peak(dev, 8192 if cuda and not args.tiny else 512)
    record["ceilings"] = {"copy_bandwidth_TBps": bw / 1e12, "matmul_bf16_TFLOPs": peak / 1e12,
                          "datasheet_dense_bf16_TFLOPs": DENSE_BF16_PEAK / 1e12}
    progress(f"copy bandwidth {bw / 1e12:.3f} TB/s, matmul {peak / 1e12:.0f} TFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(shape, Path(tmp))
        if args.check_only:
            record["greedy_fast_vs_reference"] = token_check(path, device, args.check_tokens, shape["vocab_size"])
            progress(f"fast vs reference greedy: {record['greedy_fast_vs_reference']}")
            out = args.out or f"bench/results/{record['date']}-decode-token-check-{'h200' if cuda else 'cpu'}.json"
            progress(f"wrote {write_record(record, out)}")
            return
        t = time.perf_counter()
        engine = engine_for(path, device)
        record["engine"] = {"build_s": time.perf_counter() - t, "kernels": engine.executor.kernels.name
                            if engine.executor.kernels else None, "graphs": engine.executor.graphs is not None,
                            "kv_blocks": engine.blocks.num_blocks, "max_model_len": engine.max_model_len}
        progress(f"engine ready in {record['engine']['build_s']:.1f}s: {record['engine']}")
        weights, row = weight_bytes(shape)
        per_token_kv = kv_bytes_per_token(shape)
        rows = []
        for batch in batches:
            r = decode_run(engine, batch, args.steps, shape["vocab_size"], dev)
            streamed = weights + batch * row + batch * r["context_at_midpoint"] * per_token_kv
            r["bytes_per_step"] = streamed
            r["roofline_ms"] = 1000 * streamed / bw
            r["fraction_of_roofline"] = r["roofline_ms"] / r["ms_per_step"]
            rows.append(r)
            progress(f"batch {batch}: {r['ms_per_step']:.2f} ms/step ({r['tok_per_s']:.0f} tok/s), roofline "
                     f"{r['roofline_ms']:.2f} ms = {100 * r['fraction_of_roofline']:.1f}%, spread {r['spread']:.2f}")
        record["decode"] = rows
        profiled = args.profile_batches if args.profile_batches is not None else ("" if args.decode_only else "1,64")
        for batch in (int(b) for b in profiled.split(",") if b and cuda):  # which kernels a step runs, by kind
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            pending = {engine.add_request(p, params) for p in prompts_of(batch, PROMPT_LEN, shape["vocab_size"])}
            while pending:
                pending -= {o.request_id for o in engine.step() if o.new_token_ids}
            for _ in range(4):
                engine.step()
            record[f"profile_batch{batch}_step"] = profile(engine.step, dev, reps=5)
            progress(f"profile, batch {batch}: {json.dumps(record[f'profile_batch{batch}_step']['by_kind_us'])}")
            while engine.has_unfinished():
                engine.step()
        if args.decode_only:
            record["decode_only"] = True
            out = args.out or f"bench/results/{record['date']}-decode-rows-{'h200' if cuda else 'cpu'}.json"
            progress(f"wrote {write_record(record, out)}")
            return
        if args.host_profile:
            record["host_profile"] = {b: host_profile(engine, b, 30, shape["vocab_size"]) for b in (1, 64)}
            for b, lines in record["host_profile"].items():
                progress(f"host profile, batch {b}:\n" + "\n".join(lines[:30]))
        lengths = (1024, 8191) if not args.tiny else (256, 1023)  # 8191 + 1 sampled = max_position_embeddings
        prefill = [prefill_run(engine, n, shape, dev, peak) for n in lengths]  # chunked at max_batch_tokens
        del engine
        if cuda:
            torch.cuda.empty_cache()
        one_chunk = engine_for(path, device, max_batch_tokens=max(lengths))
        prefill += [prefill_run(one_chunk, n, shape, dev, peak) for n in lengths]
        del one_chunk
        record["prefill"] = prefill
        if cuda:
            torch.cuda.empty_cache()
        # The same decode with every step's tokens read back before the next is planned: what overlapping gains.
        serial = engine_for(path, device, overlap_scheduling=False)
        record["decode_without_overlap"] = [decode_run(serial, b, args.steps, shape["vocab_size"], dev)
                                            for b in batches if b in (1, 16, 64)]
        del serial
        for r in record["decode_without_overlap"]:
            progress(f"without overlap, batch {r['batch']}: {r['ms_per_step']:.2f} ms/step ({r['tok_per_s']:.0f} tok/s)")
        if cuda:
            torch.cuda.empty_cache()
        record["greedy_fast_vs_reference"] = token_check(path, device, args.check_tokens, shape["vocab_size"])
        progress(f"fast vs reference greedy: {record['greedy_fast_vs_reference']}")
    if not args.no_peer:
        peer_batches = tuple(int(b) for b in args.peer_batches.split(",") if int(b) in batches)
        record["hf_peer"] = hf_peer(shape, peer_batches, min(args.steps, 32), dev)
        peer = {r["batch"]: r for r in record["hf_peer"]["batches"]}
        record["speedup_vs_peer"] = {r["batch"]: peer[r["batch"]]["ms_per_step"] / r["ms_per_step"] for r in rows
                                     if r["batch"] in peer}
        progress(f"speed-up over the HF peer by batch: {record['speedup_vs_peer']}")
    out = args.out or f"bench/results/{record['date']}-decode-engine-{'h200' if cuda else 'cpu'}.json"
    progress(f"wrote {write_record(record, out)}")
    print(json.dumps({"decode": [{k: r[k] for k in ('batch', 'ms_per_step', 'tok_per_s', 'fraction_of_roofline')}
                                 for r in rows], "prefill": prefill,
                      "speedup_vs_peer": record.get("speedup_vs_peer")}, indent=1))


if __name__ == "__main__":
    main()
