"""PNG charts of the recorded benchmarks: ``python bench/plots.py`` (or ``make plots``).

Reads ``bench/results/*.json`` (``--results``) and writes ``docs/images/*.png`` (``--out``). Each chart reads
the newest file (by name: they start with the date) matching its patterns; a chart whose input is absent is
skipped with a message, the others are still drawn (exit status 0). Charts and their inputs:

- ``decode.png``: decode ms per step and tokens/s vs batch, with the weight-streaming roofline and the
  same-run peer. ``*-decode-roofline-*``: ``variants[headline_variant].d_throughput`` rows (``batch``,
  ``ms_per_step``, ``tok_per_s``, ``pct_of_roofline_weights``) and ``hf_eager`` (the peer, batch 1);
  ``*-decode-tp2-*``: ``tp2.rank0.variants[headline.tp2_variant].throughput``. An engine benchmark
  (``*-decode-engine-*``) plugs in with the same rows under ``throughput`` and its peer's under
  ``peer.throughput`` (named ``peer.name``).
- ``served-latency.png``: served TTFT and inter-token latency percentiles vs request rate.
  ``*-served-load-*``: ``runs``, one per request rate, with vLLM's benchmark_serving names
  (``request_rate``, ``p50_ttft_ms``, ``p90_ttft_ms``, ``p99_ttft_ms``, ``p50_itl_ms``, ...; any
  ``pNN_`` percentiles found are drawn).
- ``acceptance.png``: acceptance rate per draft position (``*-spec-decode-cpu-*``:
  ``numbers[config].acceptance_rate_per_position``) and acceptance length per configuration and prompt
  set (every ``*-spec-decode-*`` file: ``numbers[config].acceptance_length`` or ``..._batch1``; a file with
  ``benchmarks: {name: {config: acceptance_length}}``, e.g. MT-bench / HumanEval, adds one bar group each).
- ``allreduce-fusion.png``: one fused all-reduce + add + RMSNorm boundary vs the unfused one (and the raw
  FlashInfer kernel, NCCL all-reduce alone) vs tokens, per hidden size. ``*-comm-fusion-*``: ``numbers``.
- ``dp-combine.png``: the DP combine as one reduce-scatter vs all-reduce + slice: decode step time and
  microseconds saved per combine vs tokens per DP rank. ``*-dp-ep-combine-*``: ``benchmark.summary``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMAGES = ROOT / "docs" / "images"


class Missing(Exception):
    """A chart's input is not recorded (yet)."""


def newest(results: Path, pattern: str) -> tuple[Path, dict[str, Any]]:
    files = sorted(results.glob(f"*-{pattern}-*.json")) + sorted(results.glob(f"*-{pattern}.json"))
    if not files:
        raise Missing(f"no bench/results/*-{pattern}-*.json")
    path = max(files, key=lambda p: p.name)
    return path, json.loads(path.read_text())


def _source(fig: Figure, *paths: Path) -> None:
    fig.text(0.01, 0.005, "from " + ", ".join(p.name for p in paths), fontsize=7, color="0.4")


def _log2_batches(ax: Any, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])


# --- the charts ---------------------------------------------------------------------------------------------------

def decode(results: Path) -> Figure:
    path, rec = newest(results, "decode-roofline")
    variant = rec["variants"][rec["headline_variant"]]
    series: list[tuple[str, list[dict[str, Any]], str]] = [(f"ours tp=1 ({rec['machine']})", variant["d_throughput"],
                                                            "C0")]
    paths = [path]
    try:
        tp2_path, tp2 = newest(results, "decode-tp2")
        rows = tp2["tp2"]["rank0"]["variants"][tp2["headline"]["tp2_variant"]]["throughput"]
        series.append((f"ours tp=2 ({tp2['machine']})", rows, "C1"))
        paths.append(tp2_path)
    except Missing:
        pass
    peers: list[tuple[str, list[dict[str, Any]]]] = [("HF transformers eager, same run", [
        {"batch": 1, "ms_per_step": rec["hf_eager"]["ms_per_token"], "tok_per_s": rec["hf_eager"]["tok_per_s"]}])]
    try:
        engine_path, engine = newest(results, "decode-engine")
        series.append((f"engine ({engine.get('machine', '')})", engine["throughput"], "C2"))
        if "peer" in engine:
            peers.append((str(engine["peer"].get("name", "peer")) + ", same run", engine["peer"]["throughput"]))
        paths.append(engine_path)
    except Missing:
        pass
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({r["batch"] for _, rows, _ in series for r in rows})
    for label, rows, color in series:
        b = [r["batch"] for r in rows]
        lat.plot(b, [r["ms_per_step"] for r in rows], "o-", color=color, label=label)
        thr.plot(b, [r["tok_per_s"] for r in rows], "o-", color=color, label=label)
        if all("pct_of_roofline_weights" in r for r in rows):
            roof = [r["ms_per_step"] * r["pct_of_roofline_weights"] / 100 for r in rows]
            lat.plot(b, roof, "--", color=color, alpha=0.6, label=label.split(" (")[0] + ": weight roofline")
            thr.plot(b, [n * 1000 / ms for n, ms in zip(b, roof)], "--", color=color, alpha=0.6)
    for i, (label, rows) in enumerate(peers):
        kw = {"marker": "s", "linestyle": ":", "color": f"C{3 + i}", "label": label}
        lat.plot([r["batch"] for r in rows], [r["ms_per_step"] for r in rows], **kw)
        thr.plot([r["batch"] for r in rows], [r["tok_per_s"] for r in rows], **kw)
    for ax in (lat, thr):
        _log2_batches(ax, batches)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.grid(True, which="both", alpha=0.3)
    lat.set_ylabel("ms per decode step")
    thr.set_ylabel("tokens/s")
    lat.set_title("Decode latency")
    thr.set_title("Decode throughput")
    lat.legend(fontsize=7)
    fig.suptitle(f"Llama-3-8B shape, {rec['dtype']}, CUDA graphs")
    _source(fig, *paths)
    return fig


def served_latency(results: Path) -> Figure:
    path, rec = newest(results, "served-load")
    runs = sorted(rec["runs"], key=lambda r: float(r["request_rate"]))
    rates = [float(r["request_rate"]) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in ((axes[0], "ttft", "Time to first token"), (axes[1], "itl", "Inter-token latency")):
        percentiles = sorted({int(m.group(1)) for r in runs for k in r
                              if (m := re.fullmatch(rf"p(\d+)_{metric}_ms", k))})
        if not percentiles:
            raise Missing(f"{path.name}: no pNN_{metric}_ms in its runs")
        for p in percentiles:
            ax.plot(rates, [r.get(f"p{p}_{metric}_ms", float("nan")) for r in runs], "o-", label=f"p{p}")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Served through the HTTP API ({rec.get('machine', '')})")
    _source(fig, path)
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
