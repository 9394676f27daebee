"""Issue #9 at tp=2 (the 8-GPU machine was not lent): DP attention + EP, one reduce-scatter vs
all-reduce + own chunk, and a `fusedserve verify` matrix on GPU.

    . bench/device_env.sh && python3 -P bench/dp_ep_combine.py --out $OUT/dp-ep-combine.json
    python bench/dp_ep_combine.py --tiny --out /tmp/dp-ep-combine-tiny.json   # CPU ranks (gloo): checks the script

(a) verify: what `fusedserve verify --tp 2 --dp D --ep E --fusion F --dtype bfloat16 --oracle tp1`
    does (worker/verify.py's own rank function, the tp=1 oracle on the CPU, the same logit and
    collective comparison), for a DeepSeek-V3-shaped and a Nemotron-H-shaped slice (a few
    layers, reduced width, random HF checkpoints from fusedserve.tiny), dp in {1, 2}, ep in
    {1, 2}, fusion off / flashinfer (fusion only without DP attention). All configs run in one
    pair of rank processes (new process groups per config) to save device time.
(b) decode step at tp=2, dp=2 (attention data-parallel, attn_tp=1), ep=2 on the DeepSeek-V3-shaped
    slice of bench/deepseek_slice.py (hidden 7168, MLA 128 heads, 256 experts top-8, --layers
    full-width MoE layers, random bf16 weights, Triton kernels), batch 1..256 tokens per DP rank
    (balanced, so MAX_LEN padding: the MoE sees 2 x batch rows), 128 cached tokens per sequence.
    Two plans over the SAME model and weights: the default (each MoE sum completed by ONE
    reduce-scatter over tp) and the benchmark-only ``plan_communication(dp_combine="all_reduce")``
    (all-reduce of the whole FULL sum, then this rank's chunk as a view). Each (plan, batch) is
    captured as a CUDA graph; replays are interleaved between the plans. Reported: ms/step, the
    ratio, per-step collective calls and bytes from the ledger (the records made while capturing,
    as worker/cuda_graph_runner.py replays them) by op/group/path, planned == executed, and the
    logits of the two plans compared.

The CUDA-graph runner (worker/cuda_graph_runner.py) does not yet capture DP-attention forwards
(no dp_num_tokens; the valid-rows mask is made with a host copy), so (b) captures its own graphs
with a communicator subclass that keeps that mask as a device tensor made before capture.
Progress lines go to stderr; the JSON record to --out (written after each part).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.*; fusedserve stays the installed one

from bench.deepseek_slice import DEEPSEEK_V3, TINY

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TINY_BATCH_SIZES = (1, 4, 16)
BLOCK = 16
CONTEXT = 128  # cached tokens before the decoded one
COMBINES = ("reduce_scatter", "all_reduce")
_T0 = time.perf_counter()

# (a) the slices verify runs (reduced width; fusedserve.tiny overrides)
DS_VERIFY: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256,
    "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384,
    "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 32, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rope_interleave": True,
    "rope_parameters": {**DEEPSEEK_V3["rope_parameters"], "original_max_position_embeddings": 256, "factor": 16.0},
}
NH_VERIFY: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 1024, "hybrid_override_pattern": "MEM*EM-E", "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048, "mamba_num_heads": 32,
    "mamba_head_dim": 64, "n_groups": 4, "ssm_state_size": 64, "conv_kernel": 4, "chunk_size": 16,
    "n_routed_experts": 32, "num_experts_per_tok": 6, "moe_intermediate_size": 256,
    "moe_shared_expert_intermediate_size": 512, "moe_latent_size": None, "n_group": 4, "topk_group": 2,
}
VERIFY_CONFIGS = [(1, 1, "off"), (1, 1, "flashinfer"), (1, 2, "off"), (1, 2, "flashinfer"), (2, 1, "off"),
                  (2, 2, "off")]  # (dp, ep, fusion) at tp=2
# bf16 as the issue asks, compared at verify's default bf16 tolerance (0.1); fp32 as the strict
# check (1e-4): at these widths bf16 rounding alone (the tp=1 oracle's too) moves logits by more
# than 0.1 on long prompts, where a few routing choices flip (measured on CPU: fp32 diffs ~1e-6).
VERIFY_DTYPES = ("bfloat16", "float32")


def progress(msg: str) -> None:
    print(f"[dp_ep_combine {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --- (a) verify --------------------------------------------------------------------------------

def _verify_rank(rank: int, world: int, backend: str, jobs: list[tuple[str, Any]],
                 prompts: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    from fusedserve.verify import _rank_main

    torch.backends.cudnn.allow_tf32 = False  # fp32 rows compare at 1e-4 (matmuls are fp32 by default)
    out = []
    for key, opts in jobs:
        t = time.perf_counter()
        try:
            res = _rank_main(rank, world, backend, opts, prompts[opts.model])
            res["error"] = None
        except Exception as e:  # noqa: BLE001 (recorded per config; the same code fails alike on both ranks)
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        res["seconds"] = time.perf_counter() - t
        if rank == 0:
            progress(f"verify {key}: {'error ' + res['error'] if res['error'] else 'ran'} in {res['seconds']:.1f}s")
        out.append(res)
    return out


def run_verify_matrix(tiny: bool, backend: str) -> list[dict[str, Any]]:
    from fusedserve.tiny import make_tiny_deepseek_v3, make_tiny_nemotron_h
    from fusedserve.worker.parallel.local_ranks import run_on_ranks
    from fusedserve.verify import (
        VerifyOptions,
        _assemble_logits,
        _oracle_logits,
        default_prompts,
        ranks_collectives,
    )

    tmp = Path(tempfile.mkdtemp(prefix="dp-ep-verify-"))
    fusion_on = "reference" if tiny else "flashinfer"
    models = {"deepseek_v3": str(make_tiny_deepseek_v3(tmp / "ds", **({} if tiny else DS_VERIFY))),
              "nemotron_h": str(make_tiny_nemotron_h(tmp / "nh", **({} if tiny else NH_VERIFY)))}
    progress(f"checkpoints made in {tmp}")
    prompts, oracles, jobs = {}, {}, []
    for arch, path in models.items():
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        prompts[path] = default_prompts(vocab)
        for dtype in VERIFY_DTYPES:
            oracles[(path, dtype)] = _oracle_logits(VerifyOptions(model=path, oracle="tp1", dtype=dtype), prompts[path])
            for dp, ep, fusion in VERIFY_CONFIGS:
                # FlashInfer's fused kernel runs the bf16 rows; fp32 rows with fusion take the reference
                # fused path (the same plan, no risk of a kernel without an fp32 variant)
                on = fusion_on if dtype == "bfloat16" else "reference"
                opts = VerifyOptions(model=path, tp=2, dp=dp, ep=ep, fusion=on if fusion != "off" else "off",
                                     oracle="tp1", dtype=dtype)
                jobs.append((f"{arch} tp=2 dp={dp} ep={ep} fusion={opts.fusion} {dtype}", opts))
    progress("tp=1 oracles computed (CPU); spawning 2 ranks for the verify matrix")
    per_rank = run_on_ranks(_verify_rank, 2, jobs, prompts, backend=backend, timeout_s=300)
    rows = []
    for i, (key, opts) in enumerate(jobs):
        results = [r[i] for r in per_rank]
        arch = key.split()[0]
        row: dict[str, Any] = {"arch": arch, "tp": 2, "dp": opts.dp, "ep": opts.ep, "fusion": opts.fusion,
                               "dtype": opts.dtype, "oracle": "tp1", "seconds": round(results[0]["seconds"], 2)}
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            row.update(ok=False, error=errors[0], trace=results[0].get("trace") or results[1].get("trace"))
            rows.append(row)
            continue
        ours = _assemble_logits(results, prompts[opts.model], opts.dp)
        oracle = oracles[(opts.model, opts.dtype)]
        max_diff = float((ours - oracle).abs().max())
        planned = results[0]["planned"]
        coll_ok, _sites, mismatches, paths = ranks_collectives(results)
        row.update(ok=max_diff <= opts.atol and coll_ok, max_abs_diff=max_diff, tolerance=opts.atol,
                   logits_ok=max_diff <= opts.atol, planned_equals_executed=coll_ok,
                   planned_per_forward=len(planned), executed_per_forward=[len(r["executed"]) for r in results],
                   planned_ops=[f"{s}: {op}({g})" for s, op, g in planned], mismatches=mismatches, paths=paths,
                   argmax_agreement=float((ours.argmax(-1) == oracle.argmax(-1)).float().mean()),
                   tokens=int(ours.shape[0]))
        rows.append(row)
    return rows


# --- (b) decode-step benchmark -------------------------------------------------------------------

def _capturable_communicator() -> Any:
    from fusedserve.models.parallel.communicator import Communicator

    class CapturableCommunicator(Communicator):
        """Benchmark-only: ``begin_forward`` as the base class's, except that while a CUDA graph is
        being captured it reuses the geometry, valid-rows mask (a device tensor) and plan variant
        computed by an eager forward of the same shape (the base class makes the mask with a host
        copy, which a capture cannot record)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._seen: dict[Any, Any] = {}

        def begin_forward(self, num_tokens: int, dp_num_tokens: list[int] | None = None,
                          padding: Any = None) -> Any:
            key = (num_tokens, tuple(dp_num_tokens or ()), padding or self.force_padding)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self.geometry, self.valid_rows, self.active = self._seen[key]
                self.collectives.ledger.begin_forward()
                self.captured = []
                return self.active
            plan = super().begin_forward(num_tokens, dp_num_tokens, padding)
            self._seen[key] = (self.geometry, self.valid_rows, self.active)
            return plan

    return CapturableCommunicator


def _summarize(records: list[Any], world: int) -> dict[str, Any]:
    """Per-step calls and bytes by op/group/path, and ring wire bytes each rank sends."""
    by: dict[str, dict[str, int]] = {}
    wire = 0.0
    for r in records:
        k = f"{r.op}/{r.group}/{r.path}"
        e = by.setdefault(k, {"calls": 0, "bytes": 0})
        e["calls"] += 1
        e["bytes"] += r.nbytes
        # ledger bytes: all_reduce/reduce_scatter = input, all_gather = output; ring traffic per rank:
        # RS, AG: (n-1)/n of that; AR: 2 (n-1)/n
        wire += r.nbytes * (world - 1) / world * (2 if r.op == "all_reduce" else 1)
    return {"by_op_group_path": by, "calls": len(records), "ledger_bytes": sum(r.nbytes for r in records),
            "ring_wire_bytes_sent_per_rank": int(wire)}


def _bench_rank(rank: int, world: int, backend: str, opts: dict[str, Any]) -> dict[str, Any]:
    from transformers import DeepseekV3Config

    from fusedserve.models.forward_batch import ForwardBatch, KVCache, PagedAttentionMetadata
    from fusedserve.models.layers.kernels import Kernels
    from fusedserve.models.parallel.collectives import Collectives
    from fusedserve.models.parallel.comm_plan import plan_communication
    from fusedserve.models.parallel.groups import ParallelConfig, build_groups
    from fusedserve.models.parallel.ledger import CollectiveLedger
    from fusedserve.models.random_init import random_model

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tiny = opts["tiny"]
    batch_sizes = TINY_BATCH_SIZES if tiny else BATCH_SIZES
    shape = {**(TINY if tiny else DEEPSEEK_V3), "num_hidden_layers": opts["layers"]}
    cfg = ParallelConfig(tp=2, dp=2, ep=2)
    config = DeepseekV3Config(**shape, architectures=["DeepseekV3ForCausalLM"])
    groups = build_groups(cfg, rank, backend)
    collectives = Collectives(backend)  # no fused all-reduce under DP attention
    kernels = Kernels.triton() if cuda else Kernels.torch_native()
    t = time.perf_counter()
    model = random_model(config, groups, collectives, dtype=torch.bfloat16, device=device, seed=0,
                         kernels=kernels)
    out: dict[str, Any] = {"rank": rank, "dp_rank": groups.coords.dp_rank, "kernels": kernels.name,
                           "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                           "local_experts": model.layers[0].mlp.experts.num_local, "build_s": time.perf_counter() - t}
    Comm = _capturable_communicator()
    blocks = type(model).blocks(config)
    comms = {c: Comm(plan_communication(cfg, blocks, False, dp_combine=c), groups, collectives,
                     norms=model.comm.norms) for c in COMBINES}
    out["default_plan_is_reduce_scatter_plan"] = model.comm.plan == comms["reduce_scatter"].plan
    out["plan_tables"] = {c: comms[c].plan.unfused.table() for c in COMBINES}
    if rank == 0:
        progress(f"{len(model.layers)}-layer slice built: {out['weight_bytes'] / 1e9:.1f} GB on this GPU, "
                 f"{out['local_experts']} experts/layer here")
        for c in COMBINES:
            progress(f"plan {c}: " + " | ".join(out["plan_tables"][c]))

    width = -(-(CONTEXT + 1) // BLOCK)
    max_bs = max(batch_sizes)
    kv = KVCache.allocate(model.kv_shapes(), max_bs * width + 1, BLOCK, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    for cache in (*kv.k.values(), *kv.v.values()):
        cache.normal_(0.0, 1.0, generator=gen)
    pad_slot = kv.num_blocks * BLOCK - 1
    # static inputs for the largest batch; DP group d decodes its own sequences (different tokens)
    g = torch.Generator().manual_seed(100 + groups.coords.dp_rank)
    ids = torch.randint(0, shape["vocab_size"], (max_bs,), generator=g).to(device)
    tables = torch.arange(max_bs * width, dtype=torch.int32, device=device).view(max_bs, width)
    pos = torch.full((max_bs,), CONTEXT, dtype=torch.long, device=device)
    slots = tables.long()[:, CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK
    ctx = torch.full((max_bs,), CONTEXT + 1, dtype=torch.int32, device=device)

    def forward(bs: int) -> torch.Tensor:
        meta = PagedAttentionMetadata.decode(tables[:bs], ctx[:bs])
        batch = ForwardBatch(input_ids=ids[:bs], positions=pos[:bs], query_lens=[1] * bs, context_lens=[1] * bs,
                             slot_mapping=slots[:bs], block_tables=[[0]] * bs, kv_cache=kv, paged=meta)
        batch.dp_num_tokens = [bs] * cfg.dp
        logits: torch.Tensor = model(batch)
        return logits

    del pad_slot  # every row is a real sequence (balanced DP batches): no padding rows
    captured: dict[tuple[str, int], Any] = {}
    t = time.perf_counter()
    for c in COMBINES:
        model.comm = comms[c]
        for bs in batch_sizes:
            # eager forward: executed == planned in the real ledger
            collectives.ledger.begin_forward()
            eager_logits = forward(bs).float().clone()
            eager_records = collectives.ledger.forward_records()
            planned = comms[c].active.expected()
            entry: dict[str, Any] = {"plan_padding": comms[c].active.padding.value, "planned": planned,
                                     "eager_executed_equals_planned": [r.key for r in eager_records] == planned,
                                     "eager_logits": eager_logits}
            if cuda:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    forward(bs)
                torch.cuda.current_stream(device).wait_stream(stream)
                torch.cuda.synchronize(device)
                real = collectives.ledger
                collectives.ledger = CollectiveLedger()
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        logits = forward(bs)
                    records = collectives.ledger.forward_records()
                finally:
                    collectives.ledger = real
                entry.update(graph=graph, logits=logits, records=records)
            else:
                entry.update(graph=None, logits=None, records=eager_records)
            entry["captured_executed_equals_planned"] = [r.key for r in entry["records"]] == planned
            captured[(c, bs)] = entry
    model.comm = comms["reduce_scatter"]
    out["capture_s"] = time.perf_counter() - t
    if rank == 0:
        progress(f"{'captured' if cuda else 'ran'} {len(captured)} decode forwards in {out['capture_s']:.1f}s")

    def step(c: str, bs: int) -> Any:
        e = captured[(c, bs)]
        if e["graph"] is not None:
            return lambda: e["graph"].replay()
        comm = comms[c]
        return lambda: (setattr(model, "comm", comm), forward(bs))

    def timed(fn: Any, n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000 / n
        tt = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - tt) / n

    rounds, per_round = (2, 1) if tiny else (15, 5)
    rows = []
    for bs in batch_sizes:
        for c in COMBINES:
            timed(step(c, bs), 1 if tiny else 3)
        samples: dict[str, list[float]] = {c: [] for c in COMBINES}
        for _ in range(rounds):
            for c in COMBINES:  # interleaved: drift hits both plans alike
                samples[c].append(timed(step(c, bs), per_round))
        row: dict[str, Any] = {"batch_per_dp_rank": bs, "moe_rows": bs * cfg.dp}
        for c in COMBINES:
            e = captured[(c, bs)]
            row[c] = {"ms_per_step": 1000 * statistics.median(samples[c]), "ms_per_step_min": 1000 * min(samples[c]),
                      "planned_equals_executed": e["captured_executed_equals_planned"]
                      and e["eager_executed_equals_planned"],
                      "padding": e["plan_padding"], "per_step": _summarize(e["records"], world)}
        row["ratio_all_reduce_over_reduce_scatter"] = row["all_reduce"]["ms_per_step"] / row["reduce_scatter"]["ms_per_step"]
        n_comb = sum(1 for r in captured[("all_reduce", bs)]["records"] if r.op == "all_reduce" and r.group == "tp"
                     and r.site != "lm_head")
        row["tp_combines_per_step"] = n_comb
        row["us_saved_per_combine"] = 1000 * (row["all_reduce"]["ms_per_step"] - row["reduce_scatter"]["ms_per_step"]) \
            / max(n_comb, 1)
        # the two plans' logits on the same inputs (eager, and the graph outputs after one replay each)
        a, b = captured[("reduce_scatter", bs)], captured[("all_reduce", bs)]
        row["eager_logits_max_abs_diff"] = float((a["eager_logits"] - b["eager_logits"]).abs().max())
        if cuda:
            a["graph"].replay()
            la = a["logits"].float().clone()
            b["graph"].replay()
            lb = b["logits"].float().clone()
            row["graph_logits_max_abs_diff"] = float((la - lb).abs().max())
            row["graph_vs_eager_max_abs_diff"] = float((la - a["eager_logits"]).abs().max())
        rows.append(row)
        if rank == 0:
            progress(f"batch {bs:>3}/DP rank: RS {row['reduce_scatter']['ms_per_step']:.3f} ms, AR+slice "
                     f"{row['all_reduce']['ms_per_step']:.3f} ms, ratio {row['ratio_all_reduce_over_reduce_scatter']:.3f}, "
                     f"{row['us_saved_per_combine']:.1f} us/combine; logits diff {row['eager_logits_max_abs_diff']:.2e}")
    out["rows"] = rows
    return out


def run_benchmark(tiny: bool, backend: str, layers: int) -> dict[str, Any]:
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    ranks = run_on_ranks(_bench_rank, 2, {"tiny": tiny, "layers": layers}, backend=backend, timeout_s=600)
    summary = []
    for i, row in enumerate(ranks[0]["rows"]):
        other = ranks[1]["rows"][i]
        summary.append({
            "batch_per_dp_rank": row["batch_per_dp_rank"],
            "reduce_scatter_ms": row["reduce_scatter"]["ms_per_step"],
            "all_reduce_slice_ms": row["all_reduce"]["ms_per_step"],
            "ratio_ar_over_rs": row["ratio_all_reduce_over_reduce_scatter"],
            "rank1_ratio_ar_over_rs": other["ratio_all_reduce_over_reduce_scatter"],
            "us_saved_per_combine": row["us_saved_per_combine"],
            "planned_equals_executed_all_ranks": all(r[c]["planned_equals_executed"] for r in (row, other)
                                                     for c in COMBINES),
            "logits_max_abs_diff_rs_vs_ar": max(row["eager_logits_max_abs_diff"], other["eager_logits_max_abs_diff"],
                                                row.get("graph_logits_max_abs_diff", 0.0),
                                                other.get("graph_logits_max_abs_diff", 0.0)),
            "calls_per_step_rs": row["reduce_scatter"]["per_step"]["by_op_group_path"],
            "calls_per_step_ar": row["all_reduce"]["per_step"]["by_op_group_path"],
            "ring_wire_bytes_per_rank_rs": row["reduce_scatter"]["per_step"]["ring_wire_bytes_sent_per_rank"],
            "ring_wire_bytes_per_rank_ar": row["all_reduce"]["per_step"]["ring_wire_bytes_sent_per_rank"],
        })
    return {"summary": summary, "rank0": ranks[0], "rank1": ranks[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-dp-ep-combine-h200x2.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--parts", default="verify,bench")
    ap.add_argument("--tiny", action="store_true", help="tiny configs on CPU ranks (gloo): checks the script")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    backend = "nccl" if cuda else "gloo"
    record: dict[str, Any] = {
        "date": str(datetime.date.today()),
        "machine": (torch.cuda.get_device_name() + f" x{torch.cuda.device_count()}") if cuda else
        f"cpu ({os.cpu_count()} CPUs)",
        "command": " ".join(["python", *sys.argv]),
        "issue": 9,
        "note": "Issue #9 asks for tp=8, dp in {1,8}, ep in {1,8} on nvidia-h200-x8; that kind was withheld "
                "(not lent) this session, so the 8-GPU run was NOT possible: status blocked. This is the tp=2 "
                "substitute on nvidia-h200-x2: dp in {1,2}, ep in {1,2}, and the decode benchmark at tp=2, dp=2, ep=2.",
        "versions": {"torch": torch.__version__},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")

    if "verify" in args.parts:
        t = time.perf_counter()
        try:
            rows = run_verify_matrix(args.tiny, backend)
            record["verify"] = {"what": "fusedserve verify equivalent (worker/verify.py _rank_main + tp=1 oracle)",
                                "models": {"deepseek_v3": DS_VERIFY if not args.tiny else "fusedserve.tiny defaults",
                                           "nemotron_h": NH_VERIFY if not args.tiny else "fusedserve.tiny defaults"},
                                "rows": rows, "all_ok": all(r.get("ok") for r in rows),
                                "all_float32_ok": all(r.get("ok") for r in rows if r["dtype"] == "float32"),
                                "all_planned_equals_executed": all(r.get("planned_equals_executed") for r in rows),
                                "bfloat16_min_argmax_agreement": min(
                                    (r.get("argmax_agreement", 0.0) for r in rows if r["dtype"] == "bfloat16"),
                                    default=None),
                                "seconds": time.perf_counter() - t}
            for r in rows:
                progress(f"verify {r['arch']} dp={r['dp']} ep={r['ep']} fusion={r['fusion']} {r['dtype']}: "
                         + ("PASS" if r.get("ok") else "FAIL") + f" max|diff| {r.get('max_abs_diff')} "
                         f"planned==executed {r.get('planned_equals_executed')} argmax agree {r.get('argmax_agreement')} "
                         f"paths {r.get('paths')} {r.get('error') or ''}")
        except Exception as e:  # noqa: BLE001 (recorded in the JSON; the other part still runs)
            record["verify"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            progress(f"verify failed: {e}")
        save()
    if "bench" in args.parts:
        t = time.perf_counter()
        try:
            res = run_benchmark(args.tiny, backend, args.layers)
            record["benchmark"] = {
                "parallel": {"tp": 2, "dp": 2, "attn_tp": 1, "ep": 2, "experts_per_gpu": "128 of 256"},
                "model_shape": {**(TINY if args.tiny else DEEPSEEK_V3), "num_hidden_layers": args.layers},
                "layers": f"{args.layers} full-width layers, all MoE; replicated attention per DP group; full vocab per rank",
                "context": f"{CONTEXT} cached tokens per sequence (random K/V), one decoded; balanced DP batches "
                           "(MAX_LEN padding, no padding rows)",
                "mode": "CUDA graphs, one per (plan, batch), replays interleaved between plans, median of 15 x 5"
                        if not args.tiny else "eager on CPU (script check only)",
                "alternative": "plan_communication(dp_combine='all_reduce'): NCCL all-reduce of the MoE's FULL sum "
                               "(2 x batch rows x 7168 bf16), then this rank's chunk as a view (no copy)",
                **res, "seconds": time.perf_counter() - t}
        except Exception as e:  # noqa: BLE001 (recorded in the JSON; the other part still runs)
            record["benchmark"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            progress(f"benchmark failed: {e}")
        save()
    v = record.get("verify", {})
    print(json.dumps({"verify_all_ok": v.get("all_ok"), "verify_all_float32_ok": v.get("all_float32_ok"),
                      "verify_all_planned_equals_executed": v.get("all_planned_equals_executed"),
                      "bench": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                 if k in ("batch_per_dp_rank", "reduce_scatter_ms", "all_reduce_slice_ms",
                                          "ratio_ar_over_rs", "planned_equals_executed_all_ranks")}
                                for r in record.get("benchmark", {}).get("summary", [])]}, indent=1))


if __name__ == "__main__":
    main()
