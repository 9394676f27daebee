"""bench/plots.py renders every chart from the recorded results, skips cleanly what is not recorded, and
falls back to the older decode files where no engine decode run is recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    for name in plots.CHARTS:
        assert report[name] == f"wrote {tmp_path / name}"
        assert (tmp_path / name).read_bytes().startswith(PNG) and (tmp_path / name).stat().st_size > 10_000


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


def test_decode_falls_back_to_the_private_harness_files_and_skips_what_is_missing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    for path in [*results.glob("*-decode-engine-*.json"), *results.glob("*-serve-*.json")]:
        path.unlink()
    report = plots.render(results, tmp_path / "out")
    assert report["decode.png"].startswith("wrote")  # decode-roofline + decode-tp2
    assert report["served-latency.png"] == "skipped: no bench/results/*-serve-*.json"


def test_the_smollm2_record_has_its_own_chart_and_stays_out_of_the_tiny_pair_one(tmp_path: Path) -> None:
    """bench/spec_decode_real.py's record (SmolLM2 and its draft; ``numbers`` holds per-configuration speed-ups,
    lists and a bool, not ``{config: {acceptance_length}}``) is another model: the acceptance chart draws the tiny
    pair's files only, and spec-decode-real.png the newest real record."""
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    run = {"mtbench_turn1": {"tok_per_s": 500.0, "acceptance_length": 2.1, "speedup": 0.6}}
    real = {"machine": "1x NVIDIA H200", "what": "EAGLE3 d on /m/other-model through the engine",
            "numbers": {"speedup_engine": {"none@T=0": {"mtbench_turn1": {"tok_per_s": 800.0, "speedup": 1.0}},
                                           "chain-5@T=0": run},
                        "engine_done": ["none@T=0", "chain-5@T=0"], "greedy_equal_to_no_speculation": True}}
    (results / "2099-01-01-spec-decode-real.json").write_text(json.dumps(real))
    report = plots.render(results, tmp_path / "out")
    for name in ("acceptance.png", "spec-decode-real.png"):
        assert report[name] == f"wrote {tmp_path / 'out' / name}"


def test_of_two_records_of_one_date_the_one_committed_last_is_drawn(tmp_path: Path) -> None:
    """Names of one date do not order runs (``...-smollm2-tp3`` sorts before ``...-tiny-tp2``): git's order does,
    and a record not yet committed is the newest."""
    def git(*args: str, when: str = "1700000000") -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True, env={**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when})

    git("init", "-q")
    for name, when in (("2026-12-01-x-tiny.json", "1700000000"), ("2026-12-01-x-real.json", "1700000100")):
        (tmp_path / name).write_text(json.dumps({"run": name}))
        git("add", name)
        git("commit", "-q", "-m", name, when=when)
    assert plots.newest(tmp_path, "x")[0].name == "2026-12-01-x-real.json"
    (tmp_path / "2026-12-01-x-again.json").write_text("{}")  # recorded, not committed yet
    assert plots.newest(tmp_path, "x")[0].name == "2026-12-01-x-again.json"
    (tmp_path / "2026-12-02-x-a.json").write_text("{}")  # a later date wins whatever git says
    assert plots.newest(tmp_path, "x")[0].name == "2026-12-02-x-a.json"
