"""One table of several ``bench/decode_engine.py`` records: each variant's decode step per batch (CPU; reads the
records only).

    python bench/decode_table.py OUT/decode-*.json [--out table.json]

A variant is what a record's run set (``settings``: the ``--set`` constants, ``dropped_kernels``: ``--drop``;
``bench/records.py``'s ``variant_of``); records of one variant (``bash bench/gpu_real.sh decodes``, which
alternates the variants over rounds) are taken together: per batch the ms per step as the median over the
variant's records with its min and max, and two fractions of the honest roofline: the median of each run's own
(its bytes over the copy bandwidth that run measured, as decode_engine.py writes it) and the same bytes over the
median copy bandwidth of all the records given (one lease: the copy's own run-to-run spread, ~2 %, then moves no
variant's figure). Against the first variant: the k-th record of each variant paired with the first's k-th (one
round of the alternation), the median of those differences in ms. Records of several machines are tabled but
said to be: step times compare within one lease only.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench.records import table_main, variant_of  # noqa: E402


def table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """{"copy_bandwidth_TBps": median over the records, "variants": {variant: {batch: {ms_median, ms_min, ms_max,
    runs, fraction_own_bw, fraction_median_bw, vs_first_ms, vs_first_runs}}}} in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        grouped.setdefault(variant_of(record), []).append(record)
    bws = [r["ceilings"]["copy_bandwidth_TBps"] for r in records if r.get("ceilings")]
    bw = statistics.median(bws) if bws else None
    rows: dict[str, Any] = {}
    per_run: dict[str, dict[int, list[float]]] = {}
    for variant, runs in grouped.items():
        by_batch: dict[int, list[dict[str, Any]]] = {}
        for r in runs:
            for row in r.get("decode", []):
                by_batch.setdefault(row["batch"], []).append(row)
        per_run[variant] = {b: [row["ms_per_step"] for row in got] for b, got in by_batch.items()}
        rows[variant] = {
            b: {"ms_median": round(statistics.median(ms := per_run[variant][b]), 4), "ms_min": round(min(ms), 4),
                "ms_max": round(max(ms), 4), "runs": len(ms),
                "fraction_own_bw": round(statistics.median(row["fraction_of_roofline"] for row in got), 4),
                "fraction_median_bw": None if bw is None else
                round(1000 * got[0]["bytes_per_step"] / (bw * 1e12) / statistics.median(ms), 4)}
            for b, got in by_batch.items()}
    first = next(iter(per_run.values()), {})
    for variant, batches in rows.items():
        for b, row in batches.items():
            pairs = list(zip(per_run[variant][b], first.get(b, [])))
            row["vs_first_ms"] = round(statistics.median(a - f for a, f in pairs), 4) if pairs else None
            row["vs_first_runs"] = len(pairs)
    return {"copy_bandwidth_TBps": bw, "variants": rows}


def render(result: dict[str, Any]) -> str:
    bw = result["copy_bandwidth_TBps"]
    lines = [f"copy bandwidth (median of the records): {bw:.3f} TB/s" if bw else "copy bandwidth: not recorded"]
    for variant, batches in result["variants"].items():
        lines.append(variant)
        for b, r in batches.items():
            vs = "" if r["vs_first_ms"] is None else f", {r['vs_first_ms']:+.3f} ms vs the first ({r['vs_first_runs']} paired)"
            share = "" if r["fraction_median_bw"] is None else f", {100 * r['fraction_median_bw']:.1f} % at the median bandwidth"
            lines.append(f"  batch {b}: {r['ms_median']:.3f} ms ({r['ms_min']:.3f}-{r['ms_max']:.3f}, {r['runs']} runs), "
                         f"{100 * r['fraction_own_bw']:.1f} % of the roofline{share}{vs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return table_main(argv, __doc__.split("\n")[0], "decode_table", "bench/decode_engine.py records", table, render)


if __name__ == "__main__":
    sys.exit(main())
