"""One table of several ``bench/graph_launch_probe.py --timeline`` records: each variant's captured graphs' GPU
time (CPU; reads the records only).

    python bench/probe_table.py OUT/probe-*/graph-launch.json [--out table.json]

A variant is what a record's run set (``settings``: the ``--set`` constants, ``dropped_kernels``: ``--drop``);
records of one variant (``bash bench/gpu_real.sh probes``, which alternates the variants over rounds) are
taken together: per configuration (``none``, ``chain-7``, ...) each graph's GPU time in a generate (the
timeline's median over steps) as the median over the variant's records with its spread, the engine steps of
the 256-token generate (equal steps: equal acceptance, a check that a variant changed no token's choice
beyond bf16 near-ties), and the GPU time a step or round spends in its graphs (their sum). Printed first:
the variants in the order they first appear, the first being the reference of the differences (records of
several machines are tabled but said to be: GPU times compare within one lease only).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.records import table_main, variant_of  # noqa: E402


def graph_name(graph: str) -> str:
    """A timeline replay's graph, shortened: the executor and the step shape's batch / tokens / chain."""
    executor, _, shape = graph.partition(" ")
    fields = dict(part.split("=", 1) for part in shape.removeprefix("StepShape(").removesuffix(")").split(", ") if "=" in part)
    keep = [f"{k}={fields[k]}" for k in ("batch", "tokens", "chain") if k in fields]
    return f"{executor} {' '.join(keep)}".strip()


def table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """{variant: {config: {graphs: {name: {median_us, min_us, max_us, runs}}, busy_us, steps}}} in first-seen
    order, and each variant's busy time per config against the first variant's."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        grouped.setdefault(variant_of(record), []).append(record)
    out: dict[str, Any] = {}
    for variant, runs in grouped.items():
        configs: dict[str, Any] = {}
        for name in dict.fromkeys(c for r in runs for c in r["configs"]):
            per_graph: dict[str, list[float]] = {}
            busy: list[float] = []
            steps: list[int] = []
            for r in runs:
                c = r["configs"].get(name)
                if not c or not c.get("timeline"):
                    continue
                replays = c["timeline"].get("replays", [])
                for rep in replays:
                    per_graph.setdefault(graph_name(rep["graph"]), []).append(rep["gpu_us"])
                busy.append(sum(rep["gpu_us"] for rep in replays))
                steps.append(c["engine_steps"])
            configs[name] = {
                "graphs": {g: {"median_us": round(statistics.median(v), 1), "min_us": min(v), "max_us": max(v),
                               "runs": len(v)} for g, v in per_graph.items()},
                "busy_us": round(statistics.median(busy), 1) if busy else None,
                "steps": steps,
            }
        out[variant] = configs
    first: dict[str, Any] = next(iter(out.values()), {})
    for configs in out.values():
        for name, c in configs.items():
            ref = first.get(name, {}).get("busy_us")
            c["busy_vs_first_us"] = None if ref is None or c["busy_us"] is None else round(c["busy_us"] - ref, 1)
    return out


def render(rows: dict[str, Any]) -> str:
    lines = []
    for variant, configs in rows.items():
        lines.append(variant)
        for name, c in configs.items():
            graphs = "; ".join(f"{g} {v['median_us']} ({v['min_us']}-{v['max_us']}, {v['runs']})"
                               for g, v in c["graphs"].items())
            lines.append(f"  {name}: busy {c['busy_us']} us ({c['busy_vs_first_us']:+} vs the first), steps "
                         f"{c['steps']}; {graphs}" if c["busy_vs_first_us"] is not None else
                         f"  {name}: no timeline")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, __doc__.split("\n")[0], "probe_table", "graph_launch_probe.py --timeline records",
                      lambda records: {"variants": table(records)}, lambda body: render(body["variants"]))


if __name__ == "__main__":
    sys.exit(main())
