"""bench/plots.py renders every chart from the recorded results, skips cleanly what is not recorded yet,
and takes the shapes the coming benchmark files are documented to have (served load, engine decode)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `bench.*` importable under a bare `pytest` too
    sys.path.append(str(ROOT))

from bench import plots

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_chart_renders_from_the_recorded_results(tmp_path: Path) -> None:
    report = plots.render(plots.RESULTS, tmp_path)
    assert set(report) == set(plots.CHARTS)
    for name in ("decode.png", "acceptance.png", "allreduce-fusion.png", "dp-combine.png"):
        assert report[name] == f"wrote {tmp_path / name}"
        assert (tmp_path / name).read_bytes().startswith(PNG) and (tmp_path / name).stat().st_size > 10_000
    served = report["served-latency.png"]
    assert served.startswith("wrote") or served == "skipped: no bench/results/*-served-load-*.json"


def test_the_readme_shows_the_charts_regenerated_by_the_documented_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python bench/plots.py" in readme or "make plots" in readme
    for name in plots.CHARTS:
        if (plots.IMAGES / name).exists():
            assert f"docs/images/{name}" in readme, name
    assert (plots.IMAGES / "decode.png").exists()


def test_without_results_every_chart_is_skipped_and_the_command_succeeds(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "results"
    empty.mkdir()
    assert plots.main(["--results", str(empty), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped: no bench/results/") == len(plots.CHARTS)
    assert list((tmp_path / "out").iterdir()) == []


def test_new_benchmark_files_plug_in(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    runs = [{"request_rate": r, "p50_ttft_ms": 20 * r, "p90_ttft_ms": 30 * r, "p99_ttft_ms": 45 * r,
             "p50_itl_ms": 5 + r, "p90_itl_ms": 7 + r, "p99_itl_ms": 9 + r} for r in (1, 2, 4, 8)]
    (results / "2099-01-01-served-load-test.json").write_text(json.dumps({"machine": "test", "runs": runs}))
    rows = [{"batch": b, "ms_per_step": 5.0 + b / 16, "tok_per_s": b * 1000 / (5.0 + b / 16),
             "pct_of_roofline_weights": 70.0} for b in (1, 2, 4, 8)]
    engine = {"machine": "test", "throughput": rows, "peer": {"name": "vLLM", "throughput": rows[:2]}}
    (results / "2099-01-01-decode-engine-test.json").write_text(json.dumps(engine))
    report = plots.render(results, tmp_path / "out")
    assert all(v.startswith("wrote") for v in report.values()), report
