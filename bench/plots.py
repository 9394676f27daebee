"""PNG charts of the recorded benchmarks: ``python bench/plots.py`` (or ``make plots``).

Reads ``bench/results/*.json`` (``--results``) and writes ``docs/images/*.png`` (``--out``). Each chart reads
the newest file matching its patterns (by the date its name starts with, then the one git added last); a chart
whose input is absent is skipped with a message, the others are still drawn (exit status 0). Charts and their
inputs:

- ``decode.png``: decode ms per step and tokens/s vs batch, with the roofline and the same-run peer.
  ``*-decode-engine-*`` (through the engine's API): ``decode`` rows (``batch``, ``ms_per_step``, ``tok_per_s``,
  ``roofline_ms``) and ``hf_peer.batches`` (HF transformers, same run). Without it, the older private-harness
  files: ``*-decode-roofline-*`` (``variants[headline_variant].d_throughput`` rows with
  ``pct_of_roofline_weights``; ``hf_eager`` at batch 1) and ``*-decode-tp2-*`` (tp=2 rows).
- ``served-latency.png``: served TTFT and inter-token latency percentiles vs request rate, every
  ``*-serve-*`` file of the newest date (``fusedserve run`` over HTTP, the engine in-process, ...):
  ``rates`` rows with ``rate`` (``"inf"``: every request at once) and ``ttft_pNN_ms`` / ``itl_pNN_ms``.
- ``acceptance.png``: acceptance rate per draft position (``*-spec-decode-cpu-*``:
  ``numbers[config].acceptance_rate_per_position``) and acceptance length per configuration and prompt
  set (every ``*-spec-decode-*`` file: ``numbers[config].acceptance_length`` or ``..._batch1``; a file with
  ``benchmarks: {name: {config: acceptance_length}}``, e.g. MT-bench / HumanEval, adds one bar group each;
  ``*-spec-decode-real-*``, SmolLM2 and its own draft, is another model and is left out).
- ``spec-decode-real.png``: EAGLE3 on a real model (SmolLM2 and its trained draft): acceptance length and
  engine speed-up over plain decoding per configuration and prompt set (MT-bench turns, HumanEval).
  ``*-spec-decode-real-*``: ``numbers.speedup_engine[config@T=t][set]`` (``acceptance_length``, ``speedup``).
- ``seed-bug-capture.png``: seed bug 1 measured, acceptance length per benchmark with the aux states captured
  after the boundary (complete) vs before it (sglang before PR #28343), with the 95 % bootstrap intervals and
  the paired difference. ``*-seed-bug-capture-*``: ``numbers[set].complete`` / ``.before_completion``
  (``acceptance_length``, ``bootstrap_95``) and ``numbers[set].before_completion_vs_complete``.
- ``allreduce-fusion.png``: one fused all-reduce + add + RMSNorm boundary vs the unfused one (and the raw
  FlashInfer kernel, NCCL all-reduce alone) vs tokens, per hidden size. ``*-comm-fusion-*``: ``numbers``.
- ``dp-combine.png``: the DP combine as one reduce-scatter vs all-reduce + slice: the decode step time ratio
  and the microseconds saved per combine vs tokens per DP rank. ``*-dp-ep-combine-*``: ``benchmark.summary``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter, ScalarFormatter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMAGES = ROOT / "docs" / "images"


class Missing(Exception):
    """A chart's input is not recorded (yet)."""


def _added(path: Path) -> float:
    """When git first committed ``path`` (Unix time); a file git does not hold yet is the newest (inf). In a
    shallow clone every file was added by the one commit: the name decides."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return math.inf
    return float(out[-1]) if out else math.inf


def newest(results: Path, pattern: str) -> tuple[Path, dict[str, Any]]:
    """The newest record matching ``pattern``: by the date its name starts with; of one date, the one committed
    last (two runs of a day: the later one, whatever its name), then by name."""
    files = sorted(results.glob(f"*-{pattern}-*.json")) + sorted(results.glob(f"*-{pattern}.json"))
    if not files:
        raise Missing(f"no bench/results/*-{pattern}-*.json")
    day = max(p.name[:10] for p in files)
    path = max((p for p in files if p.name.startswith(day)), key=lambda p: (_added(p), p.name))
    return path, json.loads(path.read_text())


def _source(fig: Figure, *paths: Path) -> None:
    fig.text(0.01, 0.005, "from " + ", ".join(p.name for p in paths), fontsize=7, color="0.4")


def _plain_log_y(ax: Any) -> None:
    """After plotting: a log y axis labelled with plain numbers when the data span a decade or more, else a
    linear one from 0 (a log axis over less than a decade shows one label or none)."""
    lo, hi = ax.dataLim.y0, ax.dataLim.y1
    if lo > 0 and hi / lo >= 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, hi * 1.08)
    ax.grid(True, which="both", alpha=0.3)


def _log2_batches(ax: Any, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])


# --- the charts ---------------------------------------------------------------------------------------------------

def _decode_series(results: Path) -> tuple[list[Path], str, list[tuple[str, list[dict[str, Any]], str]],
                                          list[tuple[str, list[dict[str, Any]]]]]:
    """(sources, title, [(label, rows with batch/ms_per_step/tok_per_s/roofline_ms, color)], [(peer, rows)])."""
    try:
        path, rec = newest(results, "decode-engine")
        title = f"Decode through the engine, Llama-3-8B shape, {rec['dtype']}, {rec['machine']}"
        return ([path], title, [("fusedserve engine", rec["decode"], "C0")],
                [("HF transformers (StaticCache, compiled step), same run", rec["hf_peer"]["batches"])])
    except Missing:
        pass
    path, rec = newest(results, "decode-roofline")

    def with_roofline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "roofline_ms": r["ms_per_step"] * r["pct_of_roofline_weights"] / 100} for r in rows]

    series = [(f"ours tp=1 ({rec['machine']})", with_roofline(rec["variants"][rec["headline_variant"]]["d_throughput"]),
               "C0")]
    paths = [path]
    try:
        tp2_path, tp2 = newest(results, "decode-tp2")
        rows = tp2["tp2"]["rank0"]["variants"][tp2["headline"]["tp2_variant"]]["throughput"]
        series.append((f"ours tp=2 ({tp2['machine']})", with_roofline(rows), "C1"))
        paths.append(tp2_path)
    except Missing:
        pass
    peer = [{"batch": 1, "ms_per_step": rec["hf_eager"]["ms_per_token"], "tok_per_s": rec["hf_eager"]["tok_per_s"]}]
    return paths, f"Decode, Llama-3-8B shape, {rec['dtype']}, CUDA graphs", series, [
        ("HF transformers eager, same run", peer)]


def decode(results: Path) -> Figure:
    paths, title, series, peers = _decode_series(results)
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({r["batch"] for _, rows, _ in series for r in rows})
    for label, rows, color in series:
        b = [r["batch"] for r in rows]
        lat.plot(b, [r["ms_per_step"] for r in rows], "o-", color=color, label=label)
        thr.plot(b, [r["tok_per_s"] for r in rows], "o-", color=color, label=label)
        roof = [r["roofline_ms"] for r in rows]
        lat.plot(b, roof, "--", color=color, alpha=0.6, label=label.split(" (")[0] + ": memory roofline")
        thr.plot(b, [n * 1000 / ms for n, ms in zip(b, roof)], "--", color=color, alpha=0.6)
    for i, (label, rows) in enumerate(peers):
        kw = {"marker": "s", "linestyle": ":", "color": f"C{3 + i}", "label": label}
        lat.plot([r["batch"] for r in rows], [r["ms_per_step"] for r in rows], **kw)
        thr.plot([r["batch"] for r in rows], [r["tok_per_s"] for r in rows], **kw)
    for ax in (lat, thr):
        _plain_log_y(ax)
        _log2_batches(ax, batches)
        ax.set_xlabel("batch (sequences)")
    lat.set_ylabel("ms per decode step")
    thr.set_ylabel("tokens/s")
    lat.set_title("Decode latency")
    thr.set_title("Decode throughput")
    lat.legend(fontsize=7)
    fig.suptitle(title)
    _source(fig, *paths)
    return fig


def _served_label(path: Path, rec: dict[str, Any]) -> str:
    target = str(rec.get("target", path.stem))
    label = "engine in-process" if target.startswith("engine") else "fusedserve run (HTTP)"
    variant = path.stem[11:].removeprefix("serve-").rsplit("-", 1)[0].split("-", 1)  # e.g. ["http", "merged"]
    return label + (f", {variant[1]}" if len(variant) > 1 else "")


def served_latency(results: Path) -> Figure:
    files = sorted(results.glob("*-serve-*.json"))
    if not files:
        raise Missing("no bench/results/*-serve-*.json")
    day = max(p.name[:10] for p in files)
    runs = [(p, json.loads(p.read_text())) for p in files if p.name.startswith(day)]
    rates = sorted({str(r["rate"]) for _, rec in runs for r in rec["rates"]},
                   key=lambda x: float("inf") if x == "inf" else float(x))
    x_of = {rate: i for i, rate in enumerate(rates)}
    styles: dict[int, Any] = {50: "-", 90: "--", 99: ":"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, metric, title in ((axes[0], "ttft", "Time to first token"), (axes[1], "itl", "Inter-token latency")):
        for i, (_path, rec) in enumerate(runs):
            for p, style in styles.items():
                rows = [r for r in rec["rates"] if f"{metric}_p{p}_ms" in r]
                ax.plot([x_of[str(r["rate"])] for r in rows], [r[f"{metric}_p{p}_ms"] for r in rows], style,
                        marker="o", markersize=3, color=f"C{i}")
        ax.set_xticks(range(len(rates)), [("all at once" if r == "inf" else f"{float(r):g}") for r in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("ms")
        _plain_log_y(ax)
        ax.set_title(title)
    targets = [Line2D([], [], color=f"C{i}", label=_served_label(path, rec)) for i, (path, rec) in enumerate(runs)]
    percentiles = [Line2D([], [], color="0.3", linestyle=style, label=f"p{p}") for p, style in styles.items()]
    axes[0].add_artist(axes[0].legend(handles=targets, fontsize=7, loc="upper left"))
    axes[1].legend(handles=percentiles, fontsize=7, loc="upper left")
    dataset = runs[0][1].get("dataset", {})
    fig.suptitle(f"Served, {runs[0][1].get('machine', '')}: {dataset.get('source', '').split(' ')[0]} requests "
                 f"(mean {dataset.get('mean_prompt_len', '?')} prompt / {dataset.get('mean_output_len', '?')} "
                 "output tokens)")
    _source(fig, *(p for p, _ in runs))
    return fig


def _acceptance_lengths(rec: dict[str, Any]) -> dict[str, float]:
    out = {}
    for config, numbers in rec.get("numbers", {}).items():
        if "graphs_on" in rec.get("numbers", {}):  # spec-decode-gpu-graphs: one level more (same tokens both ways)
            numbers = rec["numbers"]["graphs_on"].get(config, {})
        value = numbers.get("acceptance_length", numbers.get("acceptance_length_batch1"))
        if value is not None:
            out[config] = float(value)
    return out


def _machine(rec: dict[str, Any]) -> str:
    machine = str(rec.get("machine", ""))
    return machine if "NVIDIA" in machine else "CPU"


def acceptance(results: Path) -> Figure:
    _, cpu = newest(results, "spec-decode-cpu")
    fig, (per_pos, per_bench) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config, numbers in cpu["numbers"].items():
        rates = numbers.get("acceptance_rate_per_position")
        if rates:
            per_pos.plot(range(1, len(rates) + 1), rates, "o-", label=config)
    per_pos.set_xlabel("draft position")
    per_pos.set_xticks(range(1, 1 + max(len(n.get("acceptance_rate_per_position", [])) for n in cpu["numbers"].values())))
    per_pos.set_ylabel("tokens accepted there per verify step")
    per_pos.set_title(f"Acceptance per draft position ({_machine(cpu)})")
    per_pos.set_ylim(0, 1)
    per_pos.grid(True, alpha=0.3)
    per_pos.legend(fontsize=8)

    groups: dict[str, dict[str, float]] = {}
    paths = []
    for path in sorted(results.glob("*-spec-decode-*.json"), key=lambda p: p.name):
        if "graphs" in path.name:  # the same prompts and tokens as the eager GPU run
            continue
        if "spec-decode-real" in path.name or "smollm2" in path.name:  # SmolLM2 and its draft: not the tiny pair
            continue
        rec = json.loads(path.read_text())
        paths.append(path)
        prompts = len(rec.get("prompt_files", [])) or "?"
        groups[f"{_machine(rec)}: {prompts} held-out stdlib files"] = _acceptance_lengths(rec)
        for name, by_config in rec.get("benchmarks", {}).items():
            groups[f"{_machine(rec)}: {name}"] = {c: float(v) for c, v in by_config.items()}
    configs = sorted({c for g in groups.values() for c in g})
    width = 0.8 / max(1, len(groups))
    for i, (label, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(configs))]
        per_bench.bar(xs, [values.get(c, 0) for c in configs], width, label=label)
    per_bench.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(configs))],
                         [c.replace("-steps", "\n-steps") for c in configs], fontsize=8)
    per_bench.set_ylabel("mean acceptance length (1 + accepted / drafts)")
    per_bench.set_title("Acceptance length per configuration and prompt set")
    per_bench.axhline(1, color="0.5", linewidth=0.8)
    per_bench.legend(fontsize=7)
    per_bench.grid(True, axis="y", alpha=0.3)
    fig.suptitle("EAGLE3 on the tiny code pair (greedy)")
    _source(fig, *paths)
    return fig


def spec_decode_real(results: Path) -> Figure:
    path, rec = newest(results, "spec-decode-real")
    runs = {c: by_set for c, by_set in rec["numbers"]["speedup_engine"].items() if not c.startswith("none@")}
    sets = list(dict.fromkeys(name for by_set in runs.values() for name in by_set))
    fig, (length, speedup) = plt.subplots(1, 2, figsize=(12, 4.4))
    width = 0.8 / max(1, len(sets))
    for i, name in enumerate(sets):
        xs = [j + i * width for j in range(len(runs))]
        label = name.replace("mtbench_turn", "MT-bench turn ").replace("humaneval_turn1", "HumanEval")
        length.bar(xs, [(by.get(name) or {}).get("acceptance_length") or 0 for by in runs.values()], width,
                   label=label)
        speedup.bar(xs, [(by.get(name) or {}).get("speedup") or 0 for by in runs.values()], width, label=label)
    for ax in (length, speedup):
        ax.set_xticks([j + width * (len(sets) - 1) / 2 for j in range(len(runs))],
                      [c.replace("@", "\n") for c in runs], fontsize=8)
        ax.axhline(1, color="0.3", linewidth=0.8)
        ax.grid(True, axis="y", alpha=0.3)
    length.set_ylabel("mean acceptance length (1 + accepted / drafts)")
    length.set_title("Acceptance length per configuration and prompt set")
    length.legend(fontsize=8)
    speedup.set_ylabel("engine tokens/s with / without speculation")
    speedup.set_title("Speed-up over plain decoding (same run; < 1: slower)")
    partial = " (partial run)" if rec.get("partial") else ""
    target = re.search(r"\bon (\S+)", str(rec.get("what", "")))
    model = Path(target.group(1)).name if target else "the target"
    fig.suptitle(f"EAGLE3 on {model} with its trained draft, batch 1, {rec['machine']}{partial}")
    _source(fig, path)
    return fig


CAPTURES = {"complete": "complete (after the boundary)", "before_completion": "before completion (pre-#28343)"}


def seed_bug_capture(results: Path) -> Figure:
    path, rec = newest(results, "seed-bug-capture")
    sets = {name: by for name, by in rec["numbers"].items() if all(c in by for c in CAPTURES)}
    fig, (length, diff) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(CAPTURES)
    for i, (capture, label) in enumerate(CAPTURES.items()):
        xs = [j + i * width for j in range(len(sets))]
        values = [by[capture]["acceptance_length"] for by in sets.values()]
        low_high = [by[capture]["bootstrap_95"] for by in sets.values()]
        errors = [[v - lo for v, (lo, _) in zip(values, low_high)], [hi - v for v, (_, hi) in zip(values, low_high)]]
        length.bar(xs, values, width, yerr=errors, capsize=4, label=label)
    length.set_xticks([j + width * (len(CAPTURES) - 1) / 2 for j in range(len(sets))], list(sets))
    length.set_ylabel("acceptance length (1 + accepted / drafts)")
    length.set_title("Per benchmark (bars: 95 % bootstrap interval)")
    length.legend(fontsize=8, loc="lower right")
    pairs = [by["before_completion_vs_complete"] for by in sets.values()]
    diff.errorbar(range(len(sets)), [p["pooled_difference"] for p in pairs], fmt="o", capsize=4,
                  yerr=[[p["pooled_difference"] - p["bootstrap_95"][0] for p in pairs],
                        [p["bootstrap_95"][1] - p["pooled_difference"] for p in pairs]])
    diff.axhline(0, color="0.3", linewidth=0.8)
    diff.set_xticks(range(len(sets)), [f"{n}\n({p['prompts']} prompts)" for n, p in zip(sets, pairs)])
    diff.set_xlim(-0.5, len(sets) - 0.5)
    diff.set_ylabel("before completion - complete")
    diff.set_title("Paired difference (95 % bootstrap)")
    for ax in (length, diff):
        ax.grid(True, axis="y", alpha=0.3)
    target, tp = (re.search(rf"--{flag} (\S+)", str(rec.get("command", ""))) for flag in ("target", "tp"))
    run = ([Path(target.group(1)).name] if target else []) + ([f"tp={tp.group(1)}"] if tp else []) + [_machine(rec)]
    fig.suptitle(f"Seed bug 1: EAGLE3 aux capture after vs before the fused boundary ({', '.join(run)})")
    _source(fig, path)
    return fig


def allreduce_fusion(results: Path) -> Figure:
    path, rec = newest(results, "comm-fusion")
    sizes = sorted(rec["numbers"], key=int, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, hidden in zip(axes[0], sizes):
        rows = rec["numbers"][hidden]
        tokens = [r["tokens"] for r in rows]
        for key, label, style in (("fused_us", "fused AR + add + RMSNorm (ours)", "o-"),
                                  ("raw_flashinfer_us", "raw FlashInfer kernel", "x:"),
                                  ("unfused_us", "unfused: NCCL all-reduce, add, RMSNorm", "s-"),
                                  ("nccl_allreduce_us", "NCCL all-reduce alone", "^--")):
            ax.plot(tokens, [r[key] for r in rows], style, label=label)
        _log2_batches(ax, tokens)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per boundary")
        ax.set_title(f"hidden {hidden}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"All-reduce boundary, {rec['machine']}, {rec['dtype']}, CUDA graphs")
    _source(fig, path)
    return fig


def dp_combine(results: Path) -> Figure:
    path, rec = newest(results, "dp-ep-combine")
    rows = rec["benchmark"]["summary"]
    tokens = [r["batch_per_dp_rank"] for r in rows]
    par = rec["benchmark"]["parallel"]
    fig, (step, saved) = plt.subplots(1, 2, figsize=(11, 4.2))
    step.plot(tokens, [r["all_reduce_slice_ms"] / r["reduce_scatter_ms"] for r in rows], "o-",
              label=f"rank 0 (steps of {rows[0]['reduce_scatter_ms']:.1f}-{rows[-1]['reduce_scatter_ms']:.1f} ms)")
    if all("rank1_ratio_ar_over_rs" in r for r in rows):
        step.plot(tokens, [r["rank1_ratio_ar_over_rs"] for r in rows], "s--", label="rank 1")
    step.axhline(1, color="0.3", linewidth=0.8)
    step.set_ylabel("step time: all-reduce + slice / reduce-scatter")
    step.set_title("Whole decode step (CUDA graphs)")
    step.legend(fontsize=8)
    saved.bar(range(len(tokens)), [r["us_saved_per_combine"] for r in rows], color="C2")
    saved.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    saved.axhline(0, color="0.3", linewidth=0.8)
    saved.set_ylabel("µs saved per combine (reduce-scatter)")
    saved.set_title("Saved per MoE combine")
    for ax in (step, saved):
        ax.set_xlabel("tokens per DP rank")
        ax.grid(True, alpha=0.3)
    _log2_batches(step, tokens)
    fig.suptitle(f"DP combine after the experts, tp={par['tp']} dp={par['dp']} ep={par['ep']}, {rec['machine']}")
    _source(fig, path)
    return fig


CHARTS: dict[str, Callable[[Path], Figure]] = {
    "decode.png": decode,
    "served-latency.png": served_latency,
    "acceptance.png": acceptance,
    "spec-decode-real.png": spec_decode_real,
    "seed-bug-capture.png": seed_bug_capture,
    "allreduce-fusion.png": allreduce_fusion,
    "dp-combine.png": dp_combine,
}


def render(results: Path = RESULTS, out: Path = IMAGES) -> dict[str, str]:
    """Every chart: name -> "wrote PATH" or "skipped: WHY"."""
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, chart in CHARTS.items():
        try:
            fig = chart(results)
        except Missing as e:
            report[name] = f"skipped: {e}"
            continue
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out / name, dpi=110, metadata={"Software": None})
        plt.close(fig)
        report[name] = f"wrote {out / name}"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of recorded *.json")
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs")
    args = parser.parse_args(argv)
    for name, what in render(args.results, args.out).items():
        print(f"{name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
