"""EAGLE3 on a real pair through the product: acceptance length on MT-bench and HumanEval, and tok/s
with vs without speculation, through the engine and through the HTTP server.

    python bench/spec_decode_real.py --target DIR --draft DIR [--data-dir .whl/real/data]
        [--mtbench 80] [--humaneval 164] [--turns 2] [--max-new-tokens 256] [--temperatures 0,1]
        [--configs none,chain-3,chain-5,chain-7,tree] [--interleave] [--prefill-graphs 32,64,128]
        [--http none,chain-5] [--hf-peer 8] [--profile] [--out FILE]
    python bench/spec_decode_real.py --tiny        # CPU, the tiny pair, a few prompts: checks the script

Engine (``worker/engine/``, CUDA graphs on a GPU): batch 1, one fresh engine per (configuration,
temperature), warmed up untimed; each prompt's drafts and accepted tokens are the difference
of the engine's counters around it (``bench/acceptance_stats.py``: pooled acceptance length, per-prompt
spread, bootstrap intervals). MT-bench: first turns, and with ``--turns 2`` the second turn asked after
the configuration's own first answer. HumanEval: the problem's prompt as the user message.
tok/s = generated tokens / wall time of the prompts of a set (after a warm-up on a short prompt and each
set's first), the same run for every configuration. Configurations: chains of 3/5/7 steps, a tree of topK 4
over 5 steps verifying 8 tokens; any ``chain-N`` and ``tree-sS-kK-tT`` (S steps, topK K, T verified tokens) by
name, each also with ``+sync`` (every step and round read back before the next is launched, the rounds in
flight's reference). With other configurations, no speculation runs first and again last (``none-again``) and
the speed-ups take the faster of its two runs; with ``--interleave`` all the configurations' engines are alive at once and each
prompt runs through every one in turn (``run_engines``), and ``paired_speedup_engine`` gives each speed-up with
a bootstrap interval over the prompts — the GPU machine's speed drifts between and within runs (an H200 read the
same code 20-25 % apart minutes later, 2026-12-05), which this cancels and sequential runs do not.

HTTP (``--http``): ``fusedserve run`` on a manifest per configuration, the prompts sent one at a time with
the openai client (chat completions), each set twice: responses sent whole, then streamed (``<set>_stream``,
server-sent events); tok/s from the client's wall time, acceptance from /metrics.
``--hf-peer N``: HF transformers' ``generate`` (greedy) on the first N MT-bench prompts, tok/s — a peer
measured in the same run. The record (JSON) has date, machine, command and every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fusedserve.worker  # noqa: F401  (the installed package, before the checkout joins sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # bench.*; fusedserve stays the installed one (bench/common.py)

from bench.acceptance_stats import Counts, summary
from bench.common import Progress, apply_settings, record_header, write_record
from bench.real_prompts import DEFAULT_DIR, humaneval, mtbench

CONFIGS: dict[str, dict[str, int] | None] = {
    "none": None,
    "chain-3": {"num_steps": 3},
    "chain-5": {"num_steps": 5},
    "chain-7": {"num_steps": 7},
    "tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8},
}
progress = Progress("spec_decode_real")


SYNC = "+sync"  # a configuration's suffix: every step read back before the next is launched


def overlap_of(name: str) -> bool | None:
    """The engine's ``overlap_scheduling`` for a configuration: False with the ``+sync`` suffix (plain steps and
    speculative rounds read back one by one), else the default (on a GPU: steps and greedy chain rounds in
    flight)."""
    return False if name.endswith(SYNC) else None


def config_of(name: str) -> dict[str, int] | None:
    """A configuration by name: one of ``CONFIGS``, ``chain-N``, or ``tree-sS-kK-tT`` (S steps, topK K, T
    verified tokens), each also with the ``+sync`` suffix (``overlap_of``). KeyError for anything else."""
    name = name.removesuffix(SYNC)
    if name in CONFIGS:
        return CONFIGS[name]
    parts = name.split("-")
    if parts[0] == "chain" and len(parts) == 2 and parts[1].isdigit():
        return {"num_steps": int(parts[1])}
    if parts[0] == "tree" and len(parts) == 4 and [p[0] for p in parts[1:]] == ["s", "k", "t"] \
            and all(p[1:].isdigit() for p in parts[1:]):
        return {"num_steps": int(parts[1][1:]), "topk": int(parts[2][1:]), "num_draft_tokens": int(parts[3][1:])}
    raise KeyError(name)


def free_port() -> int:
    """A loopback port free now, for the server this bench starts (``fusedserve run --port``)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spec_config(draft: str, name: str) -> Any:
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    cfg = config_of(name)
    return None if cfg is None else SpeculativeConfig(draft, **cfg)


def prompt_sets(args: argparse.Namespace) -> dict[str, list[tuple[str, list[str]]]]:
    """name -> [(prompt id, user turns)]."""
    sets: dict[str, list[tuple[str, list[str]]]] = {}
    if args.mtbench:
        rows = mtbench(args.data_dir, args.mtbench)
        sets["mtbench"] = [(f"mt{q}", turns[: args.turns]) for q, _cat, turns in rows]
    if args.humaneval:
        sets["humaneval"] = [(tid, [p]) for tid, p in humaneval(args.data_dir, args.humaneval)]
    return sets


def run_engines(args: argparse.Namespace, names: list[str], temperature: float,
                sets: dict[str, list[tuple[str, list[str]]]]) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each of ``names`` on its own engine, all built (and warmed up) before the first timed prompt; then
    prompt after prompt, each through every engine in turn (the order rotated by one each prompt) before
    the next. So a drift of the machine's speed during the run — on an H200 on 2026-12-05 whole runs of the
    same code read 20 % apart and one run shifted mid-way — weighs on every configuration alike, and their
    ratios (``paired_speedups``) hold where their tok/s do not. One name: that engine alone.
    -> name: (per set: per turn numbers, the profile with --profile)"""
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.engine.engine import Engine
    from fusedserve.worker.engine.sequence import SamplingParams

    cuda = args.device == "cuda"
    engines = {name: Engine(args.target, EngineConfig(
        device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=1, num_blocks=args.num_blocks,
        speculative=spec_config(args.draft, name), seed=0, kv_memory_fraction=0.2,
        prefill_graph_tokens=args.prefill_graphs, overlap_scheduling=overlap_of(name))) for name in names}
    tok = next(iter(engines.values())).tokenizer
    assert tok is not None

    def generate(name: str, messages: list[dict[str, str]], seed: int) -> tuple[list[int], float, Counts]:
        engine = engines[name]
        params = SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, seed=seed)
        before = engine.stats().spec
        t = time.perf_counter()
        [c] = engine.generate([tok.encode_chat(messages)], params)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        after = engine.stats().spec
        counts = (after.drafts - before.drafts, after.accepted_tokens - before.accepted_tokens) if after and before else (0, 0)
        return c.token_ids, seconds, counts

    # warm-up, untimed: a short prompt and each set's first (prompt lengths the short one does not cover). On a
    # fresh H200 machine the first configuration still ran slow after it (2026-12-04; cause not established),
    # hence plain decoding measured again last (main) where the configurations run one after another
    profiles: dict[str, dict[str, Any] | None] = {}
    for name in names:
        for text in ["Hello!"] + [prompts[0][1][0] for prompts in sets.values() if prompts]:
            generate(name, [{"role": "user", "content": text}], 0)
        profiles[name] = None
        if args.profile:
            first = next(iter(sets.values()))[0][1][0]
            prof = profile_generate(lambda n=name: generate(n, [{"role": "user", "content": first}], 7), cuda)
            progress(f"engine {name:8s} T={temperature:g} profile: {json.dumps(prof['summary'])}")
            profiles[name] = prof
    out: dict[str, dict[str, Any]] = {name: {} for name in names}
    for set_name, prompts in sets.items():
        turns_out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for turn in range(max(len(t) for _, t in prompts)):
            rows: dict[str, list[Counts]] = {name: [] for name in names}
            per_prompt: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for i, (pid, user_turns) in enumerate(prompts):
                if turn >= len(user_turns):
                    continue
                for name in names[i % len(names):] + names[:i % len(names)]:
                    history = per_prompt_history(turns_out[name], pid, user_turns, turn, tok)
                    ids, secs, counts = generate(name, history, 1000 * i + turn)
                    rows[name].append(counts)
                    per_prompt[name].append({"id": pid, "tokens": len(ids), "seconds": round(secs, 4),
                                             "drafts": counts[0], "accepted": counts[1], "text_ids": ids})
            for name in names:
                tokens = sum(p["tokens"] for p in per_prompt[name])
                seconds = sum(p["seconds"] for p in per_prompt[name])
                rounds = sum(r[0] for r in rows[name])  # verify steps (batch 1: one a step)
                turns_out[name].append({
                    "turn": turn + 1, "tokens": tokens, "seconds": round(seconds, 3),
                    "tok_per_s": round(tokens / seconds, 2) if seconds else None,
                    # wall time (prefill included) per generated token, and per verify round
                    "ms_per_token": round(1000 * seconds / tokens, 4) if tokens else None,
                    "ms_per_round": round(1000 * seconds / rounds, 4) if rounds else None,
                    "acceptance": summary(rows[name]) if name != "none" else None, "per_prompt": per_prompt[name]})
                progress(f"engine {name:8s} T={temperature:g} {set_name} turn {turn + 1}: {tokens} tokens, "
                         f"{tokens / max(seconds, 1e-9):.1f} tok/s"
                         + (f", acceptance length {turns_out[name][-1]['acceptance']['acceptance_length']:.3f}, "
                            f"{turns_out[name][-1]['ms_per_round']} ms a round" if name != "none" else ""))
        for name in names:
            out[name][set_name] = turns_out[name]
    return {name: (out[name], profiles[name]) for name in names}


def profile_generate(run: Any, cuda: bool) -> dict[str, Any]:
    """One generate call profiled twice: the device's kernel time against the wall time (torch.profiler;
    the rest is the host's, GPU idle), and the host's Python by function (cProfile, fusedserve code only,
    the top 25 by own time, and the top torch / builtin calls, where a read-back's wait shows; cProfile slows
    the host about 2x, so read its shares, not its seconds), and the host's time in CUDA runtime calls."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        ids, seconds, counts = run()
    kernel_us = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in prof.key_averages()
                    if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type))
    top_kernels = sorted(((float(getattr(e, "self_device_time_total", 0.0) or 0.0), e.count, e.key[:90])
                          for e in prof.key_averages()), reverse=True)[:12]
    # the host's time in the CUDA runtime (graph launches, kernel launches, copies, waits for the device)
    runtime = sorted(((float(e.self_cpu_time_total), e.count, e.key[:60]) for e in prof.key_averages()
                      if e.key.startswith("cuda")), reverse=True)[:10]
    host = cProfile.Profile()
    host.enable()
    _, seconds2, _ = run()
    host.disable()
    stats = pstats.Stats(host)
    rows = []
    for (file, line, fn), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "fusedserve" in file or "/worker/" in file or "/models/" in file:
            rows.append({"fn": f"{Path(file).name}:{line}:{fn}", "calls": calls, "own_s": round(tottime, 4),
                         "cum_s": round(cumtime, 4)})
    rows.sort(key=lambda r: -r["own_s"])
    syncs: dict[str, int] = {}
    if cuda:  # a third run: where the host waits for the device (torch's sync debug mode names the line)
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{Path(w.filename).name}:{w.lineno}"
                syncs[where] = syncs.get(where, 0) + 1
    builtins = sorted(({"fn": fn[:80], "calls": calls, "own_s": round(tottime, 4)}
                       for (file, _line, fn), (_cc, calls, tottime, _cum, _callers) in stats.stats.items()  # type: ignore[attr-defined]
                       if file == "~"), key=lambda r: -r["own_s"])[:15]
    return {"summary": {"tokens": len(ids), "wall_ms": round(1000 * seconds, 2),
                        "kernel_ms": round(kernel_us / 1000, 2),
                        "kernel_share": round(kernel_us / 1000 / max(1000 * seconds, 1e-9), 3),
                        "drafts_accepted": list(counts), "ms_per_token": round(1000 * seconds / max(len(ids), 1), 3),
                        "cprofile_wall_ms": round(1000 * seconds2, 2)},
            "top_kernels_us": [{"us": round(us, 1), "calls": n, "name": k} for us, n, k in top_kernels],
            "host_top_own_time": rows[:25],
            "host_top_builtins": builtins,  # torch calls by own time: a read-back's wait shows here (tolist, item)
            "cuda_runtime_us": [{"us": round(us, 1), "calls": n, "name": k} for us, n, k in runtime],
            "device_syncs_by_line": dict(sorted(syncs.items(), key=lambda kv: -kv[1]))}


def per_prompt_history(turns_out: list[dict[str, Any]], pid: str, user_turns: list[str], turn: int,
                       tok: Any) -> list[dict[str, str]]:
    """The conversation up to ``turn``: earlier user turns and this configuration's own answers."""
    messages: list[dict[str, str]] = []
    for k in range(turn):
        answer = next(p for p in turns_out[k]["per_prompt"] if p["id"] == pid)["text_ids"]
        messages += [{"role": "user", "content": user_turns[k]},
                     {"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)}]
    return messages + [{"role": "user", "content": user_turns[turn]}]


def run_http(args: argparse.Namespace, name: str, temperature: float,
             sets: dict[str, list[tuple[str, list[str]]]]) -> dict[str, Any]:
    """``fusedserve run`` serving the pair; the prompts' first turns one at a time with the openai client."""
    import httpx
    from openai import OpenAI

    cfg = config_of(name)
    tokens = f", numDraftTokens: {cfg['num_draft_tokens']}" if cfg and "num_draft_tokens" in cfg else ""
    # absolute paths: the manifest is written in a temporary folder, and relative ones resolve from there
    spec = "" if cfg is None else (f"  speculative: {{draftModel: {Path(args.draft).resolve()}, "
                                   f"numSteps: {cfg['num_steps']}, "
                                   f"topK: {cfg.get('topk', 1)}{tokens}}}\n")
    manifest = Path(tempfile.mkdtemp(prefix="spec-real-")) / "pair.yaml"
    manifest.write_text(f"""apiVersion: fusedserve.io/v1alpha1
kind: InferenceDeployment
metadata: {{name: real-pair}}
spec:
  model: {{path: {Path(args.target).resolve()}}}
{spec}  serving: {{maxSequences: 1, kvCacheFraction: 0.2}}
""")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fusedserve.cli", "run", str(manifest), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=manifest.parent)  # not the checkout: its fusedserve/ would shadow the package
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "acceptance length:" in line or proc.poll() is not None:
            break
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {}
    try:
        if "acceptance length:" not in "".join(lines):
            raise RuntimeError("fusedserve run did not start:\n" + "".join(lines[-30:]))
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        for (set_name, prompts), stream in [(kv, stream) for kv in sets.items() for stream in (False, True)]:
            before = _metric_totals(httpx.get(f"{url}/metrics", timeout=30).text)
            tokens, seconds, chunks = 0, 0.0, 0
            for i, (_pid, turns) in enumerate(prompts):
                t = time.perf_counter()
                kw: dict[str, Any] = {"model": "real-pair", "messages": [{"role": "user", "content": turns[0]}],
                                      "max_tokens": args.max_new_tokens, "temperature": temperature, "seed": i}
                if stream:  # server-sent events, a chunk per engine step (its last one carries the usage)
                    usage = None
                    for chunk in client.chat.completions.create(**kw, stream=True,
                                                                stream_options={"include_usage": True}):
                        chunks += 1
                        usage = chunk.usage or usage
                else:
                    usage = client.chat.completions.create(**kw).usage
                seconds += time.perf_counter() - t
                tokens += usage.completion_tokens if usage else 0
            after = _metric_totals(httpx.get(f"{url}/metrics", timeout=30).text)
            drafts = after["drafts"] - before["drafts"]
            row: dict[str, Any] = {"prompts": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
                                   "tok_per_s": round(tokens / seconds, 2) if seconds else None}
            if stream:
                row["chunks"] = chunks
            if drafts:
                row["acceptance_length"] = round(1 + (after["accepted"] - before["accepted"]) / drafts, 4)
            key = f"{set_name}_stream" if stream else set_name
            out[key] = row
            progress(f"http   {name:8s} T={temperature:g} {key}: {json.dumps(row)}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def _metric_totals(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    vals = {"drafts": 0.0, "accepted": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "fusedserve_spec_decode_drafts_total":
                vals["drafts"] += s.value
            elif s.name == "fusedserve_spec_decode_accepted_tokens_total":
                vals["accepted"] += s.value
    return vals


def hf_peer(args: argparse.Namespace, sets: dict[str, list[tuple[str, list[str]]]]) -> dict[str, Any]:
    """HF transformers' greedy ``generate`` on the first prompts (the same device and dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = args.device == "cuda"
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16 if cuda else torch.float32)
    hf = hf.to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [t[0] for _, t in next(iter(sets.values()))[: args.hf_peer]]
    tokens, seconds = 0, 0.0
    for i, text in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"].to(args.device)
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first is a warm-up
            seconds += time.perf_counter() - t
            tokens += int(out.shape[1] - ids.shape[1])
    return {"what": "HF transformers generate (greedy, default dynamic cache, eager), batch 1",
            "prompts_timed": max(len(prompts) - 1, 0), "tokens": tokens,
            "tok_per_s": round(tokens / seconds, 2) if seconds else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--data-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--mtbench", type=int, default=80, help="MT-bench questions (first n; 0 = none)")
    ap.add_argument("--humaneval", type=int, default=164, help="HumanEval problems (first n; 0 = none)")
    ap.add_argument("--turns", type=int, default=2, choices=[1, 2], help="MT-bench turns")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--http", default="", help="configurations also measured through the HTTP server")
    ap.add_argument("--hf-peer", type=int, default=0, help="HF generate on this many MT-bench prompts")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="profile one generate per configuration (device "
                    "kernel time vs wall, host Python by function)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant under fusedserve. first (an A/B), e.g. models.layers.linear_triton.SPLIT_K_MAX=2")
    ap.add_argument("--prefill-graphs", default="", help="prompt lengths whose one-sequence prefill is captured "
                    "(EngineConfig.prefill_graph_tokens), e.g. 32,64,128; 'none': every prefill eagerly; by default "
                    "the engine's (worker/engine/config.py PREFILL_GRAPH_TOKENS on a GPU)")
    ap.add_argument("--interleave", action="store_true", help="every configuration's engine built first, then "
                    "each prompt through all of them in turn (the machine's drift weighs on all alike; paired speed-ups)")
    ap.add_argument("--tiny", action="store_true", help="CPU check of the script: the tiny pair, a few prompts")
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-spec-decode-real.json")
    args = ap.parse_args()
    args.prefill_graphs = (None if not args.prefill_graphs else () if args.prefill_graphs == "none"
                           else tuple(int(n) for n in args.prefill_graphs.split(",") if n))
    settings = apply_settings(args.set)
    if args.prefill_graphs is not None:
        settings["EngineConfig.prefill_graph_tokens"] = list(args.prefill_graphs)
    if args.tiny:
        args.target = args.target or str(ROOT / "examples/checkpoints/tiny-code")
        args.draft = args.draft or str(ROOT / "examples/checkpoints/tiny-code-eagle3")
        args.mtbench, args.humaneval, args.max_new_tokens = min(args.mtbench, 2), min(args.humaneval, 2), 16
        args.num_blocks = args.num_blocks or 64
    if not args.target or not args.draft:
        ap.error("--target and --draft are needed (or --tiny)")
    args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    configs = [c for c in args.configs.split(",") if c]
    unknown = []
    for c in configs + [c for c in args.http.split(",") if c]:
        try:
            config_of(c)
        except KeyError:
            unknown.append(c)
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}, chain-N, tree-sS-kK-tT "
                 f"(each also +sync)")
    if any(c.endswith(SYNC) for c in args.http.split(",")):
        ap.error("--http serves the defaults: +sync is for engine configurations")
    sets = prompt_sets(args)
    progress(f"{args.device}: {', '.join(f'{k} {len(v)}' for k, v in sets.items())} prompts, configs {configs}, "
             f"temperatures {temperatures}")
    engine: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    # Plain decoding first and again last (per temperature): the first engine of a run on a fresh machine ran
    # 10-30 % slow even after its warm-up (2026-12-04); speed-ups are taken against the faster of the two
    # (--interleave: every configuration's engine alive at once, prompt by prompt in turn: no bracket needed)
    bracket = "none" in configs and len(configs) > 1 and not args.interleave
    for temp in temperatures:
        groups = [configs] if args.interleave else [[n] for n in configs + (["none-again"] if bracket else [])]
        for group in groups:
            runs = run_engines(args, [n.removesuffix("-again") for n in group], temp, sets)
            for name, (numbers_of, prof) in zip(group, runs.values()):
                engine[f"{name}@T={temp:g}"] = numbers_of
                if prof is not None:
                    profiles[f"{name}@T={temp:g}"] = prof
            # what is done so far, in case the run is cut short (a device call's time limit)
            write_record({**record_header(), "partial": True, "profiles": profiles, "numbers": {
                "speedup_engine": {t: v for tt in temperatures[: temperatures.index(temp) + 1]
                                   for t, v in speedups(engine, [tt], [c for c in configs
                                                                       if f"{c}@T={tt:g}" in engine]).items()},
                "engine_done": sorted(engine)}}, args.out)
    numbers: dict[str, Any] = {"engine": engine, "speedup_engine": speedups(engine, temperatures, configs)}
    if args.interleave:
        numbers["paired_speedup_engine"] = paired_speedups(engine, temperatures, configs)
    if profiles:
        numbers["profiles"] = profiles
    numbers["greedy_equal_to_no_speculation"] = greedy_equal(engine, configs)
    if args.http:
        numbers["http"] = {f"{name}@T={temp:g}": run_http(args, name, temp, sets)
                           for temp in temperatures for name in args.http.split(",") if name}
    if args.hf_peer:
        numbers["hf_peer"] = hf_peer(args, sets)
    for runs in engine.values():  # keep the record readable: token ids out, counts in
        for turns in runs.values():
            for t in turns:
                for p in t["per_prompt"]:
                    p.pop("text_ids", None)
    record = {**record_header(), "what": f"EAGLE3 {args.draft} on {args.target} through the engine "
              f"({args.device}), batch 1, max {args.max_new_tokens} new tokens; MT-bench (first {args.mtbench}, "
              f"{args.turns} turn(s)) and HumanEval (first {args.humaneval})",
              "peers": {"sglang_llama31_8b_eagle3_speedup": 2.36, "seed_pr_28343_acceptance_gain":
                        {"mt_bench": 0.025, "humaneval": 0.031}},
              "settings": settings, "numbers": numbers}
    path = write_record(record, args.out)
    progress(f"wrote {path}")
    print(json.dumps(numbers["speedup_engine"], indent=1))


def speedups(engine: dict[str, Any], temperatures: list[float], configs: list[str]) -> dict[str, Any]:
    """tok/s of each configuration / no speculation's, per set and turn (the same run; no speculation's
    faster run where it was measured first and again last)."""
    out: dict[str, Any] = {}
    for temp in temperatures:
        base = engine.get(f"none@T={temp:g}")
        again = engine.get(f"none-again@T={temp:g}")
        if base is not None and again is not None:
            base = {s: [max(a, b, key=lambda x: x["tok_per_s"] or 0) for a, b in zip(base[s], again[s])]
                    for s in base}
        for name in configs:
            run = engine[f"{name}@T={temp:g}"]
            row: dict[str, Any] = {}
            for set_name, turns in run.items():
                for t in turns:
                    key = f"{set_name}_turn{t['turn']}"
                    row[key] = {"tok_per_s": t["tok_per_s"],
                                "acceptance_length": t["acceptance"]["acceptance_length"] if t["acceptance"] else None}
                    if base is not None and t["tok_per_s"]:
                        b = next(x for x in base[set_name] if x["turn"] == t["turn"])
                        row[key]["speedup"] = round(t["tok_per_s"] / b["tok_per_s"], 3) if b["tok_per_s"] else None
            out[f"{name}@T={temp:g}"] = row
    return out


def paired_speedups(engine: dict[str, Any], temperatures: list[float], configs: list[str]) -> dict[str, Any]:
    """Each configuration against no speculation prompt by prompt (``--interleave``: the two ran back to back
    on every prompt): the pooled speed-up (generated tokens / seconds of the set, one over the other), a
    bootstrap 95 % interval of it (resampling prompts) and the per-prompt speed-ups' quartiles (ms a token of
    no speculation / the configuration's; their tokens may differ in bf16)."""
    out: dict[str, Any] = {}
    for temp in temperatures:
        base = engine.get(f"none@T={temp:g}")
        if base is None:
            continue
        for name in configs:
            if name == "none":
                continue
            row: dict[str, Any] = {}
            for set_name, turns in engine[f"{name}@T={temp:g}"].items():
                for t, b in zip(turns, base[set_name]):
                    mine = {p["id"]: p for p in t["per_prompt"]}
                    pairs = [(p, mine[p["id"]]) for p in b["per_prompt"] if p["id"] in mine]
                    row[f"{set_name}_turn{t['turn']}"] = speedup_spread(pairs)
            out[f"{name}@T={temp:g}"] = row
    return out


def speedup_spread(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """(no speculation's prompt record, the configuration's) -> pooled speed-up, its bootstrap 95 % interval,
    the per-prompt speed-ups' quartiles and how many prompts ran faster."""
    import random
    import statistics

    def pooled(idx: list[int]) -> float:
        a = sum(pairs[i][0]["seconds"] for i in idx) / max(sum(pairs[i][0]["tokens"] for i in idx), 1)
        b = sum(pairs[i][1]["seconds"] for i in idx) / max(sum(pairs[i][1]["tokens"] for i in idx), 1)
        return a / b if b else float("nan")

    n = len(pairs)
    out: dict[str, Any] = {"prompts": n}
    if not n:
        return out
    each = [(a["seconds"] / max(a["tokens"], 1)) / (b["seconds"] / max(b["tokens"], 1))
            for a, b in pairs if a["seconds"] and b["seconds"]]
    out.update(speedup=round(pooled(list(range(n))), 3), prompts_faster=sum(x > 1 for x in each))
    if len(each) >= 2:
        rng = random.Random(0)
        draws = sorted(pooled([rng.randrange(n) for _ in range(n)]) for _ in range(2000))
        out.update(bootstrap_95=[round(draws[50], 3), round(draws[1949], 3)],
                   per_prompt_quartiles=[round(x, 3) for x in statistics.quantiles(each, n=4)])
    return out


def greedy_equal(engine: dict[str, Any], configs: list[str]) -> dict[str, Any]:
    """At temperature 0 every configuration should give no speculation's tokens (first turns): in
    exact arithmetic it does; in bf16 a verify's multi-row forward can flip a near-tie that the
    one-row decode did not. Per configuration: prompts identical, and where they differ the first
    differing token (the tokens before it are equal)."""
    base = engine.get("none@T=0")
    if base is None:
        return {}
    out: dict[str, Any] = {}
    for name in configs:
        run = engine.get(f"{name}@T=0")
        if run is None:
            continue
        pairs = [(a["text_ids"], b["text_ids"]) for s in run for a, b in zip(run[s][0]["per_prompt"],
                                                                            base[s][0]["per_prompt"])]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in pairs if a != b]
        out[name] = {"identical": len(pairs) - len(first), "prompts": len(pairs), "first_difference_at": first}
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
